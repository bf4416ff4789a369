"""Measurements of this machine for `pdserve profile` (torch)."""
