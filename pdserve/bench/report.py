"""The Markdown report of `pdserve bench compare`: summaries side by side, the spread over
repeats, and the rate sweep. Pure functions of the summaries (pdserve/bench/summary.py). No torch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any


def median_summary(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """The median of every number over several runs' summaries of the same workload shape.

    A percentile's median over runs (say of ITL p99) is what the report quotes: one run on a shared
    2-core machine moves a tail figure by tens of percent. Lists (error kinds) are merged; a class
    missing from some runs is the median over the runs that have it.
    """
    if len(summaries) == 1:
        return summaries[0]
    median: dict[str, Any] = _median_of(summaries)
    return median | {"repeats": len(summaries)}


def _median_of(values: list[Any]) -> Any:
    first = values[0]
    if isinstance(first, dict):
        keys = list(dict.fromkeys(k for v in values if isinstance(v, dict) for k in v))
        return {k: _median_of([v[k] for v in values if isinstance(v, dict) and k in v]) for k in keys}
    if isinstance(first, bool) or not isinstance(first, int | float):
        if isinstance(first, list):
            return sorted({item for v in values for item in v})
        return first
    numbers = [float(v) for v in values if not math.isnan(float(v))]
    if not numbers:
        return math.nan
    median = statistics.median(numbers)
    return round(median) if all(isinstance(v, int) for v in values) and median.is_integer() else median


def render_repeats(repeat_summaries: dict[str, list[dict[str, Any]]], seed: int) -> str:
    """Each run's headline figures, so a reader sees how far one run is from the median."""
    labels = list(repeat_summaries)
    runs = max(len(per_label) for per_label in repeat_summaries.values())  # fewer after a Ctrl-C
    lines = [
        "",
        f"## Runs (the medians above are over these {runs}; run r used seed {seed} + r - 1)",
        "",
        "TTFT p50 / ITL p99 (ms), goodput (req/s) where SLOs were given.",
    ]
    groups = ["overall", *repeat_summaries[labels[0]][0].get("classes", {})]
    for group in groups:
        lines += ["", f"### {group}", "", "| | " + " | ".join(f"run {i + 1}" for i in range(runs)) + " |"]
        lines.append("| --- " * (runs + 1) + "|")
        for label in labels:
            cells = []
            for summary in repeat_summaries[label]:
                part = summary["overall"] if group == "overall" else summary.get("classes", {}).get(group)
                cells.append(_headline(part) if part else "-")
            cells += ["-"] * (runs - len(cells))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _headline(s: dict[str, Any]) -> str:
    text = f"{s['ttft_ms']['p50']:.0f} / {s['itl_ms']['p99']:.0f}"
    return text + (f", {s['goodput']:.2f}" if "goodput" in s else "")


def render_sweep(
    summaries: dict[str, dict[str, Any]],
    labels: list[str],
    scales: list[float],
    name: Callable[[str, float], str],
) -> str:
    """One row per rate: where each configuration stops meeting its SLOs."""
    lines = [
        "",
        "## Rate sweep (overall)",
        "",
        "The tables above are for rate scale " + f"{scales[0]:g}.",
        "",
    ]
    header = (
        "| rate scale | "
        + " | ".join(f"{label}: goodput / done per s / TTFT p50 / ITL p99" for label in labels)
        + " |"
    )
    lines += [header, "| --- " * (len(labels) + 1) + "|"]
    for scale in scales:
        cells = []
        for label in labels:
            if name(label, scale) not in summaries:  # not run: a Ctrl-C ended the sweep first
                cells.append("-")
                continue
            s = summaries[name(label, scale)]["overall"]
            goodput = f"{s['goodput']:.2f}" if "goodput" in s else "-"
            cells.append(
                f"{goodput} / {s['request_throughput']:.2f} / {s['ttft_ms']['p50']:.0f} ms / {s['itl_ms']['p99']:.0f} ms"
            )
        lines.append(f"| {scale:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


ROWS: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
    ("completed / errors", lambda s: f"{s['completed']} / {s['errors']}"),
    ("requests/s", lambda s: f"{s['request_throughput']:.2f}"),
    ("output tokens/s", lambda s: f"{s['output_token_throughput']:.1f}"),
    ("TTFT p50 / p90 / p99 (ms)", lambda s: "{p50:.0f} / {p90:.0f} / {p99:.0f}".format(**s["ttft_ms"])),
    (
        "ITL p50 / p90 / p99 / max (ms)",
        lambda s: (
            "{p50:.0f} / {p90:.0f} / {p99:.0f} / ".format(**s["itl_ms"])
            + (f"{s['itl_ms']['max']:.0f}" if "max" in s["itl_ms"] else "-")
        ),
    ),
    ("TPOT p50 / p99 (ms)", lambda s: "{p50:.1f} / {p99:.1f}".format(**s["tpot_ms"])),
    ("E2E p50 / p99 (ms)", lambda s: "{p50:.0f} / {p99:.0f}".format(**s["e2e_ms"])),
    (
        "goodput (req/s)",
        lambda s: f"{s['goodput']:.2f} ({s['good_requests']} req)" if "goodput" in s else "-",
    ),
]


def render_report(
    summaries: dict[str, dict[str, Any]],
    described: dict[str, str],
    workload: str,
    command: str,
    plots: list[Path],
) -> str:
    labels = list(summaries)
    lines = [
        "# pdserve bench compare",
        "",
        f"Command: `{command}`",
        "",
        "Workload:",
        "",
        "```",
        workload,
        "```",
        "",
    ]
    lines += ["| column | configuration |", "| --- | --- |"]
    lines += [f"| {label} | `{described.get(label, '')}` |" for label in labels]
    first = summaries[labels[0]]
    if "repeats" in first:
        lines += [
            "",
            f"Every figure below is the median over {first['repeats']} runs of each column (each run's "
            "headline figures are under Runs); the plots are those of run 1.",
        ]
    groups = ["overall", *first.get("classes", {})]
    for group in groups:
        lines += [
            "",
            f"## {group}",
            "",
            "| | " + " | ".join(labels) + " |",
            "| --- " * (len(labels) + 1) + "|",
        ]
        for name, cell in ROWS:
            row = []
            for label in labels:
                s = summaries[label]
                part = s["overall"] if group == "overall" else s.get("classes", {}).get(group)
                row.append(cell(part) if part else "-")
            lines.append(f"| {name} | " + " | ".join(row) + " |")
    slos = first["overall"].get("slos_ms")
    if slos:
        lines += ["", "SLOs: " + ", ".join(f"{k} ≤ {v:g} ms" for k, v in slos.items())]
    if plots:
        lines += ["", "## Plots", ""] + [f"![{p.stem}]({p.as_posix()})" for p in plots]
    return "\n".join(lines) + "\n"
