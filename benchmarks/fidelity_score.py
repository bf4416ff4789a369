"""How benchmarks/sim_fidelity.py counts issue 33's target: a cell's error against the measured runs'
own spread, the knee (the first rate, and where the share in the SLO falls through 90%), and the
latency cells at or below the measured knee within 10%. Pure functions of the summaries."""

from __future__ import annotations

import itertools
import statistics
from typing import Any

METRICS = (("ttft_ms", "p50"), ("ttft_ms", "p90"), ("itl_ms", "p50"), ("itl_ms", "p90"))


def spread(runs: list[float]) -> float | None:
    """How far the measured repeats of one cell fell apart: (max - min) / median (None: one run).
    An error within it is within what the machine itself does from one run to the next."""
    if len(runs) < 2:
        return None
    middle = statistics.median(runs)
    return (max(runs) - min(runs)) / middle if middle else None


def knee(scales: list[float], goodput_share: dict[float, float], threshold: float = 0.9) -> float | None:
    """The first rate scale at which less than `threshold` of the requests met the SLO."""
    for scale in scales:
        if goodput_share[scale] < threshold:
            return scale
    return None


def knee_crossing(goodput_share: dict[float, float], threshold: float = 0.9) -> float | None:
    """Where the share of requests within the SLO first falls through `threshold`, interpolated
    linearly between the last rate scale at or above it and the next (below it): the knee at a
    finer grain than the rates run. The lowest scale when the share is under it there already (the
    knee lies at or below it); None when it never falls under. Near a knee the share moves a few
    points a tenth of the rate, so the first rate under the threshold says little finer than the
    rates' own spacing."""
    scales = sorted(goodput_share)
    if scales and goodput_share[scales[0]] < threshold:
        return scales[0]
    for lower, upper in itertools.pairwise(scales):
        above, below = goodput_share[lower], goodput_share[upper]
        if below < threshold:
            return lower + (upper - lower) * (above - threshold) / (above - below)
    return None


def score(
    cases: dict[float, dict[str, Any]], scales: list[float], measured_knee: float | None, target: float = 0.10
) -> dict[str, int]:
    """Issue 33's target for one configuration: its latency cells (TTFT and ITL p50 and p90) at loads
    at or below the measured knee (every load when the SLO held throughout), how many are within
    `target` of the measured value, and how many within it or within half the measured runs' spread
    (what the machine itself does from one run to the next). `cases` maps each scale to its case."""
    cells = within = within_spread = 0
    for scale in scales:
        if measured_knee is not None and scale > measured_knee:
            continue
        for metric, stat in METRICS:
            cell = cases[scale][f"{metric[:-3]}_{stat}"]
            if cell["error"] is None:
                continue
            cells += 1
            error = abs(cell["error"])
            within += error <= target
            noise = (cell["measured_spread"] or 0.0) / 2
            within_spread += error <= max(target, noise)
    return {"cells": cells, "within": within, "within_spread": within_spread}


def share(summary: dict[str, Any]) -> float:
    overall = summary["overall"]
    total = overall["requests"]
    return overall["good_requests"] / total if total else 0.0


def crossing_error(
    measured: dict[float, float], simulated: dict[float, float], threshold: float = 0.9
) -> dict[str, float | None]:
    """Both knees (knee_crossing) and the simulated one's error against the measured; no error
    where either share was under the threshold at its lowest rate already (a knee at or below it
    is not a value to compare) or either never fell under it."""
    m_knee, s_knee = knee_crossing(measured, threshold), knee_crossing(simulated, threshold)
    clamped = any(shares and shares[min(shares)] < threshold for shares in (measured, simulated))
    error = None if clamped or not m_knee or s_knee is None else (s_knee - m_knee) / m_knee
    return {"measured": m_knee, "sim": s_knee, "error": error}


def crossing_text(crossing: dict[str, float | None]) -> str:
    def at(scale: float | None) -> str:
        return "none in range" if scale is None else f"x{scale:.2f}"

    error = crossing["error"]
    return f"{at(crossing['measured'])} / simulated {at(crossing['sim'])}" + (
        f" ({error:+.0%})" if error is not None else ""
    )
