"""The timeline of `pdserve bench`: windows, pool samples, worker-seconds and step summaries, computed
by hand on synthetic runs; the GET /pools sampler against mock answers."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any

import httpx
import pytest

from pdserve.bench import timeline as tl
from pdserve.bench.client import sample_pools
from pdserve.bench.distributions import Step
from pdserve.bench.summary import RequestRecord, parse_slos


def rec(
    index: int, sent: float, ttft: float, gap: float = 0.05, tokens: int = 4, error: str | None = None
) -> RequestRecord:
    chunks = [] if error else [sent + ttft + k * gap for k in range(tokens)]
    return RequestRecord(index, "chat", sent, sent, 10, 0 if error else tokens, chunks, error)


def pools_body(**pools: tuple[int | None, list[str]]) -> dict[str, Any]:
    return {
        "pools": {
            name: {"pool": name, "target": target, "min": 1, "max": 4, "workers": [
                {"id": f"{name}-{k}", "state": state, "streams": 0} for k, state in enumerate(states)
            ]}
            for name, (target, states) in pools.items()
        }
    }  # fmt: skip


def sample(t: float, **pools: tuple[int | None, list[str]]) -> dict[str, Any]:
    return {"t_s": t, "pools": tl.pool_counts(pools_body(**pools))}


SLOS = parse_slos("ttft=500,itl=100")


def stepped_run() -> tuple[list[RequestRecord], list[dict[str, Any]]]:
    """A request a second for 120 s (plus 2 more a second from 40 to 60 s: a x3 step). TTFT is 0.2 s,
    but 1 s (over the SLO) from 40 to 70 s, while the decode pool grows: a worker starting at 45 s,
    up at 55 s; one draining at 90 s, gone at 95 s. The run ends at 125 s."""
    records, i = [], 0
    for t10 in range(0, 1200, 10):
        t = t10 / 10
        for extra in (0.0, 0.3, 0.6) if 40 <= t < 60 else (0.0,):
            records.append(rec(i, t + extra, 1.0 if 40 <= t < 70 else 0.2))
            i += 1
    samples = [
        sample(0.0, prefill=(1, ["up"]), decode=(1, ["up"])),
        sample(45.0, prefill=(1, ["up"]), decode=(2, ["up", "starting"])),
        sample(55.0, prefill=(1, ["up"]), decode=(2, ["up", "up"])),
        sample(90.0, prefill=(1, ["up"]), decode=(1, ["up", "draining"])),
        sample(95.0, prefill=(1, ["up"]), decode=(1, ["up", "down"])),
    ]
    return records, samples


def test_pool_counts_reads_get_pools() -> None:
    body = pools_body(prefill=(2, ["up", "starting", "draining"]), decode=(1, ["up", "down", "stopped"]))
    body["planner"] = {"mode": "slo", "pools": {"prefill": {"desired": 3, "reason": "ttft"}}}
    body["signals"] = {}  # other keys are ignored
    counts = tl.pool_counts(body)
    assert counts["prefill"] == {
        "target": 2,
        "workers": {"starting": 1, "up": 1, "draining": 1, "down": 0},
        "active": 3,  # a worker that is starting or draining costs too
        "desired": 3,  # the planner's
    }
    assert counts["decode"]["workers"] == {"starting": 0, "up": 1, "draining": 0, "down": 1, "stopped": 1}
    assert counts["decode"]["active"] == 1
    assert tl.pool_counts({"pools": {"p": {"workers": []}}})["p"] == {
        "target": None,
        "workers": dict.fromkeys(tl.STATES, 0),
        "active": 0,
        "desired": None,
    }
    bad: Any
    for bad in (
        [],
        {"object": "error"},
        {"pools": []},
        {"pools": {"p": {"target": 1}}},
        {"pools": {"p": {"workers": [1]}}},
    ):
        with pytest.raises(ValueError):
            tl.pool_counts(bad)


def test_worker_seconds_integrate_the_active_workers() -> None:
    _, samples = stepped_run()
    ws = tl.worker_seconds(samples, 125.0)
    assert ws is not None
    assert ws["pools"]["prefill"] == pytest.approx(125.0)
    # decode: 1 for 45 s, 2 (one starting) for 10 s, 2 for 35 s, 2 (one draining) for 5 s, 1 for 30 s
    assert ws["pools"]["decode"] == pytest.approx(45 + 20 + 70 + 10 + 30)
    assert ws["total"] == pytest.approx(125 + 175)
    part = tl.worker_seconds(samples, 125.0, 40.0, 60.0)
    assert part is not None and part["pools"]["decode"] == pytest.approx(5 + 20 + 10)
    assert tl.worker_seconds(samples, 125.0, 200.0)["total"] == 0  # type: ignore[index]
    assert tl.worker_seconds([], 10.0) is None
    late = [sample(5.0, decode=(1, ["up"]))]  # nothing counted before the first sample
    assert tl.worker_seconds(late, 10.0)["total"] == pytest.approx(5.0)  # type: ignore[index]
    assert tl.sample_at(samples, 50.0) is samples[1] and tl.sample_at(samples, -1.0) is None


def test_windows_by_send_time() -> None:
    records = [
        rec(0, 0.5, 0.2, gap=0.05),
        rec(1, 3.0, 0.4, gap=0.2),  # an ITL over the SLO: misses
        rec(2, 9.9, 0.6),  # TTFT over the SLO
        rec(3, 12.0, 0.1, error="HTTP 503"),  # an error misses and has no latency
        RequestRecord(4, "chat", 13.0, 13.0, 10),  # completed with nothing streamed: misses
        rec(5, 25.0, 0.3),
    ]
    wins = tl.windows(records, 26.0, 10.0, SLOS)
    assert [(w["start_s"], w["end_s"], w["sent"], w["finished"], w["errors"]) for w in wins] == [
        (0.0, 10.0, 3, 3, 0),
        (10.0, 20.0, 2, 1, 1),
        (20.0, 26.0, 1, 1, 0),
    ]
    first = wins[0]
    assert first["ttft_ms"]["p50"] == pytest.approx(400) and first["ttft_ms"]["p90"] == pytest.approx(560)
    assert first["itl_ms"]["p90"] == pytest.approx(200)  # gaps 0.05 x6, 0.2 x3: p90 is 0.2
    assert (first["good"], first["slo_attainment"]) == (1, pytest.approx(1 / 3))
    assert (wins[1]["good"], wins[1]["slo_attainment"]) == (0, 0.0)
    assert wins[1]["ttft_ms"] == {"p50": None, "p90": None} and wins[1]["itl_ms"] == {"p90": None}
    assert wins[2]["slo_attainment"] == 1.0
    # No SLOs: no attainment. An empty window has none either. No request, no time: no window.
    assert all(w["slo_attainment"] is None and w["good"] is None for w in tl.windows(records, 26.0, 10.0))
    gap = tl.windows([rec(0, 1.0, 0.1), rec(1, 21.0, 0.1)], 22.0, 10.0, SLOS)
    assert [w["sent"] for w in gap] == [1, 0, 1] and gap[1]["slo_attainment"] is None
    assert tl.windows([], 0.0, 10.0) == []
    assert len(tl.windows([], 30.0, 10.0)) == 3
    with pytest.raises(ValueError, match="timeline window"):
        tl.windows(records, 26.0, 0.0)


def test_recovery_is_the_first_window_from_which_attainment_stays_up() -> None:
    def wins(*shares: float | None) -> list[dict[str, Any]]:
        return [
            {"start_s": 10.0 * k, "end_s": 10.0 * (k + 1), "slo_attainment": s} for k, s in enumerate(shares)
        ]

    # Windows of 10 s; a step at 20 s.
    assert tl.recovery_s(wins(1, 1, 1, 0.95, 1), 20.0) == 0.0  # never fell below 90%
    assert tl.recovery_s(wins(1, 1, 0.5, 0.6, 0.95, 1), 20.0) == 20.0
    assert tl.recovery_s(wins(1, 1, 0.5, 0.95, 0.5, 0.9, 1), 20.0) == 30.0  # a relapse counts
    assert tl.recovery_s(wins(1, 1, 0.5, 0.6), 20.0) is None  # not recovered
    assert tl.recovery_s(wins(1, 1, 0.5, None, 1, None), 20.0) == 20.0  # empty windows are neutral
    assert tl.recovery_s(wins(0.1, 0.1, None, None), 20.0) is None  # no window with requests
    # A step at 25 s: from the window that holds its start; seconds from the step's start.
    assert tl.recovery_s(wins(1, 1, 0.5, 0.5, 1), 25.0) == 15.0
    assert tl.recovery_s(wins(1, 1, 1, 1), 25.0) == 0.0
    # Up to the next step (at 40 s): what follows is that step's.
    assert tl.recovery_s(wins(1, 1, 0.5, 1, 0.2, 0.2), 20.0, 40.0) == 10.0


def test_build_timeline_with_a_step() -> None:
    records, samples = stepped_run()
    steps = [("chat", Step(40.0, 20.0, 3.0))]
    timeline = tl.build_timeline(records, 125.0, SLOS, 10.0, samples, steps, 2.0)
    json.dumps(timeline, allow_nan=False)  # JSON as it is written: no NaN
    wins = timeline["windows"]
    assert len(wins) == 13 and wins[-1]["end_s"] == 125.0
    assert [w["sent"] for w in wins[3:8]] == [10, 30, 30, 10, 10]
    assert [w["slo_attainment"] for w in wins[3:8]] == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert wins[12]["sent"] == 0 and wins[12]["slo_attainment"] is None
    assert timeline["worker_seconds"]["total"] == pytest.approx(300.0)
    assert timeline["slos_ms"] == {"ttft": 500.0, "itl": 100.0}
    [step] = timeline["steps"]
    assert step["label"] == "chat x3" and step["steps"] == [{"class": "chat", "factor": 3.0}]
    assert (step["sent"], step["good"], step["slo_attainment"]) == (60, 0, 0.0)
    assert step["recovery_s"] == 30.0 and step["recovered"] is True  # windows from 70 s meet the SLOs
    assert step["worker_seconds"]["pools"] == {"prefill": pytest.approx(20.0), "decode": pytest.approx(35.0)}
    assert step["worker_seconds_after"]["pools"] == {
        "prefill": pytest.approx(65.0),
        "decode": pytest.approx(100.0),
    }

    text = tl.format_timeline(timeline)
    lines = text.splitlines()
    assert lines[0] == "==== timeline (10 s windows, requests by send time) ===="
    assert "pools: up[+N starting s][+N draining d]/target" in lines[1]
    row_40 = next(line for line in lines if line.lstrip().startswith("40 "))
    assert row_40.split()[:4] == ["40", "30", "30", "0"] and "0%" in row_40
    assert "prefill 1/1 decode 1+1s/2" in row_40  # the sample at 45 s, the last before 50 s
    assert "decode 2/2" in next(line for line in lines if line.lstrip().startswith("60 "))
    assert "decode 1+1d/1" in next(line for line in lines if line.lstrip().startswith("80 "))
    assert "decode 1/1" in next(line for line in lines if line.lstrip().startswith("90 "))
    assert (
        "worker-seconds (starting, up or draining; 5 samples of GET /pools): 300 (prefill 125, decode 175)"
        in text
    )
    assert (
        "step at 40 s for 20 s (chat x3): SLO attainment 0% during it (0/60), recovered 30 s after its start; "
        "worker-seconds 55 (prefill 20, decode 35) during it, 165 (prefill 65, decode 100) after"
    ) in text


def test_a_timeline_without_pools_or_slos() -> None:
    records, _ = stepped_run()
    steps = [
        ("chat", Step(40.0, 20.0, 3.0)),
        ("docs", Step(40.0, 20.0, 2.0)),
        ("chat", Step(100.0, 5.0, 0.0)),
    ]
    timeline = tl.build_timeline(records, 125.0, None, 30.0, [], steps)
    assert timeline["worker_seconds"] is None and timeline["pool_samples"] == []
    assert [w["sent"] for w in timeline["windows"]] == [30, 70, 30, 30, 0]
    first, second = timeline["steps"]  # steps at the same time are one summary
    assert first["label"] == "chat x3, docs x2" and first["slo_attainment"] is None
    assert first["recovery_s"] is None and first["recovered"] is None and first["worker_seconds"] is None
    assert second["sent"] == 5
    text = tl.format_timeline(timeline)
    assert "pools:" not in text and "worker-seconds" not in text
    assert "step at 40 s for 20 s (chat x3, docs x2): no SLO attainment (give --slo)" in text
    assert "(chat x0): no SLO attainment" in text
    assert tl.format_timeline(tl.build_timeline([], 0.0)).count("\n") == 1  # title and header


# --- the sampler ------------------------------------------------------------------------------


def sampled(
    answers: list[Any], interval_s: float = 0.01, run_s: float = 0.3
) -> tuple[list[dict[str, Any]], int]:
    """Runs sample_pools against a mock server answering `answers` in turn (then the last one) for
    run_s seconds; returns the samples and how many GET /pools it sent."""
    calls = []

    def answer(request: httpx.Request) -> httpx.Response:
        assert (request.method, request.url.path) == ("GET", "/pools")
        calls.append(request)
        reply = answers[min(len(calls) - 1, len(answers) - 1)]
        if isinstance(reply, Exception):
            raise reply
        if isinstance(reply, int):
            return httpx.Response(reply, json={"error": {"message": "no"}})
        return httpx.Response(200, json=reply) if isinstance(reply, dict) else httpx.Response(200, text=reply)

    async def go() -> list[dict[str, Any]]:
        samples: list[dict[str, Any]] = []
        async with httpx.AsyncClient(
            base_url="http://pools.test", transport=httpx.MockTransport(answer)
        ) as client:
            task = asyncio.create_task(sample_pools(client, interval_s, time.perf_counter(), samples))
            await asyncio.sleep(run_s)
            if task.done():  # it stopped by itself
                assert task.result() is None
            else:
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
        return samples

    return asyncio.run(go()), len(calls)


def test_sampler_records_pools_on_the_run_clock(caplog: pytest.LogCaptureFixture) -> None:
    body = pools_body(prefill=(1, ["up"]), decode=(2, ["up", "starting"]))
    samples, calls = sampled([body], interval_s=0.05, run_s=0.32)
    assert 5 <= len(samples) == calls <= 8
    times = [s["t_s"] for s in samples]
    assert times == sorted(times) and times[0] < 0.05 and times[-1] < 0.35
    assert samples[0]["pools"] == tl.pool_counts(body)
    assert not caplog.records
    # One failure (no answer, a 5xx) is passed over; the sampling goes on.
    flaky = [body, httpx.ConnectError("refused"), 503, body]
    samples, calls = sampled(flaky, run_s=0.2)
    assert calls > 5 and len(samples) == calls - 2


@pytest.mark.parametrize(
    ("answers", "why", "kept", "calls"),
    [
        # Not the admin route: at once.
        ([404], "the endpoint has no GET /pools (404)", 0, 1),
        (["<html>"], "GET /pools answered something else: Expecting value", 0, 1),
        ([{"object": "list"}], "GET /pools answered something else: the answer has no 'pools' object", 0, 1),
        # Failures: after 3 in a row.
        (
            [pools_body(p=(1, ["up"])), httpx.ReadTimeout("slow")],
            "GET /pools failed: ReadTimeout: slow",
            1,
            4,
        ),
        ([500], "GET /pools answered HTTP 500", 0, 3),
    ],
)
def test_sampler_stops_with_one_log_line(
    answers: list[Any], why: str, kept: int, calls: int, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="pdserve.bench"):
        samples, sent = sampled(answers)
    assert (len(samples), sent) == (kept, calls)
    [line] = caplog.records
    assert line.getMessage().startswith(f"pool sampling stopped after {kept} samples: {why}")
