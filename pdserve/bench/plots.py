"""Plots of `pdserve bench` runs: latency CDFs, the ITL-interference timeline and the run's timeline
(pool sizes, latency and SLO attainment per window), as PNG. No torch.

matplotlib is imported inside the functions, so `pdserve bench` without plots does not pay for it.
Figures are bare `matplotlib.figure.Figure` objects drawn by the Agg canvas: that needs no display,
leaves the process-wide backend alone (a notebook importing this keeps its own), and never
registers them in pyplot's global figure list, which keeps every figure alive until closed. So
nothing accumulates across calls; `_save` still clears each figure to free it at once.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pdserve.bench.summary import RequestRecord, percentile

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

NO_DATA = "no completed requests"
# Floor of log axes in ms: chunks that reach the client in one read get gaps of microseconds,
# which would stretch a log axis over decades where nothing of interest happens.
MIN_MS = 0.1
LOG_RATIO = 20  # log axis when the values span more than this factor (steady ~20 ms, 500 ms spikes)
DPI = 120
STYLES = ("-", "--", ":", "-.")


def _figure(width: float, height: float) -> tuple[Figure, Axes]:
    fig = _bare_figure(width, height)
    return fig, fig.add_subplot()


def _bare_figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)  # attaches itself to fig: savefig renders with Agg
    return fig


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI)
    fig.clear()  # free the artists now rather than at the next garbage collection
    return path


def _say(ax: Axes, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, fontsize=14, color="0.4")


def _completed(records: Sequence[RequestRecord]) -> list[RequestRecord]:
    return [r for r in records if r.ok and r.chunk_times_s]


def _limits(values_ms: Sequence[float]) -> tuple[float, float]:
    """Axis limits in ms: from zero (linear) or from a positive floor (log, see `_apply`)."""
    hi = max(values_ms, default=0.0)
    if hi <= 0:
        return 0.0, 1.0
    lo = max(min((v for v in values_ms if v > 0), default=hi), MIN_MS)
    if hi / lo > LOG_RATIO:
        return lo / 1.3, hi * 1.3
    return 0.0, hi * 1.05


def _apply(ax: Axes, axis: str, limits: tuple[float, float]) -> bool:
    """Set the limits and scale of one axis; returns whether it is logarithmic."""
    from matplotlib.ticker import LogFormatter, StrMethodFormatter

    lo, hi = limits
    log = lo > 0 and hi / lo > LOG_RATIO
    if axis == "x":
        ax.set_xscale("log" if log else "linear")
        ax.set_xlim(lo, hi)
    else:
        ax.set_yscale("log" if log else "linear")
        ax.set_ylim(lo, hi)
    target = ax.xaxis if axis == "x" else ax.yaxis
    if log:  # "20" and "300" rather than the default 2x10^1 and 3x10^2
        target.set_major_formatter(StrMethodFormatter("{x:g}"))
        target.set_minor_formatter(LogFormatter(labelOnlyBase=False))
    return log


def _ms(value: float) -> str:
    return f"{value:.1f}" if value < 100 else f"{value:.0f}"


def plot_cdfs(
    runs: dict[str, list[RequestRecord]], out: Path, classes: list[str] | None = None
) -> list[Path]:
    """Empirical CDFs of TTFT and of ITL (all gaps pooled), one line per (run, class).

    `runs` maps a configuration label to its records: one entry plots a run, several overlay a
    comparison. Writes `ttft_cdf.png` and `itl_cdf.png` into the folder `out`.
    """
    if classes is None:
        classes = sorted({r.cls for records in runs.values() for r in _completed(records)})
    paths = []
    for key, name in (("ttft", "TTFT"), ("itl", "ITL")):
        fig, ax = _figure(7.5, 4.5)
        lines: list[tuple[str, list[float], str, str]] = []  # legend, values (ms), color, style
        for i, (label, records) in enumerate(runs.items()):
            done = _completed(records)
            for j, cls in enumerate(classes):
                group = [r for r in done if r.cls == cls]
                if key == "ttft":
                    values = [t * 1000 for r in group if (t := r.ttft) is not None]
                else:
                    values = [gap * 1000 for r in group for gap in r.itls]
                if not values:
                    continue
                # Name only what varies; in a comparison the color is the run, the dash the class.
                parts = [p for p, varies in ((label, len(runs) > 1), (cls, len(classes) > 1)) if varies]
                if len(runs) > 1:
                    color, style = f"C{i % 10}", STYLES[j % len(STYLES)]
                else:
                    color, style = f"C{j % 10}", "-"
                lines.append((" · ".join(parts) or label, values, color, style))
        if not lines:
            _say(ax, NO_DATA)
        else:
            log = _apply(ax, "x", _limits([v for _, values, _, _ in lines for v in values]))
            for legend, values, color, style in lines:
                xs = sorted(max(v, MIN_MS) if log else v for v in values)
                ys = [(k + 1) / len(xs) for k in range(len(xs))]
                text = (
                    f"{legend}: p50 {_ms(percentile(values, 50))} ms, "
                    f"p99 {_ms(percentile(values, 99))} ms (n={len(values)})"
                )
                ax.step([xs[0], *xs], [0.0, *ys], where="post", color=color, linestyle=style, label=text)
            for q in (0.5, 0.99):  # the quantiles the legend quotes, where to read them off
                ax.axhline(q, color="0.75", linewidth=0.8, zorder=0)
            ax.set_ylim(0, 1.02)
            ax.legend(fontsize=8, loc="lower right")
        what = "requests" if key == "ttft" else "gaps (all streams pooled)"
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel(f"fraction of {what}")
        ax.set_title(f"{name} CDF")
        ax.grid(True, which="both", alpha=0.3)
        paths.append(_save(fig, Path(out) / f"{key}_cdf.png"))
    return paths


def _pick_long_class(records: Sequence[RequestRecord]) -> str | None:
    """The class with the largest mean prompt, when there are two or more classes."""
    prompts: dict[str, list[int]] = {}
    for r in records:
        prompts.setdefault(r.cls, []).append(r.prompt_tokens)
    if len(prompts) < 2:
        return None
    return max(sorted(prompts), key=lambda c: sum(prompts[c]) / len(prompts[c]))


def _gaps(records: Sequence[RequestRecord], long_class: str | None) -> list[tuple[float, float]]:
    """(time the gap ended in s, gap in ms) of every stream outside `long_class`, by time."""
    points = [
        (b, (b - a) * 1000)
        for r in _completed(records)
        if r.cls != long_class
        for a, b in itertools.pairwise(r.chunk_times_s)
    ]
    return sorted(points)


def _end(records: Sequence[RequestRecord]) -> float:
    return max((max([r.sent_s, *r.chunk_times_s]) for r in records), default=0.0)


def _rolling_p99(points: list[tuple[float, float]], width: float) -> tuple[list[float], list[float]]:
    bins: dict[int, list[float]] = {}
    for t, ms in points:
        bins.setdefault(int(t // width), []).append(ms)
    # A p99 of fewer than 5 gaps is just their maximum, already visible as a dot.
    kept = [b for b in sorted(bins) if len(bins[b]) >= 5]
    return [(b + 0.5) * width for b in kept], [percentile(bins[b], 99) for b in kept]


def plot_itl_timeline(
    records: list[RequestRecord],
    out: Path,
    long_class: str | None = None,
    title: str = "",
    *,
    xlim: tuple[float, float] | None = None,
    ylim: tuple[float, float] | None = None,
) -> Path:
    """The interference picture: every inter-token gap of the streams outside `long_class`, at the
    time it ended, against the arrivals of `long_class` (its send times as vertical lines, its
    prefill windows, sent to first chunk, shaded). ITL spikes of short streams that line up with
    long prompt arrivals are prefill interfering with decode.

    `long_class` None: the class with the largest mean prompt if there are 2+ classes, else no
    markers. `xlim` (s) and `ylim` (ms) fix the axes so several timelines compare side by side;
    a `ylim` from a positive floor spanning more than 20x is drawn on a log axis.
    """
    if long_class is None:
        long_class = _pick_long_class(records)
    fig, ax = _figure(10, 4.5)
    points = _gaps(records, long_class)
    if not _completed(records):
        _say(ax, NO_DATA)
    else:
        end = _end(records)
        ax.set_xlim(*(xlim or (0.0, end * 1.02 or 1.0)))
        log = _apply(ax, "y", ylim or _limits([ms for _, ms in points]))
        if not points:
            _say(ax, f"no inter-token gaps outside {long_class}")
        else:
            xs = [t for t, _ in points]
            ys = [max(ms, MIN_MS) if log else ms for _, ms in points]
            others = "streams" if long_class is None else f"streams other than {long_class}"
            ax.plot(
                xs,
                ys,
                linestyle="none",
                marker=".",
                markersize=2.5,
                alpha=0.4,
                color="C0",
                label=f"ITL of {others}",
            )
            # Bins of ~20 gaps on average, but no coarser than 1/100 of the run.
            width = max(end / 100, end * 20 / len(points)) or 1.0
            px, py = _rolling_p99(points, width)
            if len(px) > 1:  # a single bin is no line
                ax.plot(px, py, color="C3", linewidth=1.2, label=f"p99 per {width:.2g} s")
        if long_class is not None:
            arrivals = [r for r in records if r.cls == long_class]  # errors too: their prompts arrived
            for k, r in enumerate(arrivals):
                first = k == 0  # one legend entry for all the lines and all the windows
                ax.axvline(
                    r.sent_s,
                    color="C1",
                    linewidth=0.8,
                    alpha=0.7,
                    label=f"{long_class} sent" if first else None,
                )
                if r.chunk_times_s:
                    ax.axvspan(
                        r.sent_s,
                        r.chunk_times_s[0],
                        color="C1",
                        alpha=0.12,
                        linewidth=0,
                        label=f"{long_class} prefill (sent to first chunk)" if first else None,
                    )
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8, loc="upper right", framealpha=0.85)
    ax.set_xlabel("time since the start (s)")
    ax.set_ylabel("inter-token gap (ms)")
    ax.set_title(title or "inter-token gaps over time")
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, Path(out))


_OUTSIDE: dict[str, Any] = {
    "fontsize": 8,
    "loc": "upper left",
    "bbox_to_anchor": (1.01, 1.0),
    "borderaxespad": 0,
}


def _window_steps(windows: Sequence[dict[str, Any]], value: Any) -> tuple[list[float], list[float]]:
    """x, y of a step line holding each window's value over the window (NaN: no value, a gap)."""
    xs = [w["start_s"] for w in windows] + [windows[-1]["end_s"]]
    ys = [math.nan if (v := value(w)) is None else v for w in windows]
    return xs, [*ys, ys[-1]]


def plot_timeline(
    timeline: dict[str, Any],
    out: Path,
    title: str = "",
    *,
    end_s: float | None = None,
    max_workers: int | None = None,
) -> Path:
    """The run's timeline (timeline.build_timeline, or summary.json's "timeline"), three panels on
    one time axis: the workers of each pool (starting, up or draining; steps at the samples of GET
    /pools, the target dashed), TTFT p90 and ITL p90 per window against the SLOs, and SLO
    attainment per window against the 90% a recovery is measured by. The workload's steps are
    shaded in every panel. `end_s` (the time axis) and `max_workers` (the pools' axis) fix the axes
    so several timelines compare side by side."""
    from pdserve.bench.timeline import RECOVERED, pool_names

    fig = _bare_figure(10, 8.5)
    pools_ax, latency_ax, attainment_ax = fig.subplots(3, 1, sharex=True, height_ratios=[1, 1.2, 0.8])
    windows = timeline["windows"]
    samples = timeline["pool_samples"]
    end = end_s or max(timeline.get("end_s") or 0.0, windows[-1]["end_s"] if windows else 0.0) or 1.0
    pools_ax.set_xlim(0.0, end)

    if samples:
        times = [s["t_s"] for s in samples]
        for i, name in enumerate(pool_names(samples)):
            active = [s["pools"][name]["active"] if name in s["pools"] else 0 for s in samples]
            target = [
                math.nan if (t := s["pools"].get(name, {}).get("target")) is None else t for s in samples
            ]
            color = f"C{i % 10}"
            # Thinner for each later pool: pools of the same size stay visible, one over the other.
            pools_ax.step(
                [*times, end],
                [*active, active[-1]],
                where="post",
                color=color,
                linewidth=max(1.0, 4.5 - 2.5 * i),
                alpha=0.7 if i == 0 else 0.9,
                label=f"{name} workers",
            )
            pools_ax.step(
                [*times, end],
                [*target, target[-1]],
                where="post",
                color=color,
                linestyle="--",
                linewidth=0.9,
                alpha=0.8,
                label=f"{name} target",
            )
        top = max(
            [s["pools"][n]["active"] for s in samples for n in s["pools"]]
            + [t for s in samples for p in s["pools"].values() if (t := p["target"]) is not None]
        )
        pools_ax.set_ylim(0, max(top, max_workers or 0) + 1)
        pools_ax.yaxis.get_major_locator().set_params(integer=True)
        pools_ax.legend(**_OUTSIDE)
    else:
        _say(pools_ax, "no pool samples (no GET /pools, or --pool-sample-interval 0)")
    pools_ax.set_ylabel("workers")

    slos = timeline.get("slos_ms") or {}
    series = [("ttft_ms", "p90", "TTFT p90", "C0", "ttft"), ("itl_ms", "p90", "ITL p90", "C3", "itl")]
    values = [w[key][q] for w in windows for key, q, *_ in series if w[key][q] is not None]
    if values:
        bounds = [*values, *(v for k, v in slos.items() if k in ("ttft", "itl"))]
        log = _apply(latency_ax, "y", _limits(bounds))
        for key, q, label, color, slo in series:
            xs, ys = _window_steps(windows, lambda w, key=key, q=q: w[key][q])
            ys = [max(y, MIN_MS) if log and not math.isnan(y) else y for y in ys]
            latency_ax.step(xs, ys, where="post", color=color, label=f"{label} per window")
            if slo in slos:
                latency_ax.axhline(slos[slo], color=color, linestyle=":", linewidth=1.2, label=f"{slo} SLO")
        latency_ax.legend(**_OUTSIDE)
    else:
        _say(latency_ax, NO_DATA)
    latency_ax.set_ylabel("ms")

    shares = [w for w in windows if w["slo_attainment"] is not None]
    if shares:
        attainment_ax.bar(
            [w["start_s"] for w in shares],
            [w["slo_attainment"] * 100 for w in shares],
            width=[w["end_s"] - w["start_s"] for w in shares],
            align="edge",
            color="C2",
            alpha=0.7,
            edgecolor="white",
            label="requests meeting every SLO",
        )
        attainment_ax.axhline(
            RECOVERED * 100, color="0.3", linestyle=":", linewidth=1, label=f"{RECOVERED:.0%}"
        )
        attainment_ax.legend(**_OUTSIDE)
    else:
        _say(attainment_ax, "no SLO attainment (no --slo given)" if not slos else "no requests")
    attainment_ax.set_ylim(0, 105)
    attainment_ax.set_ylabel("SLO attainment (%)")
    attainment_ax.set_xlabel("time since the start (s; requests by send time)")

    for k, step in enumerate(timeline.get("steps") or []):
        for ax in (pools_ax, latency_ax, attainment_ax):
            ax.axvspan(
                step["at_s"], step["at_s"] + step["for_s"], color="0.5", alpha=0.15, linewidth=0, zorder=0
            )
        recovery = step.get("recovery_s")
        note = f"step: {step['label']}" + (
            ""
            if step.get("slo_attainment") is None
            else f", {step['slo_attainment']:.0%} during, "
            + (f"recovered after {recovery:.0f} s" if recovery is not None else "not recovered")
        )
        # Above the pools' lines (the axis goes one worker higher), in data x, axes y.
        right = step["at_s"] > 0.6 * end  # near the right edge: the note ends where the step ends
        pools_ax.text(
            min(step["at_s"] + step["for_s"], end) if right else step["at_s"],
            0.97 - 0.09 * k,
            f"{note} " if right else f" {note}",
            transform=pools_ax.get_xaxis_transform(),
            fontsize=8,
            va="top",
            ha="right" if right else "left",
            color="0.25",
            clip_on=True,
        )
    for ax in (pools_ax, latency_ax, attainment_ax):
        ax.grid(True, which="both", alpha=0.3)
    pools_ax.set_title(title or f"timeline ({timeline['window_s']:g} s windows)")
    return _save(fig, Path(out))


def plot_run(records: list[RequestRecord], out_dir: Path) -> list[Path]:
    """`ttft_cdf.png`, `itl_cdf.png` and `itl_timeline.png` of one run into `out_dir`."""
    out_dir = Path(out_dir)
    return [*plot_cdfs({"run": records}, out_dir), plot_itl_timeline(records, out_dir / "itl_timeline.png")]


def plot_comparison(runs: dict[str, list[RequestRecord]], out_dir: Path) -> list[Path]:
    """CDFs with every run overlaid, and `itl_timeline_<label>.png` per run on the same axes."""
    out_dir = Path(out_dir)
    paths = plot_cdfs(runs, out_dir)
    # One long class and one set of limits for all: the runs replay the same workload, and the
    # point is to compare the same picture under each configuration.
    long_class = _pick_long_class([r for records in runs.values() for r in records])
    ylim = _limits([ms for records in runs.values() for _, ms in _gaps(records, long_class)])
    end = max((_end(records) for records in runs.values()), default=0.0)
    slugs = _slugs(list(runs))
    for label, records in runs.items():
        path = out_dir / f"itl_timeline_{slugs[label]}.png"
        paths.append(
            plot_itl_timeline(
                records, path, long_class, title=label, xlim=(0.0, end * 1.02 or 1.0), ylim=ylim
            )
        )
    return paths


def _slugs(labels: list[str]) -> dict[str, str]:
    """A file-name part per label, unique even for labels that differ only in punctuation."""
    used: set[str] = set()
    slugs = {}
    for label in labels:
        slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", label).strip("_") or "run"
        if slug in used:
            slug = f"{slug}_{len(used)}"
        used.add(slug)
        slugs[label] = slug
    return slugs


def plot_timelines(timelines: dict[str, dict[str, Any]], out_dir: Path) -> list[Path]:
    """`timeline_<label>.png` per run of a comparison, on the same time and workers axes."""
    out_dir = Path(out_dir)
    end = max((t.get("end_s") or 0.0 for t in timelines.values()), default=0.0) or None
    workers = [
        n
        for t in timelines.values()
        for s in t["pool_samples"]
        for p in s["pools"].values()
        for n in (p["active"], p["target"])
        if n is not None
    ]
    slugs = _slugs(list(timelines))
    return [
        plot_timeline(
            timeline,
            out_dir / f"timeline_{slugs[label]}.png",
            title=f"{label}: timeline ({timeline['window_s']:g} s windows)",
            end_s=end,
            max_workers=max(workers, default=None),
        )
        for label, timeline in timelines.items()
    ]
