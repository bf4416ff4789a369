"""Placement: the views it builds from the router's live links reach the path choice with the
server's own settings (its SLO percentile, its ITL budget). A real WorkerSet whose links said
Ready and sent a load report; no sockets carry requests."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from fakes import ScriptedConnector

from pdserve import wire
from pdserve.costmodel import MIXED_MIN_SAMPLES, Step
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.metrics import RouterMetrics
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
