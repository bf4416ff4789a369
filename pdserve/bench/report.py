"""The Markdown report of `pdserve bench compare`: summaries side by side, the spread over
repeats, and the rate sweep. Pure functions of the summaries (pdserve/bench/summary.py). No torch.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.bench.timeline import RECOVERED, share_text, worker_seconds_text


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


def _run_attainment(timeline: dict[str, Any]) -> float | None:
    counted = [w for w in timeline["windows"] if w["good"] is not None]
    sent = sum(w["sent"] for w in counted)
    return sum(w["good"] for w in counted) / sent if sent else None


def _step(timeline: dict[str, Any], k: int) -> dict[str, Any]:
    steps: list[dict[str, Any]] = timeline["steps"]
    return steps[k] if k < len(steps) else {}


def _at_step(k: int, cell: Callable[[dict[str, Any]], str]) -> Callable[[dict[str, Any]], str]:
    """The cell of a timeline's k-th step summary (`{}` if it has fewer)."""
    return lambda timeline: cell(_step(timeline, k))


def _recovery(step: dict[str, Any]) -> str:
    if step.get("slo_attainment") is None:
        return "-"
    return f"{step['recovery_s']:.0f} s" if step["recovered"] else "not recovered"


def _step_worker_seconds(step: dict[str, Any]) -> str:
    return " / ".join(
        worker_seconds_text(step.get(key)) for key in ("worker_seconds", "worker_seconds_after")
    )


def render_timelines(timelines: dict[str, list[dict[str, Any]]]) -> str:
    """Worker-seconds and how each configuration took the workload's steps (pdserve/bench/timeline.py),
    a column per configuration, a value per run when there were repeats. Empty when no run has pool
    samples or steps (a table of nothing but '-')."""
    labels = list(timelines)
    if not any(t["pool_samples"] or t["steps"] for runs in timelines.values() for t in runs):
        return ""
    first = timelines[labels[0]][0]
    repeats = max(len(runs) for runs in timelines.values())
    lines = [
        "",
        "## Timeline (overall)",
        "",
        "Worker-seconds: workers starting, up or draining (from GET /pools), integrated over the run. "
        "SLO attainment: the share of the requests sent that meet every SLO. Recovery: from a step's "
        f"start to the first {first['window_s']:g} s window from which attainment stays at or above "
        f"{RECOVERED:.0%} (up to the next step)."
        + (f" One value per run (runs 1 to {repeats})." if repeats > 1 else ""),
        "",
        "| | " + " | ".join(labels) + " |",
        "| --- " * (len(labels) + 1) + "|",
    ]

    def row(name: str, cell: Callable[[dict[str, Any]], str]) -> None:
        cells = [" · ".join(cell(t) for t in timelines[label]) for label in labels]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")

    row("worker-seconds", lambda t: worker_seconds_text(t["worker_seconds"]))
    row("SLO attainment, whole run", lambda t: share_text(_run_attainment(t)))
    for k, step in enumerate(first["steps"]):
        name = f"step at {step['at_s']:g} s for {step['for_s']:g} s ({step['label']})"
        row(f"{name}: SLO attainment during", _at_step(k, lambda s: share_text(s.get("slo_attainment"))))
        row(f"{name}: recovery", _at_step(k, _recovery))
        row(f"{name}: worker-seconds during / after", _at_step(k, _step_worker_seconds))
    return "\n".join(lines) + "\n"
