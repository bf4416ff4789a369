"""`pdserve bench` against a real `pdserve serve` (tiny model): records, summary, bounds, errors."""

from __future__ import annotations

import itertools
import json
import re
import signal
import subprocess
import sys
import time
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
    # The server's own TTFT parts of this run (the long prompts went to the prefill worker).
    parts = summary["ttft_parts"]
    assert {"prefill_queue", "prefill_compute", "kv_transfer", "first_decode"} <= set(parts)
    assert 1 <= parts["prefill_compute"]["count"] <= 24 and parts["kv_transfer"]["mean_ms"] > 0
    assert sum(summary["paths"].values()) == 24  # every prompt took one path, counted once
    assert "TTFT ms" in done.stdout
    for plot in ("ttft_cdf.png", "itl_cdf.png", "itl_timeline.png"):
        assert (tmp_path / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_conversations_resend_the_conversation_and_the_workers_find_its_prefix(
    server: Server, tiny_llama: Path, tmp_path: Path
) -> None:
    hits_before = server.metric("pdserve_prefix_cache_hits_total")
    done = bench(
        server.url,
        tiny_llama,
        tmp_path,
        "--workload",
        "talk: poisson(rate=4) prompt=fixed(140) output=fixed(6) turns=fixed(3) followup=fixed(12) think=fixed(250)",
        "--max-requests",
        "12",
    )
    assert done.returncode == 0, done.stderr
    records = read_records(tmp_path / "records.jsonl")
    assert len(records) == 12 and all(r.ok for r in records), [r.error for r in records]
    sessions: dict[int, list] = {}
    for r in records:
        assert r.session is not None
        sessions.setdefault(r.session, []).append(r)
    assert len(sessions) == 4
    for turns in sessions.values():
        turns.sort(key=lambda r: r.turn)
        assert [r.turn for r in turns] == [0, 1, 2] and turns[0].prompt_tokens == 140
        for before, after in itertools.pairwise(turns):
            # The whole conversation again (the answer re-encoded) and the 12 new tokens...
            assert after.prompt_tokens >= before.prompt_tokens + 12
            # ... sent after the answer before it ended, and the think time.
            assert after.sent_s >= max([before.sent_s, *before.chunk_times_s]) + 0.25
            assert after.scheduled_s is None
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [summary["turns"][t]["completed"] for t in ("1", "2", "3")] == [4, 4, 4]
    assert "conversations, by turn" in done.stdout
    # Each later turn found at least the first turn's two full 64-token blocks in a worker's cache.
    assert server.metric("pdserve_prefix_cache_hits_total") - hits_before >= 8 * 128
    assert server.metric("pdserve_worker_prefix_cache_blocks") > 0
    # The router saw where the conversations were cached (the workers tell it within ~10 ms of
    # the step that stored the blocks, well inside the think time): each later turn went there.
    assert server.metric("pdserve_kv_routing_total", decision="cache") >= 8
    assert server.metric("pdserve_kv_routing_total", decision="load_over_cache") == 0
    server.wait_kv_free()  # cached blocks no request holds are free blocks


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


def test_requests_past_the_drain_timeout_are_recorded_as_cancelled_with_what_came(
    server: Server, tiny_llama: Path, tmp_path: Path
) -> None:
    done = bench(
        server.url,
        tiny_llama,
        tmp_path,
        "--workload",
        "constant(rate=4) prompt=fixed(20) output=fixed(1000)",
        "--duration",
        "0.6",
        "--drain-timeout",
        "0.1",
    )
    # Sent at 0.25 and 0.5 s, cut at 0.7 s: 1000 tokens (nearly the tiny model's 1024-token
    # context) take about a second even on the fastest of these hosts (400 once finished in time).
    assert done.returncode == 0, done.stderr
    records = read_records(tmp_path / "records.jsonl")
    assert sorted(r.index for r in records) == [0, 1]
    assert all(r.error and r.error.startswith("cancelled") for r in records), [r.error for r in records]
    for r in records:  # when it was sent (it was once recorded as sent at the end), what came
        assert r.scheduled_s is not None and r.sent_s - r.scheduled_s < 0.2
        assert r.output_tokens == len(r.chunk_times_s) < 1000 and r.chunk_times_s == sorted(r.chunk_times_s)
    assert records[0].chunk_times_s
    server.wait_kv_free()


def test_a_stepped_run_samples_the_pools_of_the_server(
    server: Server, tiny_llama: Path, tmp_path: Path
) -> None:
    """The timeline against a real `pdserve serve`: GET /pools sampled every 0.5 s while the load
    runs (one prefill and one decode worker, up), the step's doubled arrivals in its window."""
    done = bench(
        server.url,
        tiny_llama,
        tmp_path,
        "--workload",
        "constant(rate=4) step(1, 1, 2) prompt=fixed(20) output=fixed(4)",
        "--duration",
        "3",
        "--timeline-window",
        "1",
        "--pool-sample-interval",
        "0.5",
        "--slo",
        "ttft=5000,itl=5000",
    )
    assert done.returncode == 0, done.stderr
    timeline = json.loads((tmp_path / "summary.json").read_text())["timeline"]
    end = timeline["end_s"]
    samples = timeline["pool_samples"]
    assert len(samples) >= 5 and samples[0]["t_s"] < 0.5 and samples[-1]["t_s"] <= end
    for sample in samples:
        assert set(sample["pools"]) == {"prefill", "decode"}
        for pool in sample["pools"].values():
            assert pool["target"] == 1 and pool["active"] == pool["workers"]["up"] == 1, sample
    ws = timeline["worker_seconds"]
    assert ws["pools"]["prefill"] == pytest.approx(end - samples[0]["t_s"])
    assert ws["total"] == pytest.approx(2 * (end - samples[0]["t_s"]))
    # constant(4): 3 arrivals in [0, 1) s, twice as many in the step [1, 2), 4 in [2, 3).
    assert [w["sent"] for w in timeline["windows"][:3]] == [3, 8, 4]
    [step] = timeline["steps"]
    assert (step["at_s"], step["for_s"], step["label"], step["sent"]) == (1, 1, "default x2", 8)
    assert "==== timeline (1 s windows" in done.stdout and "prefill 1/1 decode 1/1" in done.stdout
    assert "step at 1 s for 1 s (default x2)" in done.stdout
    assert (tmp_path / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_an_unreachable_server_gives_error_records_not_a_crash(tiny_llama: Path, tmp_path: Path) -> None:
    done = bench(
        f"http://127.0.0.1:{free_port()}", tiny_llama, tmp_path, "--workload", "chat", "--max-requests", "3"
    )
    assert done.returncode == 0, done.stderr
    records = read_records(tmp_path / "records.jsonl")
    assert len(records) == 3 and all(r.error and "Connect" in r.error for r in records)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["overall"]["errors"] == 3
    assert summary["timeline"]["pool_samples"] == [] and summary["timeline"]["worker_seconds"] is None


def test_a_benchmark_must_be_bounded(tiny_llama: Path, tmp_path: Path) -> None:
    done = bench("http://127.0.0.1:1", tiny_llama, tmp_path, "--workload", "chat")
    assert done.returncode == 2 and "--max-requests or --duration" in done.stderr
    done = bench("http://127.0.0.1:1", tiny_llama, tmp_path, "--max-requests", "1", "--timeline-window", "0")
    assert done.returncode == 2 and "--timeline-window must be a number of seconds > 0, got 0" in done.stderr
    done = bench(
        "http://127.0.0.1:1", tiny_llama, tmp_path, "--max-requests", "1", "--pool-sample-interval", "-1"
    )
    assert done.returncode == 2 and "--pool-sample-interval must be a number of seconds >= 0" in done.stderr


def start_bench(url: str, model: Path, out: Path, *args: str) -> subprocess.Popen[bytes]:
    """`pdserve bench` in the background, with its progress bar; stdout and stderr to files in
    `out` (bytes: the progress bar's carriage returns stay as written)."""
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "--url", url, "--model", str(model)]
    with (out / "stdout").open("wb") as stdout, (out / "stderr").open("wb") as stderr:
        return subprocess.Popen([*cmd, "--out", str(out / "run"), *args], stdout=stdout, stderr=stderr)


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_ctrl_c_stops_the_run_and_keeps_every_request_it_sent(
    server: Server, tiny_llama: Path, tmp_path: Path
) -> None:
    """Ctrl-C in the middle of a run that would take minutes: a prompt exit (130) with the summary,
    and records.jsonl accounting for every request sent exactly once: the completed ones with their
    times, the ones in flight as cancelled. The server is left with nothing in flight."""
    before = server.metric("pdserve_requests_total")
    # 400 requests at 4/s: 100 s of arrivals. Each streams 200 tokens (most of a second here), so
    # a few are always in flight.
    proc = start_bench(
        server.url,
        tiny_llama,
        tmp_path,
        "--workload",
        "constant(rate=4) prompt=fixed(20) output=fixed(200)",
        "--max-requests",
        "400",
    )
    try:

        def progress() -> list[tuple[int, int]]:
            text = (tmp_path / "stderr").read_bytes().decode()
            return [(int(d), int(e)) for d, e in re.findall(r"(\d+)/400 requests done, (\d+) errors", text)]

        def measuring() -> bool:
            if proc.poll() is not None:
                raise AssertionError(f"bench exited early: {(tmp_path / 'stderr').read_bytes().decode()}")
            shown = progress()
            return bool(shown) and shown[-1][0] >= 3 and server.metric("pdserve_requests_in_flight") >= 1

        # Building the prompts and starting take a few seconds on a busy machine.
        server.wait_for(measuring, timeout=120, what="3 requests done and more in flight")
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)  # the plots included
    finally:
        stop(proc)
    stdout = (tmp_path / "stdout").read_bytes().decode()
    stderr = (tmp_path / "stderr").read_bytes().decode()
    assert code == 130, stderr
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr

    records = read_records(tmp_path / "run" / "records.jsonl")
    done = [r for r in records if r.ok]
    cancelled = [r for r in records if not r.ok]
    # Every request whose send time came, once: at a constant rate they were sent in order.
    assert sorted(r.index for r in records) == list(range(len(records)))
    assert len(done) >= 3 and cancelled, [r.error for r in records]
    for r in done:
        assert r.output_tokens == 200 and r.chunk_times_s == sorted(r.chunk_times_s)
        assert r.chunk_times_s and r.sent_s <= r.chunk_times_s[0]
    for r in cancelled:  # in flight at the Ctrl-C: what streamed until then, and why it stopped
        assert r.error is not None and r.error.startswith("cancelled"), r.error
        assert r.chunk_times_s == sorted(r.chunk_times_s) and r.output_tokens < 200

    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["run"]["interrupted"] is True
    overall = summary["overall"]
    assert (overall["requests"], overall["completed"], overall["errors"]) == (
        len(records),
        len(done),
        len(cancelled),
    )
    # The duration runs to the Ctrl-C: past every send and chunk, and not much further (a request
    # is sent every 0.25 s and chunks stream every few ms).
    last = max(max([r.sent_s, *r.chunk_times_s]) for r in records)
    assert last <= overall["duration_s"] <= last + 2.0, (last, overall["duration_s"])
    assert f"requests: {len(done)} completed, {len(cancelled)} errors" in stdout
    # The progress bar ends on the final count, on a line of its own.
    assert f"\r{len(records)}/400 requests done, {len(cancelled)} errors\ninterrupted:" in stderr
    for plot in ("ttft_cdf.png", "itl_cdf.png", "itl_timeline.png"):
        assert (tmp_path / "run" / plot).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The server saw the client go: nothing in flight, every KV block free.
    server.wait_for(lambda: server.metric("pdserve_requests_in_flight") == 0, what="no request in flight")
    server.wait_kv_free()
    # It finished every request the client recorded as sent, no other: all but those cancelled
    # before any chunk came (the Ctrl-C may have beaten one to the server).
    finished = server.metric("pdserve_requests_total") - before
    reached = sum(1 for r in records if r.ok or r.chunk_times_s)
    assert reached <= finished <= len(records), (finished, len(records))
    assert server.metric("pdserve_requests_total", outcome="ok") >= len(done)


def test_ctrl_c_while_the_prompts_are_built(tiny_llama: Path, tmp_path: Path) -> None:
    """Ctrl-C before the first request: exit 130 with a word, not a traceback, and no outputs.

    The workload is announced before the prompts are built, which takes over a second even for few
    requests (loading the tokenizer, tokenizing the corpus): the Ctrl-C lands in it."""
    proc = start_bench(
        f"http://127.0.0.1:{free_port()}",
        tiny_llama,
        tmp_path,
        "--workload",
        "constant(rate=1) prompt=fixed(100) output=fixed(4)",
        "--max-requests",
        "2000",
    )
    try:
        deadline = time.monotonic() + 60
        while b"workload (2000 requests)" not in (tmp_path / "stderr").read_bytes():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.02)
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=30)
    finally:
        stop(proc)
    stderr = (tmp_path / "stderr").read_bytes().decode()
    assert code == 130, stderr
    assert "Traceback" not in stderr and "interrupted before any request was sent" in stderr, stderr
    assert not (tmp_path / "run").exists()
