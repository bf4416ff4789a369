"""CSV files for `pdserve bench` workloads: a trace to replay (arrival times and lengths, row by
row), (prompt, output) length rows, one column of observed lengths. No torch; numpy only.

Errors name the file, the line and the column. Token counts are whole numbers >= 1: a count is
scaled, rounded, raised to 1 and clipped to its maximum.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.bench.distributions import (
    Empirical,
    LengthRows,
    Replay,
    WorkloadError,
    check_positive,
    require,
)

ARRIVED_COL, PROMPT_COL, OUTPUT_COL = "arrived_at", "num_prefill_tokens", "num_decode_tokens"


def _read_columns(path: str | Path, columns: Sequence[str]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {c: [] for c in columns}
    try:
        with Path(path).open(newline="") as f:
            reader = csv.DictReader(f, skipinitialspace=True)
            header = list(reader.fieldnames or [])
            missing = [c for c in columns if c not in header]
            found = ", ".join(header) or "nothing (empty file)"
            require(not missing, f"{path}: missing column(s) {', '.join(missing)}; found: {found}")
            for row in reader:
                for c in columns:
                    raw = row[c]
                    try:
                        value = float(raw)
                    except (TypeError, ValueError):  # TypeError: a short row gives None
                        raise WorkloadError(
                            f"{path}:{reader.line_num}: bad number {raw!r} in column {c}"
                        ) from None
                    ok = value >= 0 and math.isfinite(value)
                    require(ok, f"{path}:{reader.line_num}: {c} must be finite and >= 0, got {raw!r}")
                    out[c].append(value)
    except OSError as e:
        raise WorkloadError(f"cannot read {path}: {e.strerror}") from None
    require(bool(out[columns[0]]), f"{path}: no rows")
    return out


def _tokens(values: Sequence[float], scale: float, cap: int | None) -> tuple[int, ...]:
    counts = np.maximum(1, np.rint(np.asarray(values) * scale)).astype(np.int64)
    return tuple((np.minimum(counts, cap) if cap is not None else counts).tolist())


def _source(path: str | Path, **options: Any) -> str:
    shown = [
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in options.items() if v is not None
    ]
    return ", ".join([f"path={path}", *shown])


def _length_options(scale: float, max_prompt: int | None, max_output: int | None) -> dict[str, Any]:
    check_positive("length_scale", scale)
    for name, cap in (("max_prompt_tokens", max_prompt), ("max_output_tokens", max_output)):
        require(cap is None or cap >= 1, f"{name} must be >= 1, got {cap}")
    scaled = scale if scale != 1 else None
    return {"length_scale": scaled, "max_prompt_tokens": max_prompt, "max_output_tokens": max_output}


def load_lengths(
    path: str | Path,
    order: str = "sample",
    length_scale: float = 1.0,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> LengthRows:
    """Rows of num_prefill_tokens, num_decode_tokens (other columns ignored). Token counts are
    multiplied by length_scale and rounded (at least 1), then clipped to the maxima."""
    require(order in ("sample", "file"), f"order must be 'sample' or 'file', got {order!r}")
    shown = _length_options(length_scale, max_prompt_tokens, max_output_tokens)
    cols = _read_columns(path, [PROMPT_COL, OUTPUT_COL])
    return LengthRows(
        _tokens(cols[PROMPT_COL], length_scale, max_prompt_tokens),
        _tokens(cols[OUTPUT_COL], length_scale, max_output_tokens),
        _source(path, **shown),
        "file" if order == "file" else "sample",
    )


def load_trace(
    path: str | Path,
    time_scale: float | None = None,
    rate: float | None = None,
    length_scale: float = 1.0,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
    start_s: float = 0.0,
) -> tuple[Replay, LengthRows]:
    """A trace of arrived_at, num_prefill_tokens, num_decode_tokens, for replay.

    Rows arriving before start_s are skipped and the others moved start_s earlier. Their times are
    then multiplied by time_scale (0.5 = twice as fast), or scaled so that the mean rate (rows /
    last arrival) becomes `rate`. Lengths as in load_lengths, in file order, so that request i of
    a replay gets row i's arrival and lengths."""
    require(time_scale is None or rate is None, "give time_scale or rate, not both")
    for name, value in (("time_scale", time_scale), ("rate", rate)):
        if value is not None:
            check_positive(name, value)
    require(start_s >= 0 and math.isfinite(start_s), f"start_s must be finite and >= 0, got {start_s}")
    shown = _length_options(length_scale, max_prompt_tokens, max_output_tokens)
    cols = _read_columns(path, [ARRIVED_COL, PROMPT_COL, OUTPUT_COL])
    arrived = np.asarray(cols[ARRIVED_COL])
    rows = np.argsort(arrived, kind="stable")  # a trace should be sorted; if not, rows stay paired
    rows = rows[arrived[rows] >= start_s]
    require(rows.size > 0, f"{path}: no arrivals at or after start_s={start_s} (last: {arrived.max():g} s)")
    times = arrived[rows] - start_s
    if rate is not None:
        require(times[-1] > 0, f"{path}: every arrival is at the same time; no rate to rescale")
        time_scale = rows.size / times[-1] / rate
    scale = 1.0 if time_scale is None else time_scale
    source = _source(path, start_s=start_s or None, rate=rate, **shown)
    prompts = _tokens([cols[PROMPT_COL][i] for i in rows], length_scale, max_prompt_tokens)
    outputs = _tokens([cols[OUTPUT_COL][i] for i in rows], length_scale, max_output_tokens)
    return Replay(tuple((times * scale).tolist()), source, scale), LengthRows(
        prompts, outputs, source, "file"
    )


def empirical_column(path: str, column: str) -> Empirical:
    """`empirical(path, column)`: the lengths in one column of a CSV, drawn with replacement."""
    return Empirical(_tokens(_read_columns(path, [column])[column], 1.0, None), _source(path, column=column))
