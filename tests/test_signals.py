"""Per-phase signals: windows, demand at admission, cold starts left out of the cost model."""

from __future__ import annotations

import pytest

from pdserve import wire
from pdserve.signals import Signals, Window


def test_window_forgets_what_is_older_than_its_span() -> None:
    w = Window(10.0)
    for t in range(20):
        w.add(float(t), now=float(t))
    assert w.values(19.0) == [float(t) for t in range(9, 20)]
    assert w.values(19.0, span=2.0) == [17.0, 18.0, 19.0]
    assert w.count_rate(19.0, span=5.0) == pytest.approx(6 / 5)
    assert w.rate(19.0, span=2.0) == pytest.approx((17 + 18 + 19) / 2)
    assert w.quantile(0.5, 19.0) == 14.0
    assert w.mean(100.0) is None and w.quantile(0.9, 100.0) is None


def test_demand_is_counted_at_admission_and_streams_until_they_end() -> None:
    s = Signals(window_s=30.0)
    for i in range(6):
        s.prompt_admitted("prefill", 1000, 0.5, now=float(i))
        s.stream_started("decode")
    assert s.pool("prefill").prompts.count_rate(6.0, span=10.0) == pytest.approx(0.6)
    assert s.pool("decode").streams == 6
    for _ in range(8):  # more ends than starts never goes below zero
        s.stream_ended("decode")
    assert s.pool("decode").streams == 0


def test_ttft_is_split_into_the_prompts_own_time_and_the_wait() -> None:
    s = Signals()
    s.first_token("prefill", 1.5, alone_s=1.2, now=1.0)
    s.first_token("prefill", 0.1, alone_s=0.3, now=2.0)  # faster than predicted: no negative wait
    assert s.pool("prefill").ttft.values(2.0) == [1.5, 0.1]
    assert s.pool("prefill").ttft_excess.values(2.0) == pytest.approx([0.3, 0.0])


def test_prompts_still_waiting_count_at_their_age_as_lower_bounds() -> None:
    s = Signals()
    s.first_token("prefill", 0.5, alone_s=0.4, now=1.0)
    for i in range(4):  # a queue builds: none of these has a first token yet
        s.awaiting_first_token(f"r{i}", "prefill", since=float(i), alone_s=0.4)
    ttfts, waits = s.pool("prefill").ttft_samples(now=10.0, span=8.0)
    # Ages 10, 9, 8, 7 s, each counted only within the last 8 s; the done one is older than the span.
    assert ttfts == pytest.approx([8.0, 8.0, 8.0, 7.0])
    assert waits == pytest.approx([7.6, 7.6, 7.6, 6.6])
    s.first_token("prefill", 9.5, alone_s=0.4, now=10.5, key="r0")  # arrived: a full sample now
    s.request_over("r1")  # failed or cancelled: no sample at all
    ttfts, _ = s.pool("prefill").ttft_samples(now=11.0, span=8.0)
    assert sorted(ttfts) == pytest.approx([8.0, 8.0, 9.5])
    s.awaiting_first_token("r2", "decode", since=10.0, alone_s=None)  # retried on another pool
    assert len(s.pool("prefill").awaiting) == 1 and s.pool("decode").ttft_samples(11.0, 8.0) == ([1.0], [])


def test_steps_of_a_worker_in_its_cold_start_stay_out_of_the_cost_model() -> None:
    s = Signals(cold_start_s=5.0)
    steps = [wire.StepSample(0.02, 0, 0, 4, 400) for _ in range(10)]
    s.steps(steps, up_for_s=1.0)
    assert s.cost.num_samples == 0 and s.cold_steps_skipped == 10
    s.steps(steps, up_for_s=6.0)
    assert s.cost.num_samples == 10


def test_describe_shows_percentiles_demand_and_the_model() -> None:
    s = Signals(window_s=30.0)
    for i in range(10):
        s.gap("decode", 0.01 * (i + 1), now=float(i))
    s.paths["remote"] += 3
    view = s.describe(10.0, {"decode": 0.25})
    decode = view["pools"]["decode"]
    # 10 ms .. 100 ms: percentiles interpolated between ranks (slo.quantile, numpy's definition).
    assert decode["itl_s"] == {
        "p50": pytest.approx(0.055),
        "p90": pytest.approx(0.091),
        "p99": pytest.approx(0.0991),
    }
    assert decode["kv_used"] == 0.25 and decode["ttft_s"] is None
    assert view["paths"] == {"remote": 3}
    assert view["cost_model"]["ready"] is False and view["cost_model"]["coefficients"] is None


def test_prediction_ratios_are_kept_for_the_window_only() -> None:
    signals = Signals(window_s=10.0)
    signals.prediction_checked(observed_s=0.6, predicted_s=0.3, now=100.0)
    signals.prediction_checked(observed_s=0.1, predicted_s=0.0, now=101.0)  # nothing predicted: left out
    signals.prediction_checked(observed_s=0.2, predicted_s=0.4, now=105.0)
    assert signals.prediction_ratios(105.0) == [2.0, 0.5]
    assert signals.prediction_ratios(112.0) == [0.5]
