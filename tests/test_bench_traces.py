"""The CSV readers of bench workloads: trace replay, length rows, and their errors."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from pdserve.bench.distributions import WorkloadError
from pdserve.bench.traces import load_lengths, load_trace

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
AZURE = TRACES / "azure_conv_2023.csv"
needs_traces = pytest.mark.skipif(not AZURE.exists(), reason=f"no traces in {TRACES}")


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


@needs_traces
def test_trace_replay_follows_the_azure_file_scaled_in_time_and_length() -> None:
    rows = _csv_rows(AZURE)
    arrived = [float(r["arrived_at"]) for r in rows]
    replay, lengths = load_trace(AZURE)
    assert len(replay.arrivals_s) == len(rows) == len(lengths.prompts)
    assert replay.arrivals_s[:5] == tuple(arrived[:5])
    assert lengths.prompts[:5] == tuple(int(r["num_prefill_tokens"]) for r in rows[:5])
    assert lengths.outputs[:5] == tuple(int(r["num_decode_tokens"]) for r in rows[:5])

    fast, _ = load_trace(AZURE, time_scale=0.5)  # twice as fast
    assert fast.arrivals_s[1] == pytest.approx(arrived[1] / 2)
    target, _ = load_trace(AZURE, rate=11.0)
    assert len(target.arrivals_s) / target.arrivals_s[-1] == pytest.approx(11.0)

    _, small = load_trace(AZURE, length_scale=0.1, max_prompt_tokens=200)
    expected = [min(200, max(1, round(int(r["num_prefill_tokens"]) * 0.1))) for r in rows[:50]]
    assert list(small.prompts[:50]) == expected
    assert max(small.prompts) == 200 and min(small.outputs) >= 1

    later, later_lengths = load_trace(AZURE, start_s=600.0)
    first = next(i for i, t in enumerate(arrived) if t >= 600.0)
    assert later.arrivals_s[0] == pytest.approx(arrived[first] - 600.0)
    assert later_lengths.prompts[0] == int(rows[first]["num_prefill_tokens"])
    assert len(later.arrivals_s) == len(rows) - first


def test_csv_errors_name_the_file_the_line_and_the_column(tmp_path: Path) -> None:
    missing = tmp_path / "missing.csv"
    missing.write_text("arrived_at,num_prefill_tokens\n0,5\n")
    with pytest.raises(
        WorkloadError,
        match=r"missing\.csv: missing column\(s\) num_decode_tokens; found: arrived_at, num_prefill_tokens",
    ):
        load_trace(missing)
    bad = tmp_path / "bad.csv"
    bad.write_text("num_prefill_tokens,num_decode_tokens\n5,6\n7,lots\n")
    with pytest.raises(WorkloadError, match=r"bad\.csv:3: bad number 'lots' in column num_decode_tokens"):
        load_lengths(bad)
    with pytest.raises(WorkloadError, match="cannot read"):
        load_lengths(tmp_path / "nowhere.csv")
    assert issubclass(WorkloadError, ValueError)
