"""The serving overhead: a real `pdserve serve` sent one request at a time, its TTFT and ITL set
against the profile's step time; the server stopped afterwards."""

from __future__ import annotations

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


def test_a_real_server_is_measured_and_stopped(tiny_llama: Path) -> None:
    step = LinearStep((0.0005, 0.0, 0.0, 0.0, 0.0))
    result = overhead.measure(
        str(tiny_llama), step, threads=1, requests=3, prompt_tokens=16, output_tokens=8, vocab_size=320
    )
    assert result.requests == 3
    assert result.start_s > 0
    assert result.overhead.request_s >= 0 and result.overhead.step_s >= 0
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
