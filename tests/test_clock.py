"""The control plane's clock: real by default; under a VirtualTimeLoop an hour of sleeps,
timeouts, pauses and periodic loops passes in no wall time, with the router's real parts on top
(what a simulation of a deployment needs)."""

from __future__ import annotations

import asyncio
import time

import pytest
from fakes import control_plane, expected_stream, until

from pdserve import clock
from pdserve.pools.manager import PoolSettings


def test_the_clock_is_the_processs_own_unless_a_source_is_given() -> None:
    before = time.monotonic()
    assert before <= clock.monotonic() <= time.monotonic()
    with clock.source(lambda: 42.0):
        assert clock.monotonic() == 42.0
    assert clock.monotonic() >= before


def test_an_hour_of_sleeps_and_timeouts_takes_no_wall_time() -> None:
    async def an_hour() -> tuple[float, float]:
        started = clock.monotonic()
        await asyncio.sleep(1800)
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(1800):
                await asyncio.Event().wait()  # nothing sets it: the timeout ends it
        return started, clock.monotonic()

    wall = time.monotonic()
    started, ended = clock.run_virtual(an_hour)  # type: ignore[misc]
    assert (started, ended) == (0.0, 3600.0)
    assert time.monotonic() - wall < 600.0  # however slow the machine: nothing waited for the hour


def test_the_pool_manager_keeps_its_pause_after_a_failed_start_in_virtual_time() -> None:
    # The pool manager's real logic over scripted workers: a failed start, the keeper's rounds,
    # the pause before the next try, counted on the virtual clock.
    settings = PoolSettings(start_timeout=600.0, drain_timeout=60.0, settle_seconds=0.0)

    async def scenario() -> tuple[float, float, list[str]]:
        async with control_plane({"decode": 1}, settings=settings) as cp:
            cp.cluster.failures["decode"] = 1
            cp.pools.scale("decode", 2)
            await until(lambda: cp.pools.describe()["pools"]["decode"]["last_error"] is not None, "failed")
            failed_at = clock.monotonic()
            await until(lambda: len(cp.up("decode")) == 2, "replaced after the pause", timeout=60)
            assert await cp.stream("r", 4, 3) == expected_stream(4, 3)
            return failed_at, clock.monotonic(), cp.up("decode")

    failed_at, up_at, up = clock.run_virtual(scenario)  # type: ignore[misc]
    assert up == ["decode-0", "decode-2"]
    assert 1.0 <= up_at - failed_at < 2.0  # the 1 s pause, then the keeper's next round
