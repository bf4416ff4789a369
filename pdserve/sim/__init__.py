"""The simulator's parts (issue 33): the real engine, worker and router logic in virtual time over
modelled steps and transfers. No torch."""
