"""The planner beside a real router: SmolLM2 served by real `pdserve serve` processes, a
prefill-heavy step, a decode-heavy step and idle, with the planner sizing the pools as it goes.

Started with 1 prefill + 1 decode worker and a budget of 3: long prompts must add a prefill worker
(and not a decode one), many streams must bring a decode worker (moved from the prefill pool once
that is idle, the budget being full), and idle must bring both back to their minimum. Every request
completes. Short intervals and windows keep it to a couple of minutes; the law itself is tested
against scripted signals in test_planner_law.py.

Before it, the loop's own reading of the workers (when a silent worker is busy rather than stale,
what counts as pending supply, a target changed by someone else) on worker links fed their
messages directly, with a pool manager that only records what it is told.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from fakes import ScriptedConnector
from serving import Server

from pdserve import wire
from pdserve.costmodel import Step, chunk_attention
from pdserve.planner.law import LawSettings
from pdserve.planner.loop import Planner, PlannerSettings
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers import WorkerLink, WorkerSet
from pdserve.signals import Signals
from pdserve.slo import SLO

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "it",
    "rains",
    "in",
    "the",
]


@pytest.fixture(scope="module")
def smollm2() -> str:
    pytest.importorskip("tokenizers")
    return "smollm2-135m"


def text(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def send(url: str, prompts: list[tuple[str, int]], gap_s: float, concurrency: int) -> list[int]:
    """POST each (prompt, max_tokens) `gap_s` apart, at most `concurrency` at once; their statuses."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300.0) as client:

        async def one(prompt: str, max_tokens: int) -> int:
            async with limit:
                body = {
                    "model": "smollm2-135m",
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                }
                return (await client.post("/v1/completions", json=body)).status_code

        tasks = []
        for prompt, max_tokens in prompts:
            tasks.append(asyncio.create_task(one(prompt, max_tokens)))
            await asyncio.sleep(gap_s)
        return list(await asyncio.gather(*tasks))


def targets(server: Server) -> dict[str, int]:
    return {name: pool["target"] for name, pool in server.pools().items()}


def decisions(server: Server) -> list[dict[str, Any]]:
    """Oldest first."""
    return list(reversed(server.admin_view()["planner"]["decisions"]))


class RecordingPools:
    """A pool manager reduced to its targets: records what the planner sets."""

    def __init__(self, **targets: int) -> None:
        self.bounds = {name: (target, 1, 4) for name, target in targets.items()}
        self.calls: list[tuple[str, int]] = []

    def targets(self) -> dict[str, tuple[int, int, int]]:
        return dict(self.bounds)

    def set_planned_target(self, pool: str, replicas: int, reason: str) -> None:
        self.calls.append((pool, replicas))
        _, low, high = self.bounds[pool]
        self.bounds[pool] = (replicas, low, high)


def up_worker(workers: WorkerSet, worker_id: str, role: str) -> WorkerLink:
    link = workers.link(workers.add_worker(worker_id, role).worker_id)
    ready = wire.Ready(worker_id, role, "m", 8192, 49152, "tcp", "", "", 512, 512, 64)
    link._handle(ready)  # as if it had arrived on its socket
    link.up_at = time.monotonic() - 60.0  # up for a while: what the pool observed counts
    return link


def report(
    link: WorkerLink, step_s: float, *, queued: int = 0, running: int = 0, at: float | None = None
) -> None:
    """A load report from `link`'s worker, arrived now (or at `at`, on the monotonic clock)."""
    steps = [wire.StepSample(step_s, 512 if queued else 0, 0, running, running * 100)]
    load = wire.Load(
        link.worker_id, running, 1 if queued else 0, queued, 10, 500, 0, step_s * 1000, steps, 510, 16
    )
    link._handle(load)
    if at is not None:
        link.load_at = at


def with_workers(body: Callable[[WorkerSet, Signals], Awaitable[None]]) -> None:
    """Run `body` on a fresh worker set (links fed by hand, never connected) inside an event loop."""

    async def run() -> None:
        workers = WorkerSet(ScriptedConnector())
        try:
            await body(workers, Signals())
        finally:
            await workers.close()

    asyncio.run(run())


def planner_for(pools: RecordingPools, workers: WorkerSet, signals: Signals) -> Planner:
    settings = PlannerSettings(
        mode="slo", slo=SLO(ttft_s=1.0, itl_s=0.1), interval_s=1.0, max_workers=4,
        law=LawSettings(cooldown_s=10.0, downscale_window_s=5.0),
    )  # fmt: skip
    return Planner(settings, signals, workers, pools, RouterMetrics())


def breach_ttft(signals: Signals, now: float) -> None:
    for _ in range(6):  # TTFT 5 s with nothing known of the prompts' own time: a breach
        signals.first_token("prefill", 5.0, None, now)


def test_a_worker_silent_in_a_long_step_is_busy_not_stale() -> None:
    async def body(workers: WorkerSet, signals: Signals) -> None:
        prefill = up_worker(workers, "prefill-0", "prefill")
        up_worker(workers, "decode-0", "decode")
        pools = RecordingPools(prefill=1, decode=1)
        planner = planner_for(pools, workers, signals)
        report(prefill, 4.0, queued=3000)  # its chunks take 4 s: it reports every 4 s at best
        report(prefill, 0.05, queued=3000)  # a short step between them: the last says little
        for link in workers.links.values():
            if link is not prefill:
                report(link, 0.02)
        later = time.monotonic() + 6.0  # 6 s without a report: inside two of its steps
        breach_ttft(signals, later)
        planner.step(later)
        assert planner.views["prefill"].fresh
        assert pools.calls == [("prefill", 2)], planner.plans

    with_workers(body)


def test_a_worker_silent_for_many_of_its_steps_holds_its_pool() -> None:
    async def body(workers: WorkerSet, signals: Signals) -> None:
        prefill = up_worker(workers, "prefill-0", "prefill")
        report(prefill, 0.05)  # short steps, nothing queued: 6 s of silence is not work
        up_worker(workers, "decode-0", "decode")
        pools = RecordingPools(prefill=1, decode=1)
        planner = planner_for(pools, workers, signals)
        later = time.monotonic() + 6.0
        breach_ttft(signals, later)
        planner.step(later)
        assert not planner.views["prefill"].fresh
        assert pools.calls == [] and planner.plans["prefill"].reason.startswith("stale")

    with_workers(body)


def test_a_queue_that_builds_is_a_breach_before_any_prompt_is_done() -> None:
    async def body(workers: WorkerSet, signals: Signals) -> None:
        report(up_worker(workers, "prefill-0", "prefill"), 2.0, queued=4000)
        report(up_worker(workers, "decode-0", "decode"), 0.05)
        pools = RecordingPools(prefill=1, decode=1)
        planner = planner_for(pools, workers, signals)
        now = time.monotonic()
        for i in range(5):  # long prompts 1 s apart, no first token yet: waits of 1 to 5 s
            signals.awaiting_first_token(f"r{i}", "prefill", now - 5 + i, None)
        planner.step(now)
        # Their p90, interpolated between ranks (slo.quantile): 4.6 s, far past the 1 s TTFT SLO.
        assert planner.views["prefill"].observed_ttft == pytest.approx(4.6, abs=0.01)
        assert pools.calls == [("prefill", 2)]

    with_workers(body)


def test_a_prefill_pool_at_zero_gets_a_worker_for_the_demand_it_sees() -> None:
    async def body(workers: WorkerSet, signals: Signals) -> None:
        report(up_worker(workers, "decode-0", "decode"), 0.05)
        pools = RecordingPools(prefill=1, decode=1)
        pools.bounds["prefill"] = (0, 0, 4)  # scaled to nothing while idle
        planner = planner_for(pools, workers, signals)
        for tokens in (64, 128, 256, 512):  # a cost model that knows both kinds of step
            signals.cost.add(Step(tokens, chunk_attention(0, tokens)), 0.002 * tokens)
        for streams in range(1, 9):
            signals.cost.add(Step(0, 0, streams, streams * 100), 0.02 + 0.003 * streams)
        now = time.monotonic()
        for i in range(10):  # what the router counts while no prefill worker is up: 1 prompt/s
            signals.prompt_admitted("prefill", 400, 0.8, now - 9 + i)
        planner.step(now)
        # 0.8 s prompts at 1/s against a 1 s TTFT SLO want 4 workers; the budget of 4 leaves 3.
        assert pools.calls == [("prefill", 3)], planner.plans["prefill"]

    with_workers(body)


def test_pending_supply_is_not_asked_for_twice() -> None:
    async def body(workers: WorkerSet, signals: Signals) -> None:
        report(up_worker(workers, "prefill-0", "prefill"), 0.05)
        report(up_worker(workers, "decode-0", "decode"), 0.05)
        pools = RecordingPools(prefill=2, decode=1)  # a second prefill worker asked for, not up yet
        planner = planner_for(pools, workers, signals)
        now = time.monotonic()
        breach_ttft(signals, now)
        planner.step(now)
        assert planner.views["prefill"].starting == 1
        assert pools.calls == []  # the reactive +1 waits for the pending one

    with_workers(body)


def test_a_target_changed_by_someone_else_restarts_the_cooldown() -> None:
    async def body(workers: WorkerSet, signals: Signals) -> None:
        for worker_id, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode"),
                                ("decode-2", "decode")):  # fmt: skip
            up_worker(workers, worker_id, role)
        pools = RecordingPools(prefill=1, decode=3)
        planner = planner_for(pools, workers, signals)
        start = time.monotonic()

        def step(t: float) -> None:
            for link in workers.links.values():
                report(link, 0.05, at=start + t)
            planner.step(start + t)

        step(0)  # idle: decode wants 1; alone, it would go down once its 5 s window is over
        pools.bounds["decode"] = (2, 1, 4)  # an operator's PUT /pools at 4 s
        for t in (4, 5, 9, 13):  # the window starts again, and the 10 s cooldown holds it
            step(t)
            assert not pools.calls, (t, planner.plans["decode"])
        step(15)
        assert pools.calls == [("decode", 1)]

    with_workers(body)


def test_the_planner_follows_a_prefill_step_a_decode_step_and_idle(smollm2: str, tmp_path: Path) -> None:
    config = tmp_path / "pdserve.toml"
    # Few sequences per decode worker: 20 streams are then plainly more than one worker's share.
    config.write_text("[pools.decode]\nmax_num_seqs = 8\n")
    server = Server(
        smollm2,
        "--prefill", "1", "--decode", "1", "--max-workers", "3", "--planner", "slo",
        "--slo", "ttft=2000,itl=2000", "--planner-interval", "1", "--planner-cooldown", "2",
        "--planner-downscale-window", "6", "--num-kv-blocks", "512", "--config", str(config),
        "--log-level", "INFO",
    )  # fmt: skip
    rng = random.Random(0)
    try:
        # Past the workers' cold start (their first steps are left out of the cost model): awaited
        # as the server says it, each worker's time up against the cold start it keeps.
        cold = server.admin_view()["signals"]["cost_model"]["cold_start_s"]

        def past_cold_start() -> bool:
            up = [w for pool in server.pools().values() for w in pool["workers"] if w["state"] == "up"]
            return len(up) == 2 and all(w["up_s"] >= cold for w in up)

        server.wait_for(past_cold_start, 60, "the workers past their cold start")
        # How long one long prompt takes here alone (~4 s on a slow core, a tenth of that on a
        # fast one): the load below is sized by it, so that it overloads one worker on any machine.
        started = time.monotonic()
        assert asyncio.run(send(server.url, [(text(800, rng), 2)], gap_s=0.0, concurrency=1)) == [200]
        alone = time.monotonic() - started
        # 1. Prefill-heavy: long prompts (~800 tokens), together 4x the TTFT budget of one worker's
        # time, sent faster than it takes them; the decision is awaited while they queue.
        count = max(8, math.ceil(4 * 2.0 / alone))
        long_prompts = [(text(800, rng), 2) for _ in range(count)]
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(
                asyncio.run, send(server.url, long_prompts, gap_s=alone / 4, concurrency=count)
            )
            server.wait_for(
                lambda: any(d["pool"] == "prefill" and d["direction"] == "up" for d in decisions(server)),
                300, "a prefill worker added",
            )  # fmt: skip
            assert sent.result(timeout=600) == [200] * len(long_prompts)
        ups = [d for d in decisions(server) if d["direction"] == "up"]
        assert not any(d["pool"] == "decode" for d in ups), decisions(server)
        assert targets(server)["prefill"] == 2 and targets(server)["decode"] == 1
        # Each prefill worker's throughput, measured from its steps (prompt tokens per second).
        rates = [w["prefill_tokens_per_s"] for w in server.workers("prefill", "up")]
        assert any(r is not None and r > 10 for r in rates), rates

        # 2. Decode-heavy: many streams of short prompts. The budget is full: a worker moves (from
        # the prefill pool once its new worker is up: a pool with a worker still starting has none
        # to spare). Awaited while the streams run.
        server.wait_pool("prefill", 90, up=2, starting=0)
        streams = [(text(10, rng), 48) for _ in range(24)]
        with ThreadPoolExecutor(1) as pool:
            sent = pool.submit(asyncio.run, send(server.url, streams, gap_s=0.1, concurrency=24))
            server.wait_for(
                lambda: any(d["pool"] == "decode" and d["direction"] == "up" for d in decisions(server)),
                300, "a decode worker added",
            )  # fmt: skip
            assert sent.result(timeout=600) == [200] * len(streams)
        decode_ups = [d for d in decisions(server) if d["pool"] == "decode" and d["direction"] == "up"]
        assert decode_ups[-1]["reason"] in ("move", "predictive", "reactive")
        # By now the cost model has the workers' steps: it chose the paths.
        assert server.metric("pdserve_path_choices_total", reason="cost_model") > 0
        # ... and exported what it divided the ITL budget by (a gauge never set would read 0).
        assert server.metric("pdserve_cost_model_stall_margin") >= 1.0

        # 3. Idle: back to the minimum, through drains that lose nothing.
        server.wait_for(lambda: targets(server) == {"prefill": 1, "decode": 1}, 90, "both pools at 1")
        server.wait_pool("prefill", 60, up=1, draining=0, starting=0)
        server.wait_pool("decode", 60, up=1, draining=0, starting=0)
        assert server.metric("pdserve_requests_total", outcome="error") == 0
        assert server.metric("pdserve_planner_decisions_total", pool="prefill", direction="down") >= 1
        server.wait_kv_free()
    finally:
        assert server.stop() == 0
