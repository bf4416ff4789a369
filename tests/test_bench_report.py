"""The compare report: medians over repeats and the tables a reader compares."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

from pdserve.bench.report import median_summary, render_repeats, render_report, render_sweep


def summary(ttft_p50: float, itl_p99: float, completed: int, classes: bool = True) -> dict[str, Any]:
    def part(scale: float) -> dict[str, Any]:
        dist = {"mean": 1.0, "p50": ttft_p50 * scale, "p90": 2.0, "p99": 3.0}
        return {
            "requests": completed,
            "completed": completed,
            "errors": 0,
            "request_throughput": 0.5,
            "output_token_throughput": 10.0,
            "ttft_ms": dist,
            "itl_ms": dist | {"p99": itl_p99 * scale},
            "tpot_ms": dist,
            "e2e_ms": dist,
            "goodput": 0.25,
            "good_requests": 3,
        }

    s: dict[str, Any] = {"overall": part(1.0)}
    if classes:
        s["classes"] = {"chat": part(0.5)}
    return s


def test_the_median_of_each_figure_over_runs() -> None:
    median = median_summary([summary(100, 900, 10), summary(300, 500, 12), summary(200, 700, 11)])
    assert median["repeats"] == 3
    assert median["overall"]["ttft_ms"]["p50"] == 200
    assert median["overall"]["itl_ms"]["p99"] == 700
    assert median["overall"]["completed"] == 11 and isinstance(median["overall"]["completed"], int)
    assert median["classes"]["chat"]["ttft_ms"]["p50"] == 100


def test_one_run_is_its_own_median_and_nan_is_skipped() -> None:
    one = summary(100, 900, 10)
    assert median_summary([one]) is one
    empty = summary(100, 900, 10)
    empty["overall"]["ttft_ms"]["p50"] = math.nan  # a run with no completed request of a class
    assert median_summary([empty, summary(300, 900, 10)])["overall"]["ttft_ms"]["p50"] == 300


def test_a_class_missing_from_a_run_takes_the_runs_that_have_it() -> None:
    median = median_summary([summary(100, 900, 10), summary(300, 500, 12, classes=False)])
    assert median["classes"]["chat"]["ttft_ms"]["p50"] == 50


def test_the_report_says_it_quotes_medians_and_lists_each_run() -> None:
    runs = {"colocated": [summary(100, 900, 10), summary(300, 500, 12)], "dpd": [summary(150, 400, 10)] * 2}
    medians = {label: median_summary(s) for label, s in runs.items()}
    report = render_report(medians, {"colocated": "--colocated 2", "dpd": "-p 1 -d 1"}, "w", "cmd", [])
    assert "median over 2 runs" in report
    assert "| TTFT p50 / p90 / p99 (ms) | 200 / 2 / 3 | 150 / 2 / 3 |" in report
    table = render_repeats(runs, seed=7)
    assert "seed 7 + r - 1" in table
    assert "| colocated | 100 / 900, 0.25 | 300 / 500, 0.25 |" in table
    assert "### chat" in table


def test_the_sweep_table_marks_rates_a_ctrl_c_left_unrun() -> None:
    summaries = {"a@1": summary(100, 900, 10), "a@2": summary(200, 950, 10), "b@1": summary(150, 400, 10)}
    table = render_sweep(summaries, ["a", "b"], [1.0, 2.0], lambda label, scale: f"{label}@{scale:g}")
    assert "| 1 | 0.25 / 0.50 / 100 ms / 900 ms | 0.25 / 0.50 / 150 ms / 400 ms |" in table
    assert "| 2 | 0.25 / 0.50 / 200 ms / 950 ms | - |" in table


def test_the_timeline_table_compares_worker_seconds_and_steps() -> None:
    from test_bench_timeline import SLOS, sample, stepped_run

    from pdserve.bench.distributions import Step
    from pdserve.bench.report import render_timelines
    from pdserve.bench.timeline import build_timeline

    records, samples = stepped_run()
    steps = [("chat", Step(40.0, 20.0, 3.0))]
    planner = build_timeline(records, 125.0, SLOS, 10.0, samples, steps, 2.0)
    # Static pools: two decode workers all along; every request within the SLOs.
    fast = [
        replace(r, chunk_times_s=[t - r.chunk_times_s[0] + r.sent_s + 0.2 for t in r.chunk_times_s])
        for r in records
    ]
    static_samples = [sample(0.0, prefill=(1, ["up"]), decode=(2, ["up", "up"]))]
    static = build_timeline(fast, 125.0, SLOS, 10.0, static_samples, steps, 2.0)
    text = render_timelines({"static": [static], "planner": [planner]})
    assert "## Timeline (overall)" in text and "| | static | planner |" in text
    assert "| worker-seconds | 375 (prefill 125, decode 250) | 300 (prefill 125, decode 175) |" in text
    assert "| SLO attainment, whole run | 100% | 56% |" in text  # 70 of 160 requests missed
    assert "| step at 40 s for 20 s (chat x3): SLO attainment during | 100% | 0% |" in text
    assert "| step at 40 s for 20 s (chat x3): recovery | 0 s | 30 s |" in text
    assert (
        "| step at 40 s for 20 s (chat x3): worker-seconds during / after | "
        "60 (prefill 20, decode 40) / 195 (prefill 65, decode 130) | 55 (prefill 20, decode 35) / 165 (prefill 65, decode 100) |"
    ) in text
    # Repeats: a value per run. Nothing to show (no pools, no steps): no section.
    text = render_timelines({"static": [static, static], "planner": [planner, static]})
    assert "One value per run (runs 1 to 2)." in text and "| 30 s · 0 s |" in text
    bare = build_timeline(records, 125.0, SLOS, 10.0)
    assert render_timelines({"a": [bare], "b": [bare]}) == ""
