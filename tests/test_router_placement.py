"""Placement: the views it builds from the router's live links reach the path choice with the
server's own settings (its SLO percentile, its ITL budget). A real WorkerSet whose links said
Ready and sent a load report; no sockets carry requests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from fakes import ScriptedConnector

from pdserve import wire
from pdserve.blockkeys import prompt_keys
from pdserve.costmodel import MIXED_MIN_SAMPLES, Step
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.metrics import RouterMetrics
from pdserve.router.prefix import PromptKeys
from pdserve.router.workers import WorkerLink, WorkerSet
from pdserve.slo import SLO


def run(scenario: Callable[[WorkerSet], None]) -> None:
    """`scenario(workers)` with a prefill worker 4000 prompt tokens behind and an idle decode worker."""

    async def main() -> None:
        workers = WorkerSet(ScriptedConnector())
        try:
            for worker_id, role, queued in (("prefill-0", "prefill", 4000), ("decode-0", "decode", 0)):
                link: WorkerLink = workers.link(workers.add_worker(worker_id, role).worker_id)
                link._handle(wire.Ready(worker_id, role, "m", 8192, 49152, "shm", "", "", 512, 2048, 64))
                link._handle(
                    wire.Load(worker_id, 0, 0, queued, 0, 768, 0, 10.0, kv_blocks_total=768, block_size=64)
                )
            scenario(workers)
        finally:
            await workers.close()

    asyncio.run(main())


def warm(dispatcher: Dispatcher) -> None:
    """Steps of 10 ms + 1 ms a prompt token + 2 ms a stream; then 40 steps with prompt tokens beside
    streams that ran 1.0x, 1.1x, 1.2x, 1.3x, 1.4x, 1.5x, ... the prediction: their p50 is 1.2, p99 1.5."""
    cost = dispatcher.signals.cost
    for i in range(16):
        prompt, streams = (100 * (i % 4 + 1), 0) if i % 2 else (0, i % 5 + 1)
        cost.add(Step(prompt, 0, streams, 0), 0.010 + 0.001 * prompt + 0.002 * streams)
    assert MIXED_MIN_SAMPLES < 40
    for i in range(40):
        step = Step(20 + i, 0, 2, 0)
        cost.add(step, (1.0 + 0.1 * (i % 6)) * cost.step_seconds(step))


def test_the_path_choice_takes_the_server_s_slo_percentile_and_itl_budget() -> None:
    def scenario(workers: WorkerSet) -> None:
        choices = {}
        for percentile in (0.5, 0.99):
            config = RouterConfig(slo=SLO(ttft_s=2.0, itl_s=0.25, percentile=percentile))
            dispatcher = Dispatcher(workers, config, RouterMetrics())
            warm(dispatcher)
            choice, prefill, local = dispatcher.placement.choose_path(100)
            assert (choice.path, prefill, local) == ("local", None, workers.view("decode-0"))
            choices[percentile] = choice
        # The ITL budget a local prefill's steps must fit, divided by the model's under-prediction
        # of such steps at the SLO's percentile: a stricter percentile, a bigger margin.
        assert choices[0.5].stall_margin == pytest.approx(1.2)
        assert choices[0.99].stall_margin == pytest.approx(1.5)
        # The budget itself goes to the decode worker, which applies its own model's margin.
        assert choices[0.5].step_budget_s == choices[0.99].step_budget_s == 0.25

    run(scenario)


def test_a_prompt_goes_to_the_worker_whose_load_reports_say_it_holds_its_prefix() -> None:
    tokens = list(range(1000, 1700))  # 700 tokens: 10 full blocks of 64 and 60 more
    keys = prompt_keys(tokens, 64, b"m|float32")

    async def main() -> None:
        workers = WorkerSet(ScriptedConnector())
        try:
            for worker_id, role in (("prefill-0", "prefill"), ("decode-0", "decode"), ("decode-1", "decode")):
                link: WorkerLink = workers.link(workers.add_worker(worker_id, role).worker_id)
                link._handle(
                    wire.Ready(
                        worker_id,
                        role,
                        "m",
                        8192,
                        49152,
                        "shm",
                        "",
                        "",
                        512,
                        2048,
                        64,
                        prefix_salt="m|float32",
                    )
                )
                held = keys if worker_id == "decode-1" else []
                link._handle(
                    wire.Load(
                        worker_id,
                        0,
                        0,
                        0,
                        0,
                        768,
                        0,
                        10.0,
                        kv_blocks_total=768,
                        block_size=64,
                        prefix_stored=held,
                    )
                )
            metrics = RouterMetrics()
            dispatcher = Dispatcher(workers, RouterConfig(slo=SLO(itl_s=0.25)), metrics)
            warm(dispatcher)
            choice, prefill, local = dispatcher.placement.choose_path(700, prompt=PromptKeys(tokens))
            # decode-1 computes 60 tokens where the prefill worker would compute 700: local, there.
            assert (choice.path, local and local.worker_id, prefill) == ("local", "decode-1", None)
            assert choice.local_ttft is not None and choice.remote_ttft is not None
            assert choice.local_ttft < choice.remote_ttft
            assert _sample(metrics, "pdserve_kv_routing_total", pool="decode", decision="cache") == 1
            # Its next report evicts the first block: nothing of the prompt is usable there now.
            workers.link("decode-1")._handle(
                wire.Load(
                    "decode-1",
                    0,
                    0,
                    0,
                    0,
                    768,
                    0,
                    10.0,
                    kv_blocks_total=768,
                    block_size=64,
                    prefix_evicted=keys[:1],
                )
            )
            assert workers.view("decode-1").cached_tokens(PromptKeys(tokens)) == 0  # type: ignore[union-attr]
        finally:
            await workers.close()

    asyncio.run(main())


def _sample(metrics: RouterMetrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0
