"""A profile's step times fitted to a served run's own steps (`pdserve profile --from-trace`). No
torch.

A sweep times one engine alone on a quiet CPU; a server's steps run beside the router, the other
workers, the client of a benchmark and their memory traffic, and between two steps its worker loop
sends tokens and handles messages. On a small shared host that moves a step's time by 10-30%,
more than any fit's error, and by how much depends on the load. `pdserve serve --step-trace FILE`
writes every worker's steps as its load reports bring them (router.recorder.STEP_TRACE_KEYS);
this fits each pool role's step time to the steps that pool's workers ran, and the worker loop's
time around a step (per step and per stream) to what the decode-side workers reported, into a copy
of a base profile (its KV transfers, start time, blocks and request overhead are kept). The result
says `steps_from: serving`: the simulation then adds no host contention of its own (the fit has it,
at the loads the trace covered: trace a load like the ones to simulate, up to the knee).
"""

from __future__ import annotations

import datetime
import json
import statistics
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdserve.costmodel import Step
from pdserve.sim.profile import LinearStep, Overhead, Profile, ProfileError, StepTime

MIN_STEPS = 30  # per pool role, to fit five coefficients with any confidence
MIN_BUCKET = 5  # steps of one stream count for its median loop time to count


def read_trace(paths: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """Each pool's steps, from one or more step traces (JSON lines)."""
    pools: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for path in paths:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise ProfileError(f"cannot read the step trace {path}: {exc.strerror or exc}") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                pools[str(row["pool"])].append(row)
                float(row["seconds"])
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ProfileError(
                    f"{path}:{number} is not a step trace line (pdserve serve --step-trace): {exc}"
                ) from None
    return dict(pools)


def _step(row: dict[str, Any]) -> Step:
    return Step(
        int(row["prefill_tokens"]),
        int(row["prefill_attention"]),
        int(row["decode_streams"]),
        int(row["decode_context"]),
    )


def fit_loop(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """(per step, per stream) seconds of the worker loop around a decode step: a line through the
    median loop time at each stream count (medians: a step that waited on a KV pull, which the
    simulation models apart, does not move them), least squares weighted by steps, both >= 0."""
    by_streams: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        streams = int(row["decode_streams"])
        if streams > 0:
            by_streams[streams].append(float(row.get("loop_seconds", 0.0)))
    points = [(n, statistics.median(v), len(v)) for n, v in by_streams.items() if len(v) >= MIN_BUCKET]
    if not points:
        return 0.0, 0.0
    total = sum(w for _, _, w in points)
    mean_n = sum(n * w for n, _, w in points) / total
    mean_y = sum(y * w for _, y, w in points) / total
    spread = sum(w * (n - mean_n) ** 2 for n, _, w in points)
    slope = sum(w * (n - mean_n) * (y - mean_y) for n, y, w in points) / spread if spread > 0 else 0.0
    slope = max(0.0, slope)
    base = mean_y - slope * mean_n
    if base < 0:  # through the origin instead
        base, slope = 0.0, sum(w * n * y for n, y, w in points) / sum(w * n * n for n, _, w in points)
    return round(base, 6), round(max(0.0, slope), 7)


def calibrated(base: Profile, traces: list[Path]) -> Profile:
    """`base` with each traced pool role's step time, and the loop's time, fitted to the trace."""
    pools = read_trace(traces)
    steps: dict[str, StepTime] = {}
    notes = []
    for role, rows in sorted(pools.items()):
        timed = [(_step(r), float(r["seconds"])) for r in rows if float(r["seconds"]) > 0]
        if len(timed) < MIN_STEPS:
            notes.append(f"the {role} pool ran {len(timed)} steps in the trace (< {MIN_STEPS}): not fitted")
            continue
        steps[role] = LinearStep.fitted(timed)
    if not steps:
        raise ProfileError(
            f"no pool ran {MIN_STEPS} steps or more in {', '.join(map(str, traces))}: nothing to fit"
        )
    decode_side = [r for pool in ("decode", "colocated") for r in pools.get(pool, [])]
    per_step, per_stream = fit_loop(decode_side)
    kept = sorted(set(base.steps) - set(steps))
    if "colocated" not in steps and "decode" in steps:
        kept = [role for role in kept if role != "colocated"]  # a mixed worker steps like a decode one
        notes.append("colocated steps: the decode pool's served fit (no colocated pool in the trace)")
    for role in kept:
        notes.append(
            f"{role} steps: the base profile's (no {role} pool in the trace), without host contention"
        )
    counts = ", ".join(f"{role} {len(pools[role])}" for role in sorted(steps))
    names = ", ".join(Path(t).name for t in traces)
    return replace(
        base,
        steps={role: base.steps[role] for role in kept} | steps,
        steps_busy={},
        steps_from="serving",
        overhead=Overhead(base.overhead.request_s, per_step, per_stream),
        meta=base.meta
        | {
            "calibrated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "step_traces": names,
        },
        assumptions=[
            *base.assumptions,
            f"step times fitted to served steps ({counts}) from {names}: the host's contention at the "
            "loads traced is in them, so the simulation adds none",
            *notes,
        ],
    )
