"""The timeline of a `pdserve bench` run: latency and SLO attainment per window, the pools' sizes
over time, worker-seconds, and how the run took a step of the workload's rate. Pure functions of
the per-request records and the pool samples; no torch, no HTTP (the client takes the samples).

- A window (`--timeline-window`, 10 s) holds the requests *sent* in it: how many were sent, how
  many finished without error, TTFT p50/p90 and ITL p90 of those that finished (all their gaps
  pooled), and SLO attainment: the share of the requests sent in it that meet every SLO given, as
  goodput counts them (summary.meets; an error or a request that streamed nothing misses). A
  window with no request sent has no attainment (None), nor latencies.
- A pool sample is what GET /pools answered at `t_s` seconds after the start, per pool: the
  target and the workers by state. `active` counts those that cost a machine: starting, up and
  draining (a worker that is starting costs too; one that is down or stopped does not).
- Worker-seconds: the integral of `active` over time, each sample holding until the next one (the
  last until the run's end); nothing is counted before the first sample.
- A step summary (one per distinct (at_s, for_s) of the workload's steps): SLO attainment of the
  requests sent during the step, worker-seconds during it and after it (up to the next step or the
  run's end), and the time to recover: seconds from the step's start to the first window, among
  those from the one holding the start up to the next step, from which every window with
  requests has attainment >= RECOVERED (0 when it never fell below; None, "not recovered", when
  the last such window is below).

Missing values are None (JSON null) rather than NaN.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

from pdserve.bench.distributions import Step
from pdserve.bench.summary import RequestRecord, meets, percentile

DEFAULT_WINDOW_S = 10.0
DEFAULT_POOL_SAMPLE_INTERVAL_S = 2.0
RECOVERED = 0.9  # the attainment a window must hold to count as recovered
STATES = ("starting", "up", "draining", "down")  # the worker states of GET /pools, in this order
ACTIVE = ("starting", "up", "draining")  # those that cost a worker


# --- pool samples -----------------------------------------------------------------------------


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def pool_counts(body: Any) -> dict[str, dict[str, Any]]:
    """Per pool {"target", "workers" (count per state), "active", "desired"} of a GET /pools answer
    ({"pools": {"prefill": {"target": 1, "workers": [{"id": ..., "state": "up"}, ...]}, ...}}).
    "desired" is the planner's size for the pool where the answer has one ("planner": {"pools":
    {"prefill": {"desired": 2}}}), else None. Other keys are ignored; raises ValueError when the
    answer is not of that shape (not the pdserve admin route)."""
    pools = body.get("pools") if isinstance(body, dict) else None
    if not isinstance(pools, dict):
        raise ValueError("the answer has no 'pools' object")
    planner = body.get("planner")
    plans = planner.get("pools") if isinstance(planner, dict) else None
    plans = plans if isinstance(plans, dict) else {}
    out: dict[str, dict[str, Any]] = {}
    for name, pool in pools.items():
        workers = pool.get("workers") if isinstance(pool, dict) else None
        if not isinstance(workers, list) or not all(isinstance(w, dict) for w in workers):
            raise ValueError(f"pool {name!r} has no 'workers' list of objects")
        counts = Counter(str(w.get("state", "unknown")) for w in workers)
        plan = plans.get(name)
        out[str(name)] = {
            "target": _int(pool.get("target")),
            "workers": {s: counts.get(s, 0) for s in STATES}
            | {s: n for s, n in counts.items() if s not in STATES},
            "active": sum(counts.get(s, 0) for s in ACTIVE),
            "desired": _int(plan.get("desired")) if isinstance(plan, dict) else None,
        }
    return out


def pool_names(samples: Sequence[dict[str, Any]]) -> list[str]:
    """Every pool seen in any sample, in the order first seen."""
    return list(dict.fromkeys(name for s in samples for name in s["pools"]))


def worker_seconds(
    samples: Sequence[dict[str, Any]], end_s: float, start_s: float = 0.0, stop_s: float | None = None
) -> dict[str, Any] | None:
    """{"pools": {name: worker-seconds}, "total": ...} from start_s to stop_s (default: end_s), each
    sample holding until the next (the last until end_s); None without samples."""
    if not samples:
        return None
    stop = end_s if stop_s is None else min(stop_s, end_s)
    per_pool = dict.fromkeys(pool_names(samples), 0.0)
    ordered = sorted(samples, key=lambda s: s["t_s"])
    for k, sample in enumerate(ordered):
        held_until = ordered[k + 1]["t_s"] if k + 1 < len(ordered) else max(end_s, sample["t_s"])
        span = min(held_until, stop) - max(sample["t_s"], start_s)
        if span <= 0:
            continue
        for name, pool in sample["pools"].items():
            per_pool[name] += pool["active"] * span
    return {"pools": per_pool, "total": sum(per_pool.values())}


def sample_at(samples: Sequence[dict[str, Any]], t_s: float) -> dict[str, Any] | None:
    """The last sample taken at or before t_s (samples in time order), else None."""
    found = None
    for sample in samples:
        if sample["t_s"] > t_s:
            break
        found = sample
    return found


# --- windows ----------------------------------------------------------------------------------


def _ms(values: Sequence[float], q: float) -> float | None:
    return percentile(values, q) * 1000 if values else None


def _attainment(group: Sequence[RequestRecord], slos: dict[str, float]) -> tuple[int | None, float | None]:
    """(requests meeting every SLO, their share of the group): None without SLOs or requests."""
    if not slos or not group:
        return None, None
    good = sum(1 for r in group if meets(r, slos))
    return good, good / len(group)


def windows(
    records: Sequence[RequestRecord], end_s: float, window_s: float, slos: dict[str, float] | None = None
) -> list[dict[str, Any]]:
    """One entry per window of window_s seconds from 0 to end_s (the last may be shorter), the
    requests assigned by send time (see the module docstring)."""
    if window_s <= 0 or not math.isfinite(window_s):
        raise ValueError(f"the timeline window must be a finite number of seconds > 0, got {window_s}")
    slos = slos or {}
    last_sent = max((r.sent_s for r in records), default=0.0)
    end = max(end_s, last_sent)
    count = max(1, math.ceil(end / window_s - 1e-9)) if end > 0 else (1 if records else 0)
    groups: list[list[RequestRecord]] = [[] for _ in range(count)]
    for r in records:
        groups[min(int(r.sent_s // window_s), count - 1)].append(r)
    result = []
    for k, group in enumerate(groups):
        done = [r for r in group if r.ok]
        ttfts = [t for r in done if (t := r.ttft) is not None]
        gaps = [gap for r in done for gap in r.itls]
        good, attainment = _attainment(group, slos)
        result.append(
            {
                "start_s": k * window_s,
                "end_s": min((k + 1) * window_s, end) if k == count - 1 else (k + 1) * window_s,
                "sent": len(group),
                "finished": len(done),
                "errors": len(group) - len(done),
                "ttft_ms": {"p50": _ms(ttfts, 50), "p90": _ms(ttfts, 90)},
                "itl_ms": {"p90": _ms(gaps, 90)},
                "good": good,
                "slo_attainment": attainment,
            }
        )
    return result


def recovery_s(
    windows_: Sequence[dict[str, Any]], at_s: float, until_s: float = math.inf, threshold: float = RECOVERED
) -> float | None:
    """Seconds from at_s to the start of the first window (among those ending after at_s and
    starting before until_s) from which every window with an attainment has one >= threshold;
    0 if it never fell below; None if the last such window is below, or none has an attainment."""
    considered = [
        w
        for w in windows_
        if w["end_s"] > at_s and w["start_s"] < until_s and w["slo_attainment"] is not None
    ]
    if not considered or considered[-1]["slo_attainment"] < threshold:
        return None
    first = len(considered) - 1
    while first > 0 and considered[first - 1]["slo_attainment"] >= threshold:
        first -= 1
    return max(0.0, float(considered[first]["start_s"]) - at_s)


def step_summaries(
    steps: Sequence[tuple[str, Step]],
    records: Sequence[RequestRecord],
    windows_: Sequence[dict[str, Any]],
    samples: Sequence[dict[str, Any]],
    end_s: float,
    slos: dict[str, float] | None = None,
) -> list[dict[str, Any]]:
    """One summary per distinct (at_s, for_s) of the workload's steps, in time order (see the
    module docstring)."""
    slos = slos or {}
    grouped: dict[tuple[float, float], list[tuple[str, Step]]] = {}
    for cls, step in sorted(steps, key=lambda item: (item[1].at_s, item[1].for_s)):
        grouped.setdefault((step.at_s, step.for_s), []).append((cls, step))
    starts = sorted({at for at, _ in grouped})
    result = []
    for (at, length), members in grouped.items():
        later = [s for s in starts if s > at]
        until = later[0] if later else math.inf
        during = [r for r in records if at <= r.sent_s < at + length]
        good, attainment = _attainment(during, slos)
        recovery = recovery_s(windows_, at, until) if slos else None
        result.append(
            {
                "at_s": at,
                "for_s": length,
                "steps": [{"class": cls, "factor": step.factor} for cls, step in members],
                "label": ", ".join(f"{cls} x{step.factor:g}" for cls, step in members),
                "sent": len(during),
                "good": good,
                "slo_attainment": attainment,
                "recovery_s": recovery,
                "recovered": recovery is not None if slos else None,  # None: no SLOs to recover
                "worker_seconds": worker_seconds(samples, end_s, at, at + length),
                "worker_seconds_after": worker_seconds(samples, end_s, at + length, until),
            }
        )
    return result


def build_timeline(
    records: Sequence[RequestRecord],
    end_s: float,
    slos: dict[str, float] | None = None,
    window_s: float = DEFAULT_WINDOW_S,
    samples: Sequence[dict[str, Any]] = (),
    steps: Sequence[tuple[str, Step]] = (),
    pool_sample_interval_s: float | None = None,
) -> dict[str, Any]:
    """The `timeline` of summary.json: windows, pool samples, worker-seconds and step summaries."""
    slos = slos or {}
    samples = sorted(samples, key=lambda s: s["t_s"])
    wins = windows(records, end_s, window_s, slos)
    return {
        "window_s": window_s,
        "slos_ms": {k: v * 1000 for k, v in slos.items()},
        "end_s": end_s,
        "windows": wins,
        "pool_sample_interval_s": pool_sample_interval_s,
        "pool_samples": list(samples),
        "worker_seconds": worker_seconds(samples, end_s),
        "steps": step_summaries(steps, records, wins, samples, end_s, slos),
    }


# --- text -------------------------------------------------------------------------------------


def _cell(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def share_text(value: float | None) -> str:
    return "-" if value is None else f"{value * 100:.0f}%"


def _pool_cell(name: str, pool: dict[str, Any]) -> str:
    workers = pool["workers"]
    text = f"{name} {workers.get('up', 0)}"
    if workers.get("starting"):
        text += f"+{workers['starting']}s"
    if workers.get("draining"):
        text += f"+{workers['draining']}d"
    return text + f"/{'-' if pool['target'] is None else pool['target']}"


def worker_seconds_text(ws: dict[str, Any] | None) -> str:
    if ws is None:
        return "-"
    parts = ", ".join(f"{name} {value:.0f}" for name, value in ws["pools"].items())
    return f"{ws['total']:.0f}" + (f" ({parts})" if len(ws["pools"]) > 1 else "")


def format_step(step: dict[str, Any]) -> str:
    if step["slo_attainment"] is None:
        during = "no SLO attainment (give --slo)" if step["sent"] else "no request sent during it"
        recovered = ""
    else:
        during = (
            f"SLO attainment {share_text(step['slo_attainment'])} during it ({step['good']}/{step['sent']})"
        )
        recovered = (
            f", recovered {step['recovery_s']:.0f} s after its start"
            if step["recovered"]
            else ", not recovered"
        )
    text = f"step at {step['at_s']:g} s for {step['for_s']:g} s ({step['label']}): {during}{recovered}"
    if step["worker_seconds"] is not None:
        text += f"; worker-seconds {worker_seconds_text(step['worker_seconds'])} during it"
        text += f", {worker_seconds_text(step['worker_seconds_after'])} after"
    return text


def format_timeline(timeline: dict[str, Any]) -> str:
    """A compact table, a window a line, then worker-seconds and the step summaries."""
    samples = timeline["pool_samples"]
    names = pool_names(samples)
    lines = [f"==== timeline ({timeline['window_s']:g} s windows, requests by send time) ===="]
    header = f"{'from s':>7} {'sent':>5} {'done':>5} {'err':>4} {'TTFT p50':>9} {'p90':>7} {'ITL p90':>8} {'SLO ok':>7}"
    if names:
        header += "  pools: up[+N starting s][+N draining d]/target at the window's end"
    lines.append(header)
    for w in timeline["windows"]:
        line = (
            f"{w['start_s']:>7g} {w['sent']:>5} {w['finished']:>5} {w['errors']:>4} "
            f"{_cell(w['ttft_ms']['p50']):>9} {_cell(w['ttft_ms']['p90']):>7} "
            f"{_cell(w['itl_ms']['p90'], 1):>8} {share_text(w['slo_attainment']):>7}"
        )
        sample = sample_at(samples, w["end_s"])
        if sample is not None:
            line += "  " + " ".join(_pool_cell(n, p) for n, p in sample["pools"].items())
        lines.append(line)
    if timeline["worker_seconds"] is not None:
        lines.append(
            f"worker-seconds (starting, up or draining; {len(samples)} samples of GET /pools): "
            + worker_seconds_text(timeline["worker_seconds"])
        )
    lines += [format_step(step) for step in timeline["steps"]]
    return "\n".join(lines)
