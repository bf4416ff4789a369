"""The worker loop's time around a decode step, fitted to served steps (`pdserve profile
--from-trace`, calibrate.py). No torch.

Between two steps a worker's loop sends the step's tokens and handles its messages: 0.7-1.3 ms
at 1-3 streams in the AVX512 EPYC profile's own traces (0.4-0.6 ms in a lone colocated worker's
at a light load), 4-6 ms at 60 streams past the knee. It grows with the load (more tokens out, a
busier router to take them), which a line in the stream count reads badly at small batches:
fitted one point a count, its base was 1.9 ms, and a colocated worker's ITL came 10% long at a
light load by it. So the loop keeps both: the line, and each count's own mean where the traces ran
it in MIN_TABLE_STEPS steps or more (`LoopTime.by_streams`; the median in older traces).
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from pdserve.sim.profile import LoopTime

MIN_BUCKET = 5  # steps of one stream count for it to be a point of the line
MIN_TABLE_STEPS = 20  # steps of one stream count for its own mean to be kept


def _loops_by_streams(
    rows: list[dict[str, Any]],
) -> tuple[dict[int, list[float]], Callable[[list[float]], float]]:
    """Each stream count's loop times (the time each waited on KV pulls left out where the trace
    says it), and their middle: the mean where the waits are known, else the median."""
    by_streams: dict[int, list[float]] = defaultdict(list)
    for row in rows:
        if int(row["decode_streams"]) > 0:
            own = float(row.get("loop_seconds", 0.0)) - float(row.get("pull_wait_seconds", 0.0))
            by_streams[int(row["decode_streams"])].append(max(0.0, own))
    waits_known = all("pull_wait_seconds" in row for row in rows)
    return by_streams, statistics.fmean if waits_known else statistics.median


def fit_line(rows: list[dict[str, Any]]) -> tuple[float, float]:
    """(per step, per stream) seconds of the worker loop around a decode step: a line through the
    median loop time at each stream count seen in MIN_BUCKET steps or more, each count one point
    (a light load's many small batches would otherwise set the line, and the loop grows with the
    load: more tokens to send, a busier router to send them to), both >= 0. The loop's own work:
    the time it waited on KV pulls, which the simulation models apart, left out where the trace
    says it (`pull_wait_seconds`), and then each count's mean, since the simulated loop takes the
    same time every step and what the loop costs the streams over a run is its mean (at 15-20
    streams the mean was twice the median: a few long loops). Older traces do not say it: medians
    then, so that a step that waited on a pull does not move them."""
    return _line(*_loops_by_streams(rows))


def _line(by_streams: dict[int, list[float]], middle: Callable[[list[float]], float]) -> tuple[float, float]:
    points = [(n, middle(v)) for n, v in by_streams.items() if len(v) >= MIN_BUCKET]
    if not points:
        return 0.0, 0.0
    mean_n = statistics.fmean(n for n, _ in points)
    mean_y = statistics.fmean(y for _, y in points)
    spread = sum((n - mean_n) ** 2 for n, _ in points)
    slope = sum((n - mean_n) * (y - mean_y) for n, y in points) / spread if spread > 0 else 0.0
    slope = max(0.0, slope)
    base = mean_y - slope * mean_n
    if base < 0:  # through the origin instead
        base, slope = 0.0, sum(n * y for n, y in points) / sum(n * n for n, _ in points)
    return round(base, 6), round(max(0.0, slope), 7)


def fit_loop(rows: list[dict[str, Any]]) -> LoopTime:
    """The line (`fit_line`), and each stream count's own loop time (its mean, or its median in
    older traces, as the line's points) where the steps ran it MIN_TABLE_STEPS times or more."""
    by_streams, middle = _loops_by_streams(rows)
    base, slope = _line(by_streams, middle)
    table = tuple(
        (n, round(middle(v), 7)) for n, v in sorted(by_streams.items()) if len(v) >= MIN_TABLE_STEPS
    )
    return LoopTime(base, slope, table)


def loop_note(role: str, loop: LoopTime, runs: str = "") -> str:
    """The profile's assumption line for a loop with traced counts (`runs`: of which runs)."""
    counts = [n for n, _ in loop.by_streams]
    return (
        f"{role} worker loop{' ' + runs if runs else ''}: each stream count the trace ran {MIN_TABLE_STEPS} times or more its own "
        f"({len(counts)} counts, {counts[0]} to {counts[-1]}; {loop.by_streams[0][1] * 1000:.2f} ms at "
        f"{counts[0]}), the line ({loop.step_s * 1000:.2f} ms + {loop.stream_s * 1000:.3f} ms a stream) "
        "past them and across gaps (pdserve/sim/loop_fit.py)"
    )
