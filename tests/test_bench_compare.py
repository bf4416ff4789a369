"""`pdserve bench compare`: configurations started, benchmarked with identical requests, stopped,
and reported side by side."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from serving import Server, children

from pdserve.bench.compare import DEFAULT_CONFIGS, _labelled, columns
from pdserve.bench.summary import read_records
from pdserve.errors import PdserveError
from pdserve.transfer.segments import leftover_segments


def test_two_started_configurations_and_a_running_endpoint_side_by_side(
    tiny_llama: Path, tmp_path: Path
) -> None:
    running = Server(tiny_llama, "--colocated", "1")
    try:
        cmd = [sys.executable, "-m", "pdserve.cli", "bench", "compare", "--model", str(tiny_llama)]
        cmd += ["--config", "colocated=--colocated 1", "--config", "dpd=--prefill 1 --decode 1"]
        cmd += ["--serve-args", "--dtype float32 --num-kv-blocks 128", "--url", f"endpoint={running.url}"]
        cmd += [
            "--workload",
            "chat: poisson(rate=10) prompt=uniform(8,80) output=fixed(6); doc: constant(rate=3) prompt=fixed(400) output=fixed(3)",
        ]
        cmd += ["--max-requests", "12", "--slo", "ttft=5000,itl=5000", "--out", str(tmp_path)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    finally:
        running.stop()
    assert done.returncode == 0, done.stderr[-3000:]
    report = (tmp_path / "report.md").read_text()
    assert "| | colocated | dpd | endpoint |" in report and "## chat" in report and "## doc" in report
    runs = {
        label: read_records(tmp_path / f"records_{label}.jsonl") for label in ("colocated", "dpd", "endpoint")
    }
    shapes = {
        label: sorted((r.index, r.cls, r.scheduled_s, r.prompt_tokens) for r in records)
        for label, records in runs.items()
    }
    assert shapes["colocated"] == shapes["dpd"] == shapes["endpoint"]  # the same requests everywhere
    assert all(r.ok for records in runs.values() for r in records)
    summaries = json.loads((tmp_path / "summaries.json").read_text())
    assert summaries["median"]["dpd"]["overall"]["completed"] == 12
    # Each run's timeline: the pools of each server sampled from GET /pools (at least at the start).
    timelines = summaries["timelines"]
    pools = {label: set(timelines[label][0]["pool_samples"][0]["pools"]) for label in runs}
    assert pools == {"colocated": {"colocated"}, "dpd": {"prefill", "decode"}, "endpoint": {"colocated"}}
    for label in runs:
        assert timelines[label][0]["worker_seconds"]["total"] > 0
        assert (tmp_path / f"timeline_{label}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "## Timeline (overall)" in report and "| worker-seconds |" in report
    assert not leftover_segments()  # the started configurations were stopped


def test_labels_must_be_plain_and_unique() -> None:
    assert _labelled(["a=--colocated 2"], "--config") == [("a", "--colocated 2")]
    with pytest.raises(PdserveError, match="LABEL=VALUE"):
        _labelled(["--colocated 2"], "--config")
    with pytest.raises(PdserveError, match="unique"):
        _labelled(["a=x", "a=y"], "--url")


def test_the_default_configurations_only_when_no_endpoint_is_given() -> None:
    assert [label for label, _ in columns(None, [])[0]] == [c.split("=")[0] for c in DEFAULT_CONFIGS]
    assert columns(None, ["vllm=http://127.0.0.1:8100"]) == ([], [("vllm", "http://127.0.0.1:8100")])
    assert columns(["a=--colocated 1"], ["b=http://x"])[0] == [("a", "--colocated 1")]
    with pytest.raises(PdserveError, match="differ"):
        columns(["a=--colocated 1"], ["a=http://x"])


def test_a_rate_sweep_runs_every_rate_against_one_started_server(tiny_llama: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "compare", "--model", str(tiny_llama)]
    cmd += ["--config", "c=--colocated 1", "--serve-args", "--dtype float32 --num-kv-blocks 128"]
    cmd += ["--workload", "constant(rate=5) prompt=fixed(150) output=fixed(4)", "--max-requests", "6"]
    cmd += ["--rate-scales", "1,2", "--slo", "ttft=5000", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    report = (tmp_path / "report.md").read_text()
    assert "## Rate sweep (overall)" in report and "| 1 |" in report and "| 2 |" in report
    first, second = (read_records(tmp_path / f"records_c@{s}.jsonl") for s in (1, 2))
    assert len(first) == len(second) == 6
    # Twice the rate: the same requests sent in half the time.
    assert max(r.scheduled_s or 0 for r in second) == pytest.approx(
        max(r.scheduled_s or 0 for r in first) / 2
    )
    assert (tmp_path / "rate_2" / "ttft_cdf.png").is_file()
    # The same server ran both rates: the second drew prompts of its own, none found in the prefix
    # cache the first filled (the same prompts would have hit it, every one).
    caches = {
        name: runs[0]["prefix_cache"]
        for name, runs in json.loads((tmp_path / "summaries.json").read_text())["runs"].items()
    }
    assert caches["c@2"]["queries"] > 0 and caches["c@2"]["hits"] == 0, caches


def test_repeats_take_turns_with_a_new_draw_each_and_report_medians(tiny_llama: Path, tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "compare", "--model", str(tiny_llama)]
    cmd += ["--config", "a=--colocated 1", "--config", "b=--colocated 1"]
    cmd += ["--serve-args", "--dtype float32 --num-kv-blocks 128", "--repeats", "2"]
    cmd += ["--workload", "poisson(rate=8) prompt=uniform(8,40) output=fixed(4)", "--max-requests", "5"]
    cmd += ["--slo", "ttft=5000", "--out", str(tmp_path)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    # Turns: a, b, a, b -- each a fresh server.
    order = [line.split("]")[0] for line in done.stderr.splitlines() if line.startswith("[")]
    assert order == ["[a run 1/2", "[b run 1/2", "[a run 2/2", "[b run 2/2"]

    def shape(path: Path) -> list[tuple[float | None, int]]:
        return sorted((r.scheduled_s, r.prompt_tokens) for r in read_records(path))

    # Within a repeat both columns get the same requests; the second repeat is another draw.
    assert shape(tmp_path / "records_a_r1.jsonl") == shape(tmp_path / "records_b_r1.jsonl")
    assert shape(tmp_path / "records_a_r2.jsonl") == shape(tmp_path / "records_b_r2.jsonl")
    assert shape(tmp_path / "records_a_r1.jsonl") != shape(tmp_path / "records_a_r2.jsonl")
    summaries = json.loads((tmp_path / "summaries.json").read_text())
    runs = [s["overall"]["ttft_ms"]["p50"] for s in summaries["runs"]["a"]]
    assert summaries["median"]["a"]["overall"]["ttft_ms"]["p50"] == pytest.approx(sum(runs) / 2)
    assert summaries["median"]["a"]["repeats"] == 2
    report = (tmp_path / "report.md").read_text()
    assert "median over 2 runs" in report and "## Runs" in report and "| a |" in report


def descendants(pid: int) -> list[int]:
    found = children(pid)
    for child in list(found):
        found += descendants(child)
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait() is missing


def test_ctrl_c_stops_the_running_configuration_and_reports_what_finished(
    tiny_llama: Path, tmp_path: Path
) -> None:
    cmd = [sys.executable, "-m", "pdserve.cli", "bench", "compare", "--model", str(tiny_llama)]
    cmd += ["--config", "first=--colocated 1", "--config", "second=--prefill 1 --decode 1"]
    cmd += ["--serve-args", "--dtype float32 --num-kv-blocks 128"]
    cmd += ["--workload", "constant(rate=4) prompt=fixed(20) output=fixed(4)", "--max-requests", "4"]
    cmd += ["--repeats", "2", "--out", str(tmp_path)]
    # Its own process group, so the SIGINT below reaches it and its servers as a terminal's Ctrl-C does.
    bench = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert bench.stderr is not None
        lines = []
        for line in bench.stderr:  # bounded: the whole compare would end by itself in ~2 minutes
            lines.append(line)
            if line.startswith("[second run 1/2]"):
                break
        time.sleep(0.5)  # the second configuration's requests are in flight
        started = descendants(bench.pid)
        assert started, "the second configuration's server should be running"
        os.killpg(bench.pid, signal.SIGINT)
        code = bench.wait(timeout=60)
        rest = bench.stderr.read()
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.wait()
    assert code == 130, "".join(lines) + rest
    assert "Traceback" not in rest and "interrupted: reporting the runs that finished" in rest
    report = (tmp_path / "report.md").read_text()
    assert "Interrupted (Ctrl-C)" in report and "| | first |" in report
    assert len(read_records(tmp_path / "records_first_r1.jsonl")) == 4
    assert not (tmp_path / "records_second_r1.jsonl").exists()  # cut short: not reported as a run
    deadline = time.monotonic() + 15
    while any(alive(pid) for pid in started) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [pid for pid in started if alive(pid)], "a server outlived the bench"
    assert not leftover_segments()
