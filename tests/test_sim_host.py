"""A shared host: the router's (and a client's) CPU per request and token, charged as it happens,
takes its share of the host's CPUs from the workers' steps over a sliding window."""

from __future__ import annotations

import asyncio

import pytest

from pdserve import clock
from pdserve.sim.host import MAX_SHARE, HostLoad
from pdserve.sim.profile import HostCpu

HOST = HostCpu(
    cpus=2, router_request_s=0.02, router_token_s=0.001, client_request_s=0.01, client_token_s=0.002
)


def test_the_share_is_the_recent_cpu_over_the_hosts_cpus() -> None:
    async def main() -> list[float]:
        host = HostLoad(HOST, client_on_host=False, window_s=2.0)
        seen = [host.share()]
        host.request()
        host.tokens(100)  # 0.02 + 0.1 CPU-seconds in the last 2 s, over 2 CPUs
        seen.append(host.share())
        await asyncio.sleep(2.5)  # out of the window
        seen.append(host.share())
        return seen

    assert clock.run_virtual(main) == pytest.approx([0.0, 0.12 / 2 / 2, 0.0])


def test_a_client_on_the_host_counts_and_the_share_is_capped() -> None:
    async def main() -> tuple[float, float, float]:
        with_client = HostLoad(HOST, client_on_host=True)
        with_client.request()
        with_client.tokens(10)
        flooded = HostLoad(HostCpu(cpus=1, router_token_s=1.0), client_on_host=False)
        flooded.tokens(100)
        return with_client.share(), flooded.share(), flooded.stretch()

    share, capped, stretch = clock.run_virtual(main)  # type: ignore[misc]
    assert share == pytest.approx((0.03 + 10 * 0.003) / 2.0 / 2)
    assert capped == MAX_SHARE and stretch == pytest.approx(1 / (1 - MAX_SHARE))


def test_the_routers_idle_work_is_always_there() -> None:
    async def main() -> float:
        return HostLoad(HostCpu(cpus=2, router_idle=0.1), client_on_host=False).stretch()

    assert clock.run_virtual(main) == pytest.approx(1 / (1 - 0.05))


def test_workers_are_pinned_as_the_local_cluster_pins_them() -> None:
    async def main() -> list[int | None]:
        host = HostLoad(HostCpu(cpus=2), client_on_host=False)
        placed = [host.place(w) for w in ("prefill-0", "decode-0", "prefill-1")]
        host.leave("decode-0")
        placed.append(host.place("decode-1"))  # the CPU left with the fewest workers
        placed.append(HostLoad(HostCpu(cpus=2), client_on_host=False, pinned=False).place("a"))
        return placed

    assert clock.run_virtual(main) == [0, 1, 0, 1, None]


def test_a_cpu_is_free_while_fewer_workers_than_cpus_are_placed() -> None:
    async def main() -> list[bool]:
        host = HostLoad(HostCpu(cpus=2), client_on_host=False)
        free = [host.free_cpu()]
        host.place("colocated-0")
        free.append(host.free_cpu())
        host.place("colocated-1")
        free.append(host.free_cpu())
        host.leave("colocated-0")  # stopped: its CPU is free again
        free.append(host.free_cpu())
        return free

    assert clock.run_virtual(main) == [True, True, False, True]


def test_a_step_slows_by_the_share_of_the_cpu_its_mates_take() -> None:
    async def main() -> dict[str, float]:
        host = HostLoad(HostCpu(cpus=2), client_on_host=False, window_s=2.0)
        for worker in ("a", "b", "c"):  # a and c share CPU 0; b has CPU 1 to itself
            host.place(worker)
        seen = {"idle mate": host.sharing("a", 0.1), "own cpu": host.sharing("b", 0.1)}
        host.occupy("c", 1.0)  # c works from now for 1 s: all of a's next step
        seen["mate busy ahead"] = host.sharing("a", 0.1)
        await asyncio.sleep(2.0)  # c worked 1 s of the last 2, and nothing now
        seen["mate busy half the window"] = host.sharing("a", 0.1)
        host.occupy("b", 5.0)  # another CPU's work does not slow a
        seen["other cpu busy"] = host.sharing("a", 0.1)
        host.leave("c")
        seen["mate gone"] = host.sharing("a", 0.1)
        return seen

    seen = clock.run_virtual(main)
    assert seen == pytest.approx(
        {
            "idle mate": 1.0,
            "own cpu": 1.0,
            "mate busy ahead": 2.0,  # half the CPU all the step long
            "mate busy half the window": 1 / (1 - 0.5 / 2),  # half the CPU half the time
            "other cpu busy": 1 / (1 - 0.5 / 2),
            "mate gone": 1.0,
        }
    )


def test_unpinned_workers_slow_only_when_more_are_busy_than_there_are_cpus() -> None:
    async def main() -> tuple[float, float]:
        host = HostLoad(HostCpu(cpus=2), client_on_host=False, pinned=False)
        for worker in ("a", "b", "c"):
            host.place(worker)
        host.occupy("b", 1.0)
        one_busy = host.sharing("a", 0.1)  # a and b: one each of the two CPUs
        host.occupy("c", 1.0)
        return one_busy, host.sharing("a", 0.1)  # three busy on two CPUs: two thirds of one each

    assert clock.run_virtual(main) == pytest.approx((1.0, 1.5))


def test_a_step_is_beside_what_the_other_workers_run_while_it_runs() -> None:
    async def main() -> list[float]:
        host = HostLoad(HostCpu(cpus=2), client_on_host=False)
        host.worked("prefill", 8.0)  # a prompt step of 8 s begins
        await asyncio.sleep(5.0)  # long after it began
        seen = [host.others_busy("decode", 0.05)]  # a decode step inside it: beside it all through
        seen.append(host.others_busy("decode", 0.0))  # no span (a step of no time): busy right now
        await asyncio.sleep(2.9)
        seen.append(host.others_busy("decode", 0.2))  # the last 0.1 s of it, then nothing
        seen.append(host.others_busy("prefill", 0.2))  # its own work is not its neighbour's
        await asyncio.sleep(1.0)
        seen.append(host.others_busy("decode", 0.05))  # it has ended
        return seen

    assert clock.run_virtual(main) == pytest.approx([1.0, 1.0, 0.5, 0.0, 0.0])


def test_a_pull_beside_the_workers_own_steps_shares_its_cpu_with_them() -> None:
    # A KV pull runs on a thread of its own in the worker, pinned to the worker's CPU: while the
    # worker's engine steps, the two share that CPU.
    async def main() -> dict[str, float]:
        host = HostLoad(HostCpu(cpus=2), client_on_host=False, window_s=2.0)
        for worker in ("a", "b"):
            host.place(worker)
        seen = {"idle engine": host.sharing("a", 0.01, beside_itself=True)}
        host.occupy("a", 1.0)  # its engine steps through the pull
        seen["engine stepping"] = host.sharing("a", 0.01, beside_itself=True)
        seen["a step of its own"] = host.sharing("a", 0.01)  # a step does not share with itself
        return seen

    assert clock.run_virtual(main) == pytest.approx(
        {"idle engine": 1.0, "engine stepping": 2.0, "a step of its own": 1.0}
    )


def test_a_start_beside_busy_mates_goes_at_the_pace_measured_for_it() -> None:
    # Measured: a start beside a busy CPU-mate took 3x its quiet time (the share of the CPU alone
    # says 2x); with k mates busy, 3x over the measurement's 2 ways of time-slicing times k + 1.
    async def main() -> dict[str, float]:
        host = HostLoad(HostCpu(cpus=2), client_on_host=False, window_s=2.0)
        for worker in ("a", "b", "c"):  # a and c share CPU 0; b has CPU 1 to itself
            host.place(worker)
        seen = {
            "own cpu": host.start_stretch("b", 0.25, 3.0),
            "mate idle": host.start_stretch("a", 0.25, 3.0),
        }
        host.occupy("c", 1.0)
        seen["mate busy"] = host.start_stretch("a", 0.25, 3.0)
        seen["mate busy, not measured"] = host.start_stretch("a", 0.25, 0.0)
        await asyncio.sleep(2.0)  # c worked 1 s of the last 2, and nothing now
        seen["mate busy half the time"] = host.start_stretch("a", 0.25, 3.0)
        host.place("d")  # CPU 1, beside b
        host.place("e")  # CPU 0: a's second mate
        host.occupy("c", 10.0)
        host.occupy("e", 10.0)
        seen["two mates busy"] = host.start_stretch("a", 0.25, 3.0)
        return seen

    assert clock.run_virtual(main) == pytest.approx(
        {
            "own cpu": 1.0,
            "mate idle": 1.0,
            "mate busy": 3.0,
            "mate busy, not measured": 2.0,
            # half the time at full pace, half at a third: the pace averaged, not the stretch
            "mate busy half the time": 1 / (0.5 * 1 + 0.5 / 3),
            "two mates busy": 3.0 * 3 / 2,
        }
    )


def test_a_starts_measured_pace_beside_busy_mates_has_the_routers_work_in_it() -> None:
    # The router keeps half of each CPU busy: a quiet CPU's start takes twice as long for it; beside
    # a busy mate the measured pace (taken while the host served) stands as it is.
    async def main() -> tuple[float, float]:
        host = HostLoad(HostCpu(cpus=2, router_idle=1.0), client_on_host=False)
        for worker in ("a", "b", "c"):
            host.place(worker)
        host.occupy("c", 10.0)
        return host.start_stretch("b", 0.25, 3.0), host.start_stretch("a", 0.25, 3.0)

    assert clock.run_virtual(main) == pytest.approx((2.0, 3.0))
