"""`pdserve bench` against a real `pdserve serve` (tiny model): records, summary, bounds, errors."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from serving import Server, free_port

from pdserve.bench.summary import read_records


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[Server]:
    srv = Server(tiny_llama, "--prefill", "1", "--decode", "1")
    try:
        yield srv
    finally:
        srv.stop()


def bench(url: str, model: Path, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "bench",
        "--url",
        url,
        "--model",
        str(model),
        "--out",
        str(out),
    ]
    return subprocess.run([*cmd, "--no-progress", *args], capture_output=True, text=True, timeout=300)


def test_a_run_records_every_request_with_exact_lengths(
    server: Server, tiny_llama: Path, tmp_path: Path
) -> None:
    done = bench(
        server.url,
        tiny_llama,
        tmp_path,
        "--workload",
        "short: poisson(rate=20) prompt=uniform(4,60) output=fixed(8); long: constant(rate=5) prompt=fixed(300) output=fixed(4)",
        "--max-requests",
        "24",
        "--slo",
        "ttft=5000,itl=5000",
    )
    assert done.returncode == 0, done.stderr
    records = read_records(tmp_path / "records.jsonl")
    assert len(records) == 24 and all(r.ok for r in records), [r.error for r in records]
    for r in records:
        assert r.output_tokens == (8 if r.cls == "short" else 4)
        assert r.chunk_times_s == sorted(r.chunk_times_s)
        # The tiny random model also samples ids that print nothing: those chunks carry no text.
        assert not r.chunk_times_s or r.sent_s <= r.chunk_times_s[0]
    assert sum(bool(r.chunk_times_s) for r in records) >= 12
    assert {r.prompt_tokens for r in records if r.cls == "long"} == {300}  # the server's usage agrees
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["overall"]["completed"] == 24
    assert summary["overall"]["good_requests"] == sum(bool(r.chunk_times_s) for r in records)
    assert set(summary["classes"]) == {"short", "long"}
    assert "TTFT ms" in done.stdout
    for plot in ("ttft_cdf.png", "itl_cdf.png", "itl_timeline.png"):
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_chat_with_text_prompts_and_a_duration_bound(
    server: Server, tiny_llama: Path, tmp_path: Path
) -> None:
    done = bench(
        server.url,
        tiny_llama,
        tmp_path,
        "--endpoint",
        "chat",
        "--workload",
        "constant(rate=4) prompt=fixed(40) output=fixed(6)",
        "--duration",
        "2",
    )
    assert done.returncode == 0, done.stderr
    records = read_records(tmp_path / "records.jsonl")
    assert 6 <= len(records) <= 8 and all(r.ok and r.output_tokens == 6 for r in records)
    assert all(r.scheduled_s is not None and r.scheduled_s < 2 for r in records)


def test_an_unreachable_server_gives_error_records_not_a_crash(tiny_llama: Path, tmp_path: Path) -> None:
    done = bench(
        f"http://127.0.0.1:{free_port()}", tiny_llama, tmp_path, "--workload", "chat", "--max-requests", "3"
    )
    assert done.returncode == 0, done.stderr
    records = read_records(tmp_path / "records.jsonl")
    assert len(records) == 3 and all(r.error and "Connect" in r.error for r in records)
    assert json.loads((tmp_path / "summary.json").read_text())["overall"]["errors"] == 3


def test_a_benchmark_must_be_bounded(tiny_llama: Path, tmp_path: Path) -> None:
    done = bench("http://127.0.0.1:1", tiny_llama, tmp_path, "--workload", "chat")
    assert done.returncode == 2 and "--max-requests or --duration" in done.stderr
