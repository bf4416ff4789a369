"""Simulated workers (the real engine and worker cores over a modelled runner) behind the router's
real worker set and dispatcher, in virtual time: a request's timeline is exactly what the profile
says, step by step, and the router's commands (release, moves) work on them as on real workers."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from fakes import until
from test_worker_core import MODEL  # a modelled model: only its limits count

from pdserve import clock, wire
from pdserve.config import POOL_ROLES, EngineConfig, WorkerConfig
from pdserve.engine.sched import SchedulerOutput
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher, RequestState
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers import WorkerSet
from pdserve.sim.worker import SimConnector, SimWorker, token_at

# The profile: a step costs 5 ms, plus 0.1 ms a prompt token, plus 1 ms a decode stream; a pull 4 ms.
BASE, PER_PROMPT_TOKEN, PER_STREAM, PULL = 0.005, 0.0001, 0.001, 0.004


def step_seconds(out: SchedulerOutput) -> float:
    decodes = sum(1 for c in out.chunks if c.is_decode)
    prompt = sum(c.num_tokens for c in out.chunks if not c.is_decode)
    return BASE + PER_PROMPT_TOKEN * prompt + PER_STREAM * decodes


def sim_workers(pools: dict[str, int]) -> tuple[WorkerSet, SimConnector]:
    connector = SimConnector()
    workers = WorkerSet(connector)
    for pool, count in pools.items():
        for i in range(count):
            worker_id = f"{pool}-{i}"
            engine = EngineConfig("modelled", role=POOL_ROLES[pool], block_size=16)
            config = WorkerConfig(worker_id, pool, engine, transport="tcp")
            connector.factories[worker_id] = lambda events, c=config: SimWorker(
                c, MODEL, 256, events, step_seconds=step_seconds, pull_seconds=lambda _blocks: PULL
            )
            workers.add_worker(worker_id, pool, f"sim://{worker_id}", "sim")
    return workers, connector


async def timed_stream(dispatcher: Dispatcher, prompt: int, max_tokens: int) -> list[tuple[float, list[int]]]:
    params = wire.WireSamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = clock.monotonic()
    return [
        (clock.monotonic() - start, event.token_ids)
        async for event in dispatcher.generate(RequestState("r"), list(range(prompt)), params)
    ]


def run(body: Callable[[WorkerSet, SimConnector], object], pools: dict[str, int]) -> object:
    async def main() -> object:
        workers, connector = sim_workers(pools)
        try:
            while len(workers.up(*pools)) < sum(pools.values()):  # their Ready, at once
                await asyncio.sleep(0.001)
            return await body(workers, connector)  # type: ignore[misc]
        finally:
            await workers.close()

    return clock.run_virtual(main)


def test_one_request_takes_exactly_the_profiles_time_on_the_disaggregated_path() -> None:
    prompt, tokens = 300, 6

    async def body(workers: WorkerSet, connector: SimConnector) -> object:
        dispatcher = Dispatcher(workers, RouterConfig(local_prefill_threshold=16), RouterMetrics())
        timeline = await timed_stream(dispatcher, prompt, tokens)
        prefill = connector.workers["prefill-0"].engine
        await until(lambda: prefill.stats().kv_blocks_used == 0, "the prompt's blocks released")
        return timeline, connector

    timeline, connector = run(body, {"prefill": 1, "decode": 1})  # type: ignore[misc]
    ttft = BASE + PER_PROMPT_TOKEN * prompt  # one step of the whole prompt on the prefill worker
    decode_step = BASE + PER_STREAM
    expected = [ttft] + [ttft + PULL + k * decode_step for k in range(1, tokens)]
    assert [t for t, _ in timeline] == pytest.approx(expected, abs=1e-9)
    assert [tok for _, toks in timeline for tok in toks] == [token_at(prompt + i) for i in range(tokens)]
    assert connector.workers["decode-0"].engine.stats().kv_blocks_used == 0


def test_a_short_prompt_is_prefilled_on_the_decode_worker_itself() -> None:
    prompt, tokens = 10, 3

    async def body(workers: WorkerSet, connector: SimConnector) -> object:
        dispatcher = Dispatcher(workers, RouterConfig(local_prefill_threshold=16), RouterMetrics())
        return await timed_stream(dispatcher, prompt, tokens)

    timeline = run(body, {"prefill": 1, "decode": 1})
    first = BASE + PER_PROMPT_TOKEN * prompt
    expected = [first + k * (BASE + PER_STREAM) for k in range(tokens)]
    assert [t for t, _ in timeline] == pytest.approx(expected, abs=1e-9)  # type: ignore[union-attr]
