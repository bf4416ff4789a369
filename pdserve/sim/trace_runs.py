"""What each traced run of a step trace was (`pdserve profile --from-trace`, calibrate.py): how many
workers it had against the host's CPUs (a run that left one free spreads and loops otherwise), and at what
pace the host served it against the speed check the profile was measured with. No torch."""

from __future__ import annotations

import logging
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

from pdserve.sim.profile import Profile
from pdserve.sim.speed import SpeedCheck
from pdserve.sim.spread_fit import MIN_STEPS

logger = logging.getLogger("pdserve.sim")

# A traced run's one-stream decode steps this far from the speed check's (their median against its)
# are said loudly: on the AVX512 EPYC such steps, served, came x0.95-1.03 of the checks around
# them in 8 runs of 10, and a profile whose traces ran x1.15-1.29 of its own check carried that
# slow patch into every simulation scaled by checks.
CHECK_DRIFT = 0.10


def by_run(pools: dict[str, list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Each traced run's rows (`read_trace`'s index: `trace`), every pool's together (one run's
    workers shared a host), in the order of the traces."""
    runs: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for rows in pools.values():
        for row in rows:
            runs[row["trace"]].append(row)
    return [runs[run] for run in sorted(runs)]


def runs_with_a_free_cpu(pools: dict[str, list[dict[str, Any]]], cpus: int) -> set[int]:
    """The traced runs (`read_trace`'s index) whose workers were fewer than the host's CPUs."""
    return {rows[0]["trace"] for rows in by_run(pools) if len({str(r["worker"]) for r in rows}) < cpus}


def against_the_check(base: Profile, pools: dict[str, list[dict[str, Any]]], traces: list[Path]) -> list[str]:
    """For each traced run with MIN_STEPS one-stream decode steps: their median against the one-
    stream steps of the speed check `base` was measured with (none: no check). A run far from it
    (CHECK_DRIFT) ran in a patch of the host the check did not see, and the fit holds it: said
    in the notes and logged."""
    body = base.meta.get("speed_check")
    if body is None:
        return []
    check = SpeedCheck.from_json(body, "meta.speed_check")
    one = [seconds for step, seconds in check.steps if step.prefill_tokens == 0 and step.decode_streams == 1]
    if not one:
        return []
    reference = statistics.median(one)
    notes = []
    for rows in by_run(pools):
        seconds = [
            float(r["seconds"])
            for r in rows
            if int(r["decode_streams"]) == 1 and int(r["prefill_tokens"]) == 0 and float(r["seconds"]) > 0
        ]
        if len(seconds) < MIN_STEPS:
            continue
        served = statistics.median(seconds)
        note = (
            f"{Path(traces[rows[0]['trace']]).name}: its one-stream decode steps x{served / reference:.2f} the speed "
            f"check's ({served * 1000:.1f} against {reference * 1000:.1f} ms)"
        )
        if abs(served / reference - 1) > CHECK_DRIFT:
            note += (
                ": the host served at another pace than it was checked at, and the fit holds it (a "
                "simulation scaled by checks carries it): trace again, or simulate by a served run's "
                "own pace (--speed-trace)"
            )
            logger.warning("%s", note)
        notes.append(note)
    return notes
