"""Simulated workers (the real engine and worker cores over a modelled runner) behind the router's
real worker set and dispatcher, in virtual time: a request's timeline is exactly what the profile
says, step by step, and the router's commands (release, moves) work on them as on real workers."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path

import pytest
from fakes import until
from test_worker_core import MODEL  # a modelled model: only its limits count

from pdserve import clock, wire
from pdserve.config import POOL_ROLES, EngineConfig, WorkerConfig
from pdserve.engine.sched_types import SchedulerOutput
from pdserve.modelfiles.config import ModelConfig
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.metrics import RouterMetrics
from pdserve.router.prefix import PromptKeys
from pdserve.router.request_state import RequestState
from pdserve.router.workers import WorkerSet
from pdserve.sim.worker import SimConnector, SimWorker, token_at

# The profile: a step costs 5 ms, plus 0.1 ms a prompt token, plus 1 ms a decode stream; a pull 4 ms.
BASE, PER_PROMPT_TOKEN, PER_STREAM, PULL = 0.005, 0.0001, 0.001, 0.004


def step_seconds(out: SchedulerOutput) -> float:
    decodes = sum(1 for c in out.chunks if c.is_decode)
    prompt = sum(c.num_tokens for c in out.chunks if not c.is_decode)
    return BASE + PER_PROMPT_TOKEN * prompt + PER_STREAM * decodes


def sim_workers(
    pools: dict[str, int], device_type: str = "cuda", model: ModelConfig = MODEL, **settings: object
) -> tuple[WorkerSet, SimConnector]:
    connector = SimConnector()
    workers = WorkerSet(connector)
    for pool, count in pools.items():
        for i in range(count):
            worker_id = f"{pool}-{i}"
            engine = EngineConfig("modelled", role=POOL_ROLES[pool], block_size=16)
            config = WorkerConfig(worker_id, pool, engine, transport="tcp", **settings)  # type: ignore[arg-type]
            connector.factories[worker_id] = lambda events, c=config: SimWorker(
                c, model, 256, events, step_seconds=step_seconds, pull_seconds=lambda _blocks: (PULL, PULL),
                device_type=device_type,
            )  # fmt: skip
            workers.add_worker(worker_id, pool, f"sim://{worker_id}", "sim")
    return workers, connector


async def timed_stream(dispatcher: Dispatcher, prompt: int, max_tokens: int) -> list[tuple[float, list[int]]]:
    params = wire.WireSamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    start = clock.monotonic()
    return [
        (clock.monotonic() - start, event.token_ids)
        async for event in dispatcher.generate(RequestState("r"), list(range(prompt)), params)
    ]


def run(
    body: Callable[[WorkerSet, SimConnector], object],
    pools: dict[str, int],
    device_type: str = "cuda",
    model: ModelConfig = MODEL,
    **settings: object,
) -> object:
    async def main() -> object:
        workers, connector = sim_workers(pools, device_type, model, **settings)
        try:
            while len(workers.up(*pools)) < sum(pools.values()):  # their Ready, at once
                await asyncio.sleep(0.001)
            return await body(workers, connector)  # type: ignore[misc]
        finally:
            await workers.close()

    return clock.run_virtual(main)


async def first_token_times(
    dispatcher: Dispatcher, arrivals: dict[str, tuple[int, float]]
) -> dict[str, float]:
    """Each request's first token, from now: `arrivals` name -> (prompt tokens, when it comes).
    Its prompt's ids are its own (from its name's first letter): no prompt shares a prefix."""
    start = clock.monotonic()
    first: dict[str, float] = {}

    async def one(name: str, prompt: int, delay: float) -> None:
        await asyncio.sleep(delay)
        params = wire.WireSamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        tokens = [ord(name[0]) * 100 + i for i in range(prompt)]
        async for event in dispatcher.generate(RequestState(name), tokens, params):
            if event.token_ids and name not in first:
                first[name] = clock.monotonic() - start

    await asyncio.gather(*(one(name, prompt, delay) for name, (prompt, delay) in arrivals.items()))
    return first


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


def test_the_router_knows_what_each_simulated_worker_has_cached_without_waiting_for_a_load_report() -> None:
    prompt = list(range(300))

    async def body(workers: WorkerSet, connector: SimConnector) -> object:
        dispatcher = Dispatcher(workers, RouterConfig(local_prefill_threshold=16), RouterMetrics())
        params = wire.WireSamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        async for _ in dispatcher.generate(RequestState("r"), prompt, params):
            pass
        answered = clock.monotonic()
        keys = PromptKeys([*prompt, 7])  # the conversation's next turn, say

        def cached(worker_id: str) -> int:
            view = workers.view(worker_id)
            return view.cached_tokens(keys) if view is not None else 0

        # They say what they keyed: the prompt on the prefill worker, the pulled KV on the decode
        # worker (whole blocks of 16). Load reports come every 30 s here (one at the start): only
        # the report of the prefix cache's news, 10 ms after its step, can have said it by now.
        await until(lambda: cached("prefill-0") == 288 and cached("decode-0") == 288, "the keys reported")
        return clock.monotonic() - answered

    waited = run(body, {"prefill": 1, "decode": 1}, load_interval=30.0)
    assert waited <= 0.01  # type: ignore[operator]


def test_a_short_prompt_is_prefilled_on_the_decode_worker_itself() -> None:
    prompt, tokens = 10, 3

    async def body(workers: WorkerSet, connector: SimConnector) -> object:
        dispatcher = Dispatcher(workers, RouterConfig(local_prefill_threshold=16), RouterMetrics())
        return await timed_stream(dispatcher, prompt, tokens)

    timeline = run(body, {"prefill": 1, "decode": 1})
    first = BASE + PER_PROMPT_TOKEN * prompt
    expected = [first + k * (BASE + PER_STREAM) for k in range(tokens)]
    assert [t for t, _ in timeline] == pytest.approx(expected, abs=1e-9)  # type: ignore[union-attr]


def test_a_short_prompt_runs_between_two_layers_of_a_long_prompts_step_on_a_cpu_prefill_worker() -> None:
    """As on a real CPU prefill worker: a short prompt that arrives during a long prompt's step
    runs at the next layer boundary (MODEL has 2 layers: half way), and the long step waits for it."""
    long_step = BASE + PER_PROMPT_TOKEN * 240  # one step (the prefill chunk is 256)
    short_step = BASE + PER_PROMPT_TOKEN * 20

    async def body(workers: WorkerSet, connector: SimConnector) -> object:
        dispatcher = Dispatcher(workers, RouterConfig(local_prefill_threshold=16), RouterMetrics())
        first = await first_token_times(dispatcher, {"long": (240, 0.0), "short": (20, 0.005)})
        assert connector.workers["prefill-0"].engine.steps_between_layers == 1
        return first

    first = run(body, {"prefill": 1, "decode": 1}, device_type="cpu")
    assert first == pytest.approx(
        {"short": long_step / 2 + short_step, "long": long_step + short_step}, abs=1e-9
    )


def test_prompts_that_come_during_a_layer_run_at_its_end_and_the_long_step_resumes_after_them() -> None:
    """Eight layers: a short prompt that comes during the second layer of a long prompt's step runs
    at that layer's end; one that comes after it runs at the end of the layer in progress then,
    the layers counted on from where the first short step ended. The long step ends last."""
    model = dataclasses.replace(MODEL, num_layers=8)
    long_step = BASE + PER_PROMPT_TOKEN * 240
    layer = long_step / 8
    short_step = BASE + PER_PROMPT_TOKEN * 20

    async def body(workers: WorkerSet, connector: SimConnector) -> object:
        dispatcher = Dispatcher(workers, RouterConfig(local_prefill_threshold=16), RouterMetrics())
        a_comes = 1.4 * layer  # during the second layer
        b_comes = 2 * layer + short_step + 0.3 * layer  # during the third, which began after A's step
        first = await first_token_times(
            dispatcher, {"long": (240, 0.0), "a": (20, a_comes), "b": (20, b_comes)}
        )
        assert connector.workers["prefill-0"].engine.steps_between_layers == 2
        return first

    first = run(body, {"prefill": 1, "decode": 1}, device_type="cpu", model=model)
    a_ends = 2 * layer + short_step
    b_ends = a_ends + layer + short_step
    assert first == pytest.approx({"a": a_ends, "b": b_ends, "long": long_step + 2 * short_step}, abs=1e-9)


class RecordingRunner:
    """Passes every step to `runner`, keeping what the scheduler decided: per step, each chunk's
    (request, first position, tokens, decode?)."""

    def __init__(self, runner: object) -> None:
        self.runner = runner
        self.decisions: list[list[tuple[str, int, int, bool]]] = []

    def execute(self, out: SchedulerOutput, kv: object, between_layers: object = None) -> object:
        self.decisions.append(
            [(c.request.request_id, c.start, c.num_tokens, c.is_decode) for c in out.chunks]
        )
        return self.runner.execute(out, kv, between_layers)  # type: ignore[attr-defined]

    def release(self, request_id: str) -> None:
        self.runner.release(request_id)  # type: ignore[attr-defined]

    def generator_state(self, request_id: str) -> bytes | None:
        return self.runner.generator_state(request_id)  # type: ignore[attr-defined,no-any-return]


def test_the_scheduler_decides_the_same_steps_over_the_model_and_over_the_profile(tiny_llama: Path) -> None:
    """The simulator's engine is the engine: on the same requests, the scheduler picks the same
    chunks, step by step (chunking, the step budget, preemption when the cache is short, prefixes
    found in the cache), whether the real model runs them or the profile times them."""
    from pdserve.config import Role
    from pdserve.engine.core import engine_core
    from pdserve.engine.factory import build_engine
    from pdserve.sampling_params import SamplingParams
    from pdserve.sim.worker import ModelledRunner

    config = EngineConfig(
        str(tiny_llama), device="cpu", dtype="float32", role=Role.MIXED, block_size=16,
        num_kv_blocks=8, chunk_size=32, max_num_batched_tokens=48, max_num_seqs=3,
    )  # fmt: skip
    real, _ = build_engine(config, eos_token_ids=(0,))
    real.runner = RecordingRunner(real.runner)  # type: ignore[assignment]
    modelled_runner = RecordingRunner(ModelledRunner(lambda _out: 0.001, 320))
    model_config = real.runner.runner.config  # type: ignore[attr-defined]
    modelled = engine_core(config, model_config, modelled_runner, (0,), 8, "cpu")
    for engine in (real, modelled):
        for request_id, prompt, tokens in (("a", 40, 6), ("b", 10, 9), ("c", 70, 5), ("d", 20, 4)):
            params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
            engine.add_request(request_id, [1 + i % 300 for i in range(prompt)], params)
        steps = 0
        while engine.has_unfinished and steps < 500:
            engine.step()
            steps += 1
        assert not engine.has_unfinished
    decisions = real.runner.decisions  # type: ignore[attr-defined]
    assert decisions == modelled_runner.decisions
    assert any(len(step) > 1 for step in decisions)  # batched steps
    computed: dict[str, int] = {}  # how far each request got
    again = 0  # prompt chunks of tokens computed before: preempted, then prefilled again
    for step in decisions:
        for request_id, start, n, decode in step:
            again += not decode and start < computed.get(request_id, 0)
            computed[request_id] = start + n
    assert again > 0, "the 128-token cache made the scheduler preempt and prefill again"
    # The prompts share their first tokens: both engines found the same blocks in their caches.
    assert real.kv.prefix_hits > 0 and real.kv.prefix_hits == modelled.kv.prefix_hits
