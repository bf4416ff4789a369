"""Admission: the in-flight limit with the requests admitted and not started, the pools' queue
limit, and the SLO check (--reject-on-slo-miss) before the cost model is ready and after, its
prediction scaled by its own recent error. The unit tests drive a real WorkerSet whose links have
said Ready; the last ones run a real server."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import pytest
from fakes import ScriptedConnector
from serving import Server
from test_pools_drain import poll

from pdserve import LLM, SamplingParams, wire
from pdserve.costmodel import Step
from pdserve.router import admission as admission_module
from pdserve.router.admission import Overloaded
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers import WorkerLink, WorkerSet
from pdserve.slo import SLO

PROMPTS = [f"Request {i}: " + "the quick brown fox jumps over the lazy dog " * (2 + i) for i in range(8)]

Scenario = Callable[[Dispatcher, list[WorkerLink]], Awaitable[None] | None]


def run(scenario: Scenario, config: RouterConfig, pools: tuple[str, ...] = ("prefill", "decode")) -> None:
    """`scenario(dispatcher, links)` against workers that said Ready (one per entry of `pools`)."""

    async def main() -> None:
        workers = WorkerSet(ScriptedConnector())
        try:
            links = []
            for i, role in enumerate(pools):
                worker_id = f"{role}-{i}"
                link = workers.link(workers.add_worker(worker_id, role).worker_id)
                link._handle(wire.Ready(worker_id, role, "m", 8192, 49152, "shm", "", "", 512, 2048, 64))
                links.append(link)
            result = scenario(Dispatcher(workers, config, RouterMetrics()), links)
            if result is not None:
                await result
        finally:
            await workers.close()

    asyncio.run(main())


def warm(dispatcher: Dispatcher) -> None:
    """The cost model ready, fitted to steps of 10 ms + 1 ms per prompt token + 2 ms per stream."""
    for i in range(16):
        prompt, streams = (100 * (i % 4 + 1), 0) if i % 2 else (0, i % 5 + 1)
        dispatcher.signals.cost.add(Step(prompt, 0, streams, 0), 0.010 + 0.001 * prompt + 0.002 * streams)
    assert dispatcher.signals.cost.ready


def rejections(dispatcher: Dispatcher, reason: str) -> float:
    return dispatcher.metrics.slo_rejections.labels(reason)._value.get()


# An ITL SLO no local prefill fits beside a stream: every prompt goes to the prefill worker.
SLO_CONFIG = RouterConfig(slo=SLO(ttft_s=1.0, itl_s=0.001), reject_on_slo_miss=True, slo_reject_factor=1.0)


def test_a_prompt_that_would_overfill_its_pools_queue_is_refused_with_the_time_it_needs() -> None:
    def scenario(dispatcher: Dispatcher, links: list[WorkerLink]) -> None:
        admission = dispatcher.admission
        admission.check_queue(5000)  # an empty pool takes any one prompt, however long
        links[0].open_leg("a", 900), links[1].open_leg("b", 600)  # sent, not prefilled yet
        links[0].prefill_tokens_per_s, links[1].prefill_tokens_per_s = 300.0, 200.0
        admission.check_queue(500)  # 1500 + 500 <= 2 workers x 1000
        with pytest.raises(Overloaded, match="1500 prompt tokens queued") as refused:
            admission.check_queue(501)
        assert refused.value.retry_after == pytest.approx(1500 / 500)
        assert dispatcher.metrics.queue_rejections.labels("prefill")._value.get() == 1
        # A prompt admitted and not started yet is in the queue as well.
        admission.admit(400)
        with pytest.raises(Overloaded, match="1900 prompt tokens queued"):
            admission.check_queue(101)

    run(scenario, RouterConfig(max_queued_prompt_tokens=1000), ("prefill", "prefill", "decode"))


def test_admitted_requests_hold_their_place_until_they_start_or_their_reservation_lapses(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def scenario(dispatcher: Dispatcher, _links: list[WorkerLink]) -> None:
        admission = dispatcher.admission
        first, _second = admission.admit(100), admission.admit(200)
        assert admission.reserved() == {"prefill": [100, 200]}
        with pytest.raises(Overloaded, match="2 requests in flight or being admitted"):
            admission.check_available()  # the limit is 2: both admitted, neither started
        admission.release(first)
        admission.check_available()
        assert admission.reserved() == {"prefill": [200]}
        # One whose request never starts (its client left before the response began) lapses.
        monkeypatch.setattr(admission_module, "RESERVATION_TTL_S", 0.0)
        time.sleep(0.01)
        assert admission.reserved() == {}
        admission.check_available()

    run(scenario, RouterConfig(max_in_flight=2))


def test_a_cold_cost_model_admits_a_prompt_to_an_idle_worker_then_goes_by_the_measured_rate() -> None:
    def scenario(dispatcher: Dispatcher, links: list[WorkerLink]) -> None:
        admission = dispatcher.admission
        assert not dispatcher.signals.cost.ready
        admission.admit(300)  # an idle pool takes it
        with pytest.raises(Overloaded, match="no prefill rate is measured yet") as refused:
            admission.admit(300)  # the prefill worker has a prompt waiting, and nothing is known
        assert refused.value.retry_after == 1.0 and rejections(dispatcher, "cold") == 1
        links[0].prefill_tokens_per_s = 1000.0  # measured: 300 reserved + 300 = 0.6 s <= 1 s
        admission.admit(300)
        with pytest.raises(Overloaded, match=r"predicts a first token in 1\.10 s") as refused:
            admission.admit(500)  # 600 + 500 tokens at 1000/s
        assert refused.value.retry_after == 1.0  # what is queued needs 0.6 s; never under 1 s
        assert rejections(dispatcher, "cold") == 2

    run(scenario, SLO_CONFIG)


def test_the_slo_check_scales_the_prediction_by_its_recent_error_once_a_prompt_waits() -> None:
    def scenario(dispatcher: Dispatcher, _links: list[WorkerLink]) -> None:
        admission, signals = dispatcher.admission, dispatcher.signals
        warm(dispatcher)
        admission.admit(300)  # idle: 0.31 s predicted
        admission.admit(300)  # behind it: 0.77 s, under the 1 s SLO while the model is trusted
        now = time.monotonic()
        for _ in range(admission_module.MIN_CALIBRATION_SAMPLES):
            signals.prediction_checked(observed_s=0.6, predicted_s=0.3, now=now)  # twice as slow
        with pytest.raises(Overloaded, match=r"x 2\.00, its recent error at p90") as refused:
            admission.admit(50)  # 0.97 s predicted, 1.9 s once scaled
        assert refused.value.retry_after >= 1 and rejections(dispatcher, "predicted") == 1
        assert "TTFT SLO (1000 ms)" in str(refused.value)

    run(scenario, SLO_CONFIG)


def test_an_idle_pool_is_judged_on_the_plain_prediction_so_it_keeps_serving() -> None:
    def scenario(dispatcher: Dispatcher, _links: list[WorkerLink]) -> None:
        admission, signals = dispatcher.admission, dispatcher.signals
        warm(dispatcher)
        now = time.monotonic()
        for _ in range(admission_module.MIN_CALIBRATION_SAMPLES):
            signals.prediction_checked(observed_s=3.0, predicted_s=1.0, now=now)
        # 0.72 s predicted, 2.2 s if scaled: the prompt starts at once, and only served requests
        # bring the measurements that correct the scale.
        admission.admit(700)
        with pytest.raises(Overloaded, match=r"x 3\.00"):
            admission.admit(100)  # behind it: 0.47 s predicted, 1.4 s scaled now that a prompt waits
        assert rejections(dispatcher, "predicted") == 1

    run(scenario, SLO_CONFIG)


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32")


def test_the_cost_model_chooses_paths_and_refuses_what_would_miss_the_slo(
    tiny_llama: Path, offline: LLM
) -> None:
    # A TTFT SLO no request can meet (1 ms, at 1x): once the cost model has the workers' steps,
    # every request is refused before it queues: 429 with Retry-After, never a 5xx.
    server = Server(
        tiny_llama, "--prefill", "1", "--decode", "1", "--slo", "ttft=1,itl=5000",
        "--reject-on-slo-miss", "--slo-reject-factor", "1",
    )  # fmt: skip
    try:
        time.sleep(5.5)  # the workers' cold start: their first steps stay out of the model
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
        expected = [o.outputs[0].text for o in offline.generate(PROMPTS, params)]
        served: list[str] = []
        for prompt in PROMPTS * 3:  # until the model is ready, requests (one at a time) are served
            response = server.http.post(
                "/v1/completions",
                json={
                    "model": server.model,
                    "prompt": prompt,
                    "max_tokens": 10,
                    "temperature": 0.0,
                    "ignore_eos": True,
                },
            )
            if response.status_code == 429:
                break
            assert response.status_code == 200, response.text
            served.append(response.json()["choices"][0]["text"])
        else:
            raise AssertionError("never refused: the cost model never became ready")
        # Whatever path each took, greedy output is the offline engine's.
        assert served and served == (expected * 3)[: len(served)]
        assert response.headers["retry-after"].isdigit() and int(response.headers["retry-after"]) >= 1
        assert "TTFT SLO" in response.json()["error"]["message"]
        assert server.metric("pdserve_slo_rejections_total", reason="predicted") >= 1
        assert server.metric("pdserve_path_choices_total", reason="cold") >= 1
        assert server.metric("pdserve_slo_seconds", metric="ttft") == 0.001
        view = server.admin_view()
        assert view["signals"]["cost_model"]["ready"] is True
        assert view["planner"]["mode"] == "off"
        server.wait_kv_free()
    finally:
        assert server.stop() == 0


def test_a_burst_at_a_fresh_server_is_refused_beyond_what_it_can_start_and_the_rest_served(
    tiny_llama: Path,
) -> None:
    # Nothing measured yet: the one prefill worker takes one prompt; the others of the burst,
    # which no prediction could judge, are refused fast instead of queueing behind it. The
    # prefill worker is frozen meanwhile, so that the first prompt is still waiting when the
    # others come (on a fast host it could be done first), and thawed for it to be served.
    server = Server(
        tiny_llama, "--prefill", "1", "--decode", "1", "--slo", "ttft=2000", "--reject-on-slo-miss"
    )
    prefill = server.worker_pids["prefill-0"]
    try:

        async def burst() -> tuple[httpx.Response, list[httpx.Response]]:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                body = {"model": server.model, "max_tokens": 8, "ignore_eos": True}
                os.kill(prefill, signal.SIGSTOP)
                try:
                    first = asyncio.ensure_future(
                        client.post("/v1/completions", json={**body, "prompt": PROMPTS[1]})
                    )
                    # Admitted and sent to the frozen worker.
                    await poll(lambda: server.metric("pdserve_requests_in_flight") == 1, 60, "it admitted")
                    rest = await asyncio.gather(
                        *(client.post("/v1/completions", json={**body, "prompt": p}) for p in PROMPTS[2:])
                    )
                finally:
                    os.kill(prefill, signal.SIGCONT)
                return await first, list(rest)

        first, rest = asyncio.run(burst())
        assert first.status_code == 200, first.text
        assert [r.status_code for r in rest] == [429] * len(rest), [r.text for r in rest]
        assert all("too few measurements yet" in r.json()["error"]["message"] for r in rest)
        assert all(int(r.headers["retry-after"]) >= 1 for r in rest)
        assert server.metric("pdserve_slo_rejections_total", reason="cold") == len(rest)
        server.wait_kv_free()
    finally:
        os.kill(prefill, signal.SIGCONT)
        assert server.stop() == 0
