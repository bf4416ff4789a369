"""Benchmark summaries: the definitions of `vllm bench serve`, computed by hand here."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from pdserve.bench.summary import (
    RequestRecord,
    format_summary,
    parse_slos,
    percentile,
    read_records,
    redacted_command,
    summarize,
    write_records,
)
from pdserve.errors import PdserveError


def record(
    index: int, sent: float, chunks: list[float], tokens: int, cls: str = "chat", error: str | None = None
) -> RequestRecord:
    return RequestRecord(
        index, cls, sent, sent, prompt_tokens=10, output_tokens=tokens, chunk_times_s=chunks, error=error
    )


def test_latencies_follow_the_vllm_definitions() -> None:
    r = record(0, 1.0, [1.5, 1.6, 1.8, 2.1], 4)
    assert r.ttft == pytest.approx(0.5) and r.e2e == pytest.approx(1.1)
    assert r.itls == pytest.approx([0.1, 0.2, 0.3])
    assert r.tpot == pytest.approx((1.1 - 0.5) / 3)


def test_summary_pools_gaps_counts_errors_and_splits_classes() -> None:
    records = [
        record(0, 0.0, [0.1, 0.2, 0.3], 3),
        record(1, 0.0, [0.4, 0.5], 2, cls="doc"),
        record(2, 0.0, [], 0, error="HTTP 503: no decode worker"),
    ]
    s = summarize(records, duration_s=2.0)
    overall = s["overall"]
    assert (overall["completed"], overall["errors"]) == (2, 1)
    assert overall["request_throughput"] == pytest.approx(1.0)
    assert overall["output_token_throughput"] == pytest.approx(2.5)
    assert overall["ttft_ms"]["mean"] == pytest.approx(250)
    assert overall["itl_ms"]["p50"] == pytest.approx(100)  # gaps 0.1, 0.1, 0.1 pooled
    assert s["classes"]["chat"]["itl_ms"]["max"] == pytest.approx(100)
    assert set(s["classes"]) == {"chat", "doc"} and s["classes"]["doc"]["completed"] == 1
    assert "HTTP 503" in overall["error_kinds"][0]
    assert "TTFT ms" in format_summary(s)


def test_goodput_counts_requests_within_every_slo() -> None:
    fast = record(0, 0.0, [0.1, 0.15, 0.2], 3)
    slow_start = record(1, 0.0, [0.9, 0.95], 2)
    stalled = record(2, 0.0, [0.1, 0.15, 0.6], 3)
    s = summarize([fast, slow_start, stalled], 1.0, parse_slos("ttft=500,itl=100"))["overall"]
    assert s["good_requests"] == 1 and s["goodput"] == pytest.approx(1.0)
    assert s["itl_ms"]["max"] == pytest.approx(450)  # the stalled stream's worst gap


def test_slo_parsing_and_percentiles() -> None:
    assert parse_slos("ttft=250,tpot=50") == {"ttft": 0.25, "tpot": 0.05}
    with pytest.raises(PdserveError, match="expected ttft=MS and/or itl=MS and/or tpot=MS and/or e2e=MS"):
        parse_slos("latency=3")
    with pytest.raises(PdserveError, match="must be a number of milliseconds"):
        parse_slos("ttft=fast")
    assert percentile([1, 2, 3, 4], 50) == 2.5 and math.isnan(percentile([], 50))


def test_records_round_trip_through_json_lines(tmp_path: Path) -> None:
    records = [record(0, 0.0, [0.1, 0.2], 2), record(1, 0.1, [], 0, error="x")]
    write_records(tmp_path / "r.jsonl", records)
    assert read_records(tmp_path / "r.jsonl") == records


def test_a_recorded_command_line_never_holds_a_key() -> None:
    argv = [
        "pdserve",
        "bench",
        "--api-key",
        "sk-secret",
        "--admin-key=adm-secret",
        "--model",
        "m",
        "--url",
        "u",
    ]
    shown = redacted_command(argv)
    assert "secret" not in shown
    assert shown == "pdserve bench --api-key <redacted> --admin-key=<redacted> --model m --url u"


def test_conversations_get_ttft_by_turn_and_old_records_still_read(tmp_path: Path) -> None:
    records = []
    for session in (0, 10):
        for turn in range(5):
            r = record(session + turn, float(turn), [turn + 0.1 * (turn + 1)], 2)
            r.session, r.turn, r.prompt_tokens = session, turn, 100 * (turn + 1)
            records.append(r)
    records.append(record(20, 0.0, [0.9], 2))  # not a conversation: not in the turns
    turns = summarize(records, 10.0)["turns"]
    assert list(turns) == ["1", "2", "3", "4+"]
    assert turns["1"]["ttft_ms"]["p50"] == pytest.approx(100.0) and turns["1"]["completed"] == 2
    assert turns["4+"]["completed"] == 4 and turns["4+"]["prompt_tokens_mean"] == 450
    assert "turn  2:    2 done" in format_summary(summarize(records, 10.0))
    # records.jsonl written before conversations existed has no session or turn: still read.
    (tmp_path / "old.jsonl").write_text(
        '{"index": 0, "cls": "c", "scheduled_s": 0, "sent_s": 0, "prompt_tokens": 3, "output_tokens": 1, '
        '"chunk_times_s": [0.5], "error": null}\n'
    )
    assert read_records(tmp_path / "old.jsonl")[0].session is None
