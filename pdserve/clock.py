"""The control plane's clock: monotonic seconds, the process's own by default, an event loop's
virtual time in a simulation or a test (`VirtualTimeLoop`). No torch.

The router, the pool manager, the planner and the worker's core read time only through
`monotonic()`, so the same code runs against the wall clock while serving and against virtual time
when a simulation drives it: an hour of traffic with its timeouts, leases, pauses and windows in
however long the computation takes.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_source: Callable[[], float] = time.monotonic


def monotonic() -> float:
    """Now, in monotonic seconds, by the clock in force."""
    return _source()


@contextmanager
def source(clock: Callable[[], float]) -> Iterator[None]:
    """Read time from `clock` meanwhile (an event loop's `time`, say)."""
    global _source
    previous, _source = _source, clock
    try:
        yield
    finally:
        _source = previous


class _JumpingSelector(selectors.SelectSelector):
    """Looks for what is ready without waiting; when nothing is, moves the loop's virtual time on
    to its next timer instead of sleeping until it."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: VirtualTimeLoop | None = None

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer at all: only another thread can wake the loop
            return super().select(None)
        assert self.loop is not None
        self.loop.advance(timeout)
        return []


class VirtualTimeLoop(asyncio.SelectorEventLoop):
    """An event loop whose time is virtual: it starts at 0 and jumps to the next timer whenever
    nothing is ready, so sleeps, timeouts and periodic loops cost no wall time. Meant for code that
    waits only on the loop (timers, futures, in-memory channels); a real socket's data is still
    seen, but its arrival takes no virtual time."""

    def __init__(self) -> None:
        selector = _JumpingSelector()
        super().__init__(selector)
        selector.loop = self
        self._now = 0.0

    def time(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        self._now += max(0.0, seconds)


def run_virtual(coroutine_factory: Callable[[], object]) -> object:
    """Run `coroutine_factory()` on a fresh VirtualTimeLoop, with `monotonic()` reading its time."""
    loop = VirtualTimeLoop()
    try:
        with source(loop.time):
            return loop.run_until_complete(coroutine_factory())  # type: ignore[arg-type]
    finally:
        loop.close()
