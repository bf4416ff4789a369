"""The planner's control law against a simulated cluster and scripted signals. Pure.

`World` plays the cluster: a target the law asks for becomes workers that are `starting` for a few
intervals, then up. Demand is scripted per interval; what the law sees is built from it the way
the loop builds it (prompts/s with their service time, streams, the observed percentiles).
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, field, replace

import pytest

from pdserve.planner.law import Decision, LawMemory, LawSettings, PoolView, decide, needed_workers
from pdserve.slo import SLO

SLO_ = SLO(ttft_s=1.0, itl_s=0.1)
INTERVAL = 5.0
SETTINGS = LawSettings(cooldown_s=10.0, downscale_window_s=30.0)


@dataclass
class Pool:
    target: int
    min: int = 1
    max: int = 4
    up: int = 0
    starting: list[int] = field(default_factory=list)  # intervals left for each starting worker

    def __post_init__(self) -> None:
        self.up = self.target


@dataclass
class World:
    pools: dict[str, Pool]
    budget: int = 4
    start_intervals: int = 2
    memory: LawMemory = field(default_factory=LawMemory)
    now: float = 0.0
    log: list[Decision] = field(default_factory=list)

    def view(self, name: str, **demand: object) -> PoolView:
        p = self.pools[name]
        return PoolView(
            name=name,
            target=p.target,
            up=p.up,
            starting=len(p.starting),
            min=p.min,
            max=p.max,
            fresh=bool(demand.pop("fresh", True)),
            slo=SLO_,
            model_ready=True,
            **demand,  # type: ignore[arg-type]
        )

    def tick(self, demand: dict[str, dict[str, object]]) -> list[Decision]:
        self.now += INTERVAL
        for p in self.pools.values():  # workers come up after start_intervals
            p.starting = [n - 1 for n in p.starting]
            p.up += sum(1 for n in p.starting if n <= 0)
            p.starting = [n for n in p.starting if n > 0]
        views = {name: self.view(name, **dict(d)) for name, d in demand.items()}
        decisions, _ = decide(views, self.budget, self.memory, self.now, SETTINGS)
        for d in decisions:
            p = self.pools[d.pool]
            if d.new > p.target:
                p.starting += [self.start_intervals] * (d.new - p.target)
            else:
                drop = p.target - d.new
                cancel = min(drop, len(p.starting))
                p.starting = p.starting[cancel:]
                p.up -= drop - cancel
            p.target = d.new
        self.log += decisions
        return decisions


def prefill_demand(rate: float, service: float = 0.4, **extra: object) -> dict[str, object]:
    return {"request_rate": rate, "service_s": service, **extra}


def decode_demand(streams: int, capacity: int = 16, **extra: object) -> dict[str, object]:
    return {"streams": streams, "stream_capacity": capacity, **extra}


def test_needed_workers_follow_demand_over_capacity_at_the_slo() -> None:
    w = World({"prefill": Pool(1), "decode": Pool(1)})
    light = needed_workers(w.view("prefill", **prefill_demand(0.5)), SETTINGS)[0]
    heavy = needed_workers(w.view("prefill", **prefill_demand(4.0)), SETTINGS)[0]
    assert light == 1 and heavy >= 2
    assert needed_workers(w.view("decode", **decode_demand(40)), SETTINGS)[0] == 3


def test_a_prefill_step_adds_prefill_workers_within_two_intervals_and_not_decode() -> None:
    w = World({"prefill": Pool(1), "decode": Pool(1)}, budget=5)
    for _ in range(3):
        assert not w.tick({"prefill": prefill_demand(0.5), "decode": decode_demand(4)})
    w.tick({"prefill": prefill_demand(5.0), "decode": decode_demand(4)})
    assert w.pools["prefill"].target >= 3, w.log
    assert w.pools["decode"].target == 1
    assert all(d.pool == "prefill" and d.direction == "up" for d in w.log)


def test_pending_workers_count_as_supply_so_a_start_is_not_asked_twice() -> None:
    w = World({"prefill": Pool(1), "decode": Pool(1)}, budget=5, start_intervals=4)
    for _ in range(4):  # the same pressure while the new workers start
        w.tick({"prefill": prefill_demand(3.0), "decode": decode_demand(2)})
    ups = [d for d in w.log if d.direction == "up"]
    assert len(ups) == 1, w.log


def test_reactive_correction_adds_one_when_the_observed_percentile_breaks() -> None:
    w = World({"prefill": Pool(1), "decode": Pool(2)}, budget=5)
    # The model says two decode workers are plenty, but the observed ITL p90 is over the SLO.
    d = w.tick({"prefill": prefill_demand(0.5), "decode": decode_demand(8, observed_itl=0.25)})
    assert [(x.pool, x.new, x.reason) for x in d] == [("decode", 3, "reactive")]
    # While that worker starts, no second one for the same breach.
    assert not w.tick({"prefill": prefill_demand(0.5), "decode": decode_demand(8, observed_itl=0.25)})


def test_a_long_prompt_that_misses_the_ttft_slo_on_its_own_adds_nothing() -> None:
    # TTFT 3 s > SLO 1 s, but it is the prompt's own prefill (wait 50 ms): workers cannot help.
    w = World({"prefill": Pool(1), "decode": Pool(1)})
    demand = prefill_demand(0.05, service=3.0, observed_ttft=3.0, observed_wait=0.05)
    for _ in range(4):
        assert not w.tick({"prefill": demand, "decode": decode_demand(1)})


def test_noisy_steady_load_does_not_oscillate() -> None:
    rng = random.Random(1)
    w = World({"prefill": Pool(2), "decode": Pool(2)}, budget=6)
    for _ in range(60):  # five minutes of load that needs two of each, +-25% noise
        w.tick(
            {
                "prefill": prefill_demand(2.4 * rng.uniform(0.75, 1.25)),
                "decode": decode_demand(round(24 * rng.uniform(0.75, 1.25))),
            }
        )
    assert needed_workers(w.view("decode", **decode_demand(24)), SETTINGS)[0] == 2
    assert len(w.log) <= 2, w.log  # at most one settling change per pool, no flapping


def test_scale_down_waits_for_the_stabilisation_window_then_drains_one_at_a_time() -> None:
    w = World({"prefill": Pool(3), "decode": Pool(3)}, budget=6)
    idle = {"prefill": prefill_demand(0.0), "decode": decode_demand(0)}
    times: list[float] = []
    for _ in range(30):
        for d in w.tick(idle):
            assert d.new == d.old - 1 and d.reason == "idle"
            times.append(w.now)
    assert w.pools["prefill"].target == w.pools["decode"].target == 1  # back to the minimum
    assert min(times) >= SETTINGS.downscale_window_s
    prefill_times = [t for t, d in zip(times, w.log, strict=True) if d.pool == "prefill"]
    assert all(b - a >= SETTINGS.cooldown_s for a, b in itertools.pairwise(prefill_times))


def test_a_blip_of_demand_restarts_the_window() -> None:
    w = World({"prefill": Pool(2), "decode": Pool(1)}, budget=4)
    for i in range(12):
        rate = 4.0 if i == 4 else 0.0  # one busy interval in the middle
        w.tick({"prefill": prefill_demand(rate), "decode": decode_demand(0)})
    downs = [d for d in w.log if d.pool == "prefill" and d.direction == "down"]
    # 0..3 idle (not yet 30 s), 4 busy (window reset), 5..11 idle: 35 s < the window + one interval
    assert not downs or downs[0] is not w.log[0]
    assert w.pools["prefill"].target >= 1


def test_bounds_are_respected() -> None:
    w = World({"prefill": Pool(1, min=1, max=2), "decode": Pool(2, min=2, max=2)}, budget=8)
    for _ in range(5):
        w.tick({"prefill": prefill_demand(20.0), "decode": decode_demand(0)})
    assert w.pools["prefill"].target == 2  # wanted more, max 2
    assert w.pools["decode"].target == 2  # idle, min 2


def test_the_budget_is_never_exceeded() -> None:
    w = World({"prefill": Pool(1), "decode": Pool(1)}, budget=3)
    for _ in range(6):
        w.tick({"prefill": prefill_demand(20.0), "decode": decode_demand(100)})
        assert sum(p.target for p in w.pools.values()) <= 3


def test_hold_on_stale_signals() -> None:
    w = World({"prefill": Pool(1), "decode": Pool(3)}, budget=6)
    for _ in range(20):  # idle but the decode pool's reports are late: nothing changes there
        w.tick({"prefill": prefill_demand(0.5), "decode": decode_demand(0, fresh=False)})
    assert w.pools["decode"].target == 3
    w.tick({"prefill": prefill_demand(0.5), "decode": decode_demand(60, fresh=False)})
    assert w.pools["decode"].target == 3


def test_a_full_budget_moves_a_worker_to_the_pool_under_pressure() -> None:
    w = World({"prefill": Pool(1), "decode": Pool(2)}, budget=3)
    for _ in range(3):
        w.tick({"prefill": prefill_demand(0.5), "decode": decode_demand(20)})  # decode needs 2
    assert not w.log
    w.tick({"prefill": prefill_demand(4.0), "decode": decode_demand(4)})  # prefill now, decode slack
    moves = sorted((d.pool, d.old, d.new, d.reason) for d in w.log)
    assert moves == [("decode", 2, 1, "move"), ("prefill", 1, 2, "move")]
    assert sum(p.target for p in w.pools.values()) == 3


def test_no_move_when_the_other_pool_has_no_slack() -> None:
    w = World({"prefill": Pool(1), "decode": Pool(2)}, budget=3)
    for _ in range(4):
        w.tick({"prefill": prefill_demand(4.0), "decode": decode_demand(30)})
    assert w.pools["decode"].target == 2 and w.pools["prefill"].target == 1


@pytest.mark.parametrize("cold_reason", ["cost model not ready"])
def test_without_a_model_only_the_reactive_correction_acts(cold_reason: str) -> None:
    w = World({"prefill": Pool(1), "decode": Pool(1)})
    views = {
        "prefill": replace(w.view("prefill", **prefill_demand(9.0)), model_ready=False),
        "decode": replace(w.view("decode", **decode_demand(50)), model_ready=False),
    }
    decisions, plans = decide(views, 4, w.memory, 5.0, SETTINGS)
    assert not decisions
    assert cold_reason in plans["prefill"].reason
    views["decode"] = replace(views["decode"], observed_itl=0.3)
    decisions, _ = decide(views, 4, w.memory, 10.0, SETTINGS)
    assert [(d.pool, d.reason) for d in decisions] == [("decode", "reactive")]


def test_an_idle_stream_pool_keeps_one_worker_even_with_min_zero() -> None:
    # With no decode worker up every request is a 503 before its demand is seen: never zero.
    w = World({"prefill": Pool(1, min=0), "decode": Pool(2, min=0)}, budget=4)
    for _ in range(30):
        w.tick({"prefill": prefill_demand(0.0), "decode": decode_demand(0)})
    assert w.pools["decode"].target == 1
    assert w.pools["prefill"].target == 0  # a prefill pool may empty: its demand is still seen


def test_draining_workers_count_against_the_budget() -> None:
    w = World({"prefill": Pool(1), "decode": Pool(1)}, budget=3)
    views = {
        "prefill": w.view("prefill", **prefill_demand(9.0)),
        "decode": replace(w.view("decode", **decode_demand(2)), draining=1),
    }
    decisions, plans = decide(views, 3, w.memory, 5.0, SETTINGS)
    assert not decisions  # 1 + 1 + 1 draining: the budget is spent until the drain ends
    assert "budget full" in plans["prefill"].reason
