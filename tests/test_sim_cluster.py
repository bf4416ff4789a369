"""The simulation's cluster backend: a worker "starts" in the profile's start time of work on its
CPU, so one starting on a CPU that another worker keeps busy takes longer, and takes that CPU
from it; a start that cannot finish within the ready timeout is refused plainly. A step's time
deviates from the profile's fit as its measured steps did."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest
from test_sim_profile import fixed_profile

from pdserve import clock
from pdserve.cli import main
from pdserve.cluster.base import WorkerStartError
from pdserve.config import POOL_ROLES, EngineConfig, WorkerConfig
from pdserve.costmodel import Step
from pdserve.sim.cluster import SimCluster, drawn
from pdserve.sim.host import HostLoad
from pdserve.sim.profile import HostCpu, LoopTime
from pdserve.sim.step_time import LinearStep, Spread
from pdserve.sim.worker import SimConnector


def config(worker_id: str) -> WorkerConfig:
    engine = EngineConfig("tiny", role=POOL_ROLES["colocated"], block_size=16)
    return WorkerConfig(worker_id, "colocated", engine)


def start_times(cpus: int | None, workers: list[str], pinned: bool = True) -> list[float]:
    """When each of `workers`, all started at once, is up (profile start time 4 s)."""
    profile = fixed_profile(start_s=4.0)

    async def main() -> list[float]:
        host = None if cpus is None else HostLoad(HostCpu(cpus=cpus), client_on_host=False, pinned=pinned)
        cluster = SimCluster(profile, SimConnector(), host)
        begun = clock.monotonic()

        async def start(worker_id: str) -> float:
            await cluster.start_worker(config(worker_id), timeout=60.0)
            return clock.monotonic() - begun

        return list(await asyncio.gather(*(start(w) for w in workers)))

    return clock.run_virtual(main)


def test_a_worker_alone_on_its_cpu_starts_in_the_profiles_time() -> None:
    assert start_times(None, ["a"]) == [4.0]  # no host (a GPU deployment): the profile's time
    assert start_times(2, ["a", "b"]) == pytest.approx([4.0, 4.0])  # one CPU each


def test_two_workers_starting_on_one_cpu_take_twice_as_long() -> None:
    # Each has half the CPU while both load (to a tick of the reckoning).
    assert start_times(1, ["a", "b"]) == pytest.approx([8.0, 8.0], abs=0.3)
    # Unpinned on two CPUs, the OS gives each its own.
    assert start_times(2, ["a", "b", "c"], pinned=False) == pytest.approx([6.0] * 3, abs=0.3)


def test_a_start_takes_longer_beside_the_routers_work_whatever_the_steps_fit() -> None:
    # The router keeps half of each of the two CPUs busy: a start (timed on a quiet host) gets the
    # other half, also with a profile fitted to served steps (whose steps have the router in them).
    for stretches in (True, False):

        async def main(stretches: bool = stretches) -> float:
            host = HostLoad(HostCpu(cpus=2, router_idle=1.0), client_on_host=False, stretches=stretches)
            cluster = SimCluster(fixed_profile(start_s=4.0), SimConnector(), host)
            begun = clock.monotonic()
            await cluster.start_worker(config("a"), timeout=60.0)
            return clock.monotonic() - begun

        assert clock.run_virtual(main) == pytest.approx(8.0), stretches


def test_a_scale_up_beside_a_busy_worker_takes_the_profiles_time_measured_for_it() -> None:
    # The profile timed a start at 4 s quiet and 12 s beside a busy worker while serving (a VM's
    # page faults under load: more than the half of the CPU the mate leaves would say, 8 s).
    async def main(start_busy_s: float) -> tuple[float, float]:
        profile = replace(fixed_profile(start_s=4.0), start_busy_s=start_busy_s)
        host = HostLoad(HostCpu(cpus=2), client_on_host=False)
        cluster = SimCluster(profile, SimConnector(), host)
        host.place("busy")  # CPU 0, busy all along
        host.occupy("busy", 100.0)
        begun = clock.monotonic()
        await cluster.start_worker(config("alone"), timeout=60.0)  # CPU 1
        alone = clock.monotonic() - begun
        begun = clock.monotonic()
        await cluster.start_worker(config("beside"), timeout=60.0)  # CPU 0 (fewest workers; lowest)
        return alone, clock.monotonic() - begun

    assert clock.run_virtual(lambda: main(12.0)) == pytest.approx((4.0, 12.0))
    assert clock.run_virtual(lambda: main(0.0)) == pytest.approx((4.0, 8.0))  # not measured: the share


def test_a_start_that_cannot_finish_in_time_is_refused_and_frees_its_cpu() -> None:
    profile = fixed_profile(start_s=4.0)

    async def main() -> tuple[str, float, float]:
        host = HostLoad(HostCpu(cpus=1), client_on_host=False)
        cluster = SimCluster(profile, SimConnector(), host)
        host.place("busy")
        host.occupy("busy", 100.0)  # another worker keeps the one CPU busy
        begun = clock.monotonic()
        with pytest.raises(WorkerStartError) as refused:
            await cluster.start_worker(config("late"), timeout=6.0)  # 8 s at half the CPU
        return str(refused.value), clock.monotonic() - begun, host.sharing("busy", 1.0)

    message, waited, busy_slowed = clock.run_virtual(main)
    assert "longer to start than --ready-timeout 6 s" in message and "shares" in message
    assert waited == pytest.approx(6.0)
    assert busy_slowed == 1.0  # the refused worker no longer shares the busy one's CPU


def test_a_step_deviates_from_its_fit_as_the_profiles_measured_quantiles_say() -> None:
    quantiles = (0.9, 1.0, 1.0, 1.0, 2.0)  # at 0.1, 0.3, 0.5, 0.7 and 0.9
    assert drawn(quantiles, 0.5) == 1.0
    assert drawn(quantiles, 0.8) == pytest.approx(1.5)  # linear between two quantiles
    assert drawn(quantiles, 0.0) == 0.9 and drawn(quantiles, 0.99) == 2.0  # the ends beyond them
    assert drawn((1.3,), 0.2) == 1.3


def test_simulated_steps_spread_and_add_up_as_the_measured_ones(tmp_path: Path) -> None:
    # Served steps have a right tail: one in five twice the fit. The simulated decode steps then
    # take the fit's time at their median and twice it at their 90th percentile, and a run's
    # inter-token times with them.
    base = fixed_profile(step=0.01)
    itl = {}
    for name, spread in (("fit", ()), ("tail", (Spread(None, (1.0, 1.0, 1.0, 1.0, 2.0)),))):
        step = replace(base.steps["decode"], spread=spread)
        assert isinstance(step, LinearStep)
        replace(base, steps={"prefill": step, "decode": step}).save(tmp_path / f"{name}.json")
        out = tmp_path / name
        code = main(
            ["sim", "--profile", str(tmp_path / f"{name}.json"), "--colocated", "1", "--workload",
             "poisson(2) prompt=fixed(16) output=fixed(60)", "--max-requests", "20", "--out", str(out)]
        )  # fmt: skip
        assert code == 0
        itl[name] = json.loads((out / "summary.json").read_text())["overall"]["itl_ms"]
    assert itl["fit"]["p50"] == pytest.approx(10.0, rel=0.02) and itl["fit"]["p90"] < 11.0
    assert itl["tail"]["p50"] == pytest.approx(10.0, rel=0.05)
    assert itl["tail"]["p90"] == pytest.approx(20.0, rel=0.1)


def test_a_simulated_step_with_a_prompt_beside_streams_deviates_as_the_measured_mixed_ones(
    tmp_path: Path,
) -> None:
    # The profile says served steps with prompt tokens beside decode streams ran 3x their fit and
    # every other step as fitted: the simulated worker's steps, traced, do the same.
    base = fixed_profile(step=0.01, per_token=1e-4, per_stream=1e-3)
    step = replace(base.steps["decode"], spread=(Spread(None, (1.0,)),), mixed_spread=(3.0,))
    assert isinstance(step, LinearStep)
    replace(base, steps={"prefill": step, "decode": step}).save(tmp_path / "p.json")
    trace = tmp_path / "steps.jsonl"
    code = main(
        ["sim", "--profile", str(tmp_path / "p.json"), "--colocated", "1", "--workload",
         "poisson(4) prompt=fixed(32) output=fixed(30)", "--max-requests", "20", "--step-trace", str(trace),
         "--out", str(tmp_path / "run")]
    )  # fmt: skip
    assert code == 0
    ratios: dict[bool, list[float]] = {True: [], False: []}
    for line in trace.read_text().splitlines():
        row = json.loads(line)
        features = Step(
            row["prefill_tokens"], row["prefill_attention"], row["decode_streams"], row["decode_context"]
        )
        mixed = features.prefill_tokens > 0 and features.decode_streams > 0
        ratios[mixed].append(row["seconds"] / step.seconds(features))
    assert len(ratios[True]) >= 5 and len(ratios[False]) >= 20
    assert ratios[True] == pytest.approx([3.0] * len(ratios[True]), rel=1e-3)
    assert ratios[False] == pytest.approx([1.0] * len(ratios[False]), rel=1e-3)


@pytest.mark.parametrize(("workers", "ratio", "loop_s"), [(1, 1.0, 0.0005), (2, 2.0, 0.002)])
def test_a_worker_that_leaves_a_cpu_free_deviates_and_loops_as_the_free_runs(
    tmp_path: Path, workers: int, ratio: float, loop_s: float
) -> None:
    # On two CPUs the profile's served steps ran at twice their fit where every CPU had a worker,
    # as fitted where one was free, and their loops took 2 ms against 0.5: colocated 1 steps and
    # loops as the latter, colocated 2 as the former.
    base = replace(fixed_profile(step=0.01, per_token=1e-4, per_stream=1e-3), host=HostCpu(cpus=2))
    step = replace(base.steps["decode"], spread=(Spread(None, (2.0,)),), free_spread=(Spread(None, (1.0,)),))
    assert isinstance(step, LinearStep)
    replace(
        base,
        steps={"prefill": step, "decode": step},
        steps_from="serving",
        loops={"decode": LoopTime(0.002)},
        free_loops={"decode": LoopTime(0.0005)},
    ).save(tmp_path / "p.json")
    trace = tmp_path / "steps.jsonl"
    code = main(
        ["sim", "--profile", str(tmp_path / "p.json"), "--colocated", str(workers), "--workload",
         "poisson(4) prompt=fixed(32) output=fixed(30)", "--max-requests", "20", "--step-trace", str(trace),
         "--out", str(tmp_path / "run")]
    )  # fmt: skip
    assert code == 0
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert len({row["worker"] for row in rows}) == workers and len(rows) >= 20
    for row in rows:
        features = Step(
            row["prefill_tokens"], row["prefill_attention"], row["decode_streams"], row["decode_context"]
        )
        assert row["seconds"] / step.seconds(features) == pytest.approx(ratio, rel=1e-3)
        assert row["loop_seconds"] == pytest.approx(loop_s, rel=1e-3)
