"""The serving overhead: a real `pdserve serve` sent one request at a time, its TTFT and ITL set
against the steps its worker traced for them (or the profile's step time); the server stopped
afterwards."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from serving import children

from pdserve.bench.summary import RequestRecord
from pdserve.measure import overhead
from pdserve.sim.step_time import LinearStep


def test_the_overhead_is_what_the_client_saw_beyond_the_steps() -> None:
    step = LinearStep((0.010, 0.0, 0.0, 0.0, 0.0))  # every step 10 ms
    records = [
        RequestRecord(i, "probe", None, 0.0, 64, 3, chunk_times_s=[0.015, 0.027, 0.039]) for i in range(3)
    ]
    got = overhead._overhead(records, step, 64)
    # ITL 12 ms = a 10 ms step + 2 ms; TTFT 15 ms = the 10 ms prompt step + 2 ms + 3 ms a request.
    assert got.step_s == pytest.approx(0.002)
    assert got.request_s == pytest.approx(0.003)
    with pytest.raises(Exception, match="failed"):
        overhead._overhead([RequestRecord(0, "probe", None, 0.0, 64, error="HTTP 503: no")], step, 64)


def test_the_overhead_is_set_against_each_requests_own_traced_steps(tmp_path: Path) -> None:
    # Two requests one at a time: prompt steps of 50 and 70 ms (a host's pace moving between
    # them), decode steps of 10 and 14 ms; each client saw 3 ms a request and 2 ms a step more.
    rows = []
    for prompt_s, decode_s in ((0.050, 0.010), (0.070, 0.014)):
        rows.append({"seconds": prompt_s, "prefill_tokens": 64, "decode_streams": 0})
        rows += [{"seconds": decode_s, "prefill_tokens": 0, "decode_streams": 1}] * 2
    rows.append({"seconds": 0.03, "prefill_tokens": 128, "decode_streams": 2})  # the batched probe's
    rows.append({"seconds": 0.02, "prefill_tokens": 64, "decode_streams": 0})  # not one at a time
    trace = tmp_path / "steps.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    served = overhead._sequential_steps(trace)
    assert [(p.seconds, [d.seconds for d in ds]) for p, ds in served] == [
        (0.050, [0.010, 0.010]),
        (0.070, [0.014, 0.014]),
    ]
    records = [
        RequestRecord(0, "probe", None, 0.0, 64, 3, chunk_times_s=[0.055, 0.067, 0.079]),
        RequestRecord(1, "probe", None, 0.0, 64, 3, chunk_times_s=[0.075, 0.091, 0.107]),
    ]
    got = overhead._overhead_traced(records, [(p.seconds, [d.seconds for d in ds]) for p, ds in served])
    assert got.step_s == pytest.approx(0.002)
    assert got.request_s == pytest.approx(0.003)
    # Against one fitted step time (the first request's pace) the second request's slower steps
    # would read as overhead: 11 ms a request, not 3.
    fitted = overhead._overhead(records, LinearStep((0.010, 0.040 / 64, 0.0, 0.0, 0.0)), 64)
    assert fitted.request_s == pytest.approx(0.011)


def test_a_real_server_is_measured_and_stopped(tiny_llama: Path) -> None:
    step = LinearStep((0.0005, 0.0, 0.0, 0.0, 0.0))
    result = overhead.measure(
        str(tiny_llama), step, threads=1, requests=3, prompt_tokens=16, output_tokens=8, vocab_size=320
    )
    assert result.requests == 3
    assert result.start_s > 0
    assert result.overhead.request_s >= 0 and result.overhead.step_s >= 0
    # Set against the steps the server traced for each request, and said so.
    assert "beyond the steps it traced for them" in result.note, result.note
    # The server and its worker are gone (other children of this process, such as
    # multiprocessing's resource tracker, may be there).
    servers = [
        pid for pid in children(os.getpid()) if _state(pid) not in ("Z", None) and b"pdserve" in _cmdline(pid)
    ]
    assert servers == []


def _state(pid: int) -> str | None:
    """A process's state letter (Z: a zombie, already gone), None if it is no more."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except FileNotFoundError:
        return b""
