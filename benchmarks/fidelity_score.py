"""How benchmarks/sim_fidelity.py counts issue 33's target: a cell's error against the measured runs'
own spread, the knee (the first rate, and where the share in the SLO falls through 90%), and the
latency cells at or below the measured knee within 10%, of all requests and of each workload class.
Pure functions of the summaries."""

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


def by_class(real: list[dict[str, Any]], simulated: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each workload class's TTFT and ITL p50/p90 cells (measured: the runs' median; simulated: the
    draws'), where the workload has two classes or more: there the all-requests p90 can fall in the
    gap between one class's tail and another's head (chat + documents, documents 8% of the
    requests: measured 336-539 ms over four runs of one load, while every class's cell of those
    runs was simulated within 10%), and each class's own cells say what its users saw. Empty for
    one class."""
    names = sorted({name for summary in real for name in summary.get("classes", {})})
    if len(names) < 2:
        return {}

    def values(summaries: list[dict[str, Any]], name: str, metric: str, stat: str) -> list[float]:
        found = (s.get("classes", {}).get(name, {}).get(metric, {}).get(stat) for s in summaries)
        return [float(v) for v in found if v is not None]

    classes: dict[str, dict[str, Any]] = {}
    for name in names:
        cells = {}
        for metric, stat in METRICS:
            m, s = values(real, name, metric, stat), values(simulated, name, metric, stat)
            if m and s:
                measured, sim = statistics.median(m), statistics.median(s)
                error = (sim - measured) / measured if measured else None
                cells[f"{metric[:-3]}_{stat}"] = {"measured": measured, "sim": sim, "error": error}
        classes[name] = cells
    return classes


def class_score(
    cases: dict[float, dict[str, Any]], scales: list[float], measured_knee: float | None, target: float = 0.10
) -> dict[str, int]:
    """`score`'s count over each class's cells (`by_class`, a case's "classes") at or below the
    measured knee."""
    cells = within = 0
    for scale in scales:
        if measured_knee is not None and scale > measured_knee:
            continue
        for class_cells in cases[scale].get("classes", {}).values():
            errors = [cell["error"] for cell in class_cells.values() if cell["error"] is not None]
            cells += len(errors)
            within += sum(abs(error) <= target for error in errors)
    return {"cells": cells, "within": within}


def class_table(cases: dict[str, dict[str, Any]], scores: dict[str, dict[str, Any]]) -> str:
    """The by-class cells of every case (named LABEL or LABEL@SCALE) as a markdown table, and each
    configuration's class_score; empty where no case has classes."""
    rows = []
    for name, case in cases.items():
        for cls, cells in case.get("classes", {}).items() if isinstance(case, dict) else ():
            texts = []
            for key in ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90"):
                c = cells.get(key)
                error = "-" if c is None or c["error"] is None else f"{c['error']:+.0%}"
                texts.append("-" if c is None else f"{c['measured']:.1f} / {c['sim']:.1f} ({error})")
            rows.append(f"| {name} | {cls} | " + " | ".join(texts) + " |")
    if not rows:
        return ""
    counts = "; ".join(
        f"{label} {s['classes']['within']} of {s['classes']['cells']}"
        for label, s in scores.items()
        if "classes" in s
    )
    return (
        "\nBy workload class (ms, measured / simulated):\n\n"
        "| case | class | TTFT p50 | TTFT p90 | ITL p50 | ITL p90 |\n| --- | --- | --- | --- | --- | --- |\n"
        + "\n".join(rows)
        + f"\n\nEach class's cells at or below the measured knee within 10%: {counts}.\n"
    )


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
