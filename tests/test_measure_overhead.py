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
    line = {
        "t_s": 1.0,
        "worker": "colocated-0",
        "pool": "colocated",
        "prefill_attention": 0,
        "decode_context": 0,
    }
    trace.write_text("".join(json.dumps(line | {"loop_seconds": 0.0} | row) + "\n" for row in rows))
    served = overhead._sequential_steps(overhead._trace_rows(trace))
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
    fit = LinearStep((0.010, 0.040 / 64, 0.0, 0.0, 0.0))
    fitted = overhead._overhead(records, fit, 64)
    assert fitted.request_s == pytest.approx(0.011)

    # The probe's settling: the traced steps where the trace shows each request sent, one at a
    # time (here two warm-up requests' steps ahead of them), the fit's where it does not, said.
    warm = [{"seconds": 0.05, "prefill_tokens": 64, "decode_streams": 0}] * 2
    settled, note = overhead._settled(warm + rows, records, [], fit, 64)
    assert settled == got and "beyond the steps it traced" in note
    dropped = warm + rows[:2] + rows[3:]  # the first request's second decode step lost
    settled, note = overhead._settled(dropped, records, [], fit, 64)
    assert settled == fitted and "request 2's trace held 1 decode steps for its 3 tokens" in note
    settled, note = overhead._settled(rows, records, [], fit, 64)  # the warm-up's steps missing
    assert settled == fitted and "showed 2 requests one at a time, not the 4 sent" in note
    chunked = [*warm, dict(rows[0], prefill_tokens=32), *rows[1:]]
    settled, note = overhead._settled(chunked, records, [], fit, 64)
    assert settled == fitted and "request 2's prompt step ran 32 tokens, not 64" in note


def test_the_per_stream_part_is_set_against_the_traced_batched_steps() -> None:
    # Steps of 8 streams traced at 40 ms; each stream's gaps 41.7 ms: with a one-stream overhead
    # of 0.3 ms, 0.2 ms a stream more for each of the 7 others (0.1 + 0.2 x 8 = 1.7).
    rows = [{"seconds": 0.040, "prefill_tokens": 0, "decode_streams": 8}] * 10
    records = [
        RequestRecord(i, "probe", None, 0.0, 64, 6, chunk_times_s=[0.0417 * k for k in range(6)])
        for i in range(8)
    ]
    fit = LinearStep((0.050, 0.0, 0.0, 0.0, 0.0))  # the fit's 8-stream step 50 ms: no overhead seen
    base = overhead.Overhead(request_s=0.003, step_s=0.0003)
    got, note = overhead._per_stream(base, records, rows, fit, 64)
    assert got.stream_s == pytest.approx(0.0002) and got.step_s == pytest.approx(0.0001) and note == ""
    fitted, note = overhead._per_stream(base, records, rows[:4], fit, 64)  # too few traced
    assert fitted.stream_s == 0.0 and "against the fit's 8-stream step" in note


def test_a_real_server_is_measured_and_stopped(tiny_llama: Path) -> None:
    step = LinearStep((0.0005, 0.0, 0.0, 0.0, 0.0))
    result = overhead.measure(
        str(tiny_llama), step, threads=1, requests=3, prompt_tokens=80, output_tokens=8, vocab_size=259
    )
    assert result.requests == 3
    assert result.start_s > 0
    assert result.overhead.request_s >= 0 and result.overhead.step_s >= 0
    # Set against the steps the server traced for each request, and said so: each prompt (longer
    # than a KV block) computed whole, none a cached prefix of another probe's.
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
