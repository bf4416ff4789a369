"""`pdserve profile --served`: a profile's steps as they run in serving (no torch here). A real
`pdserve serve --prefill 1 --decode 1` and then `--colocated 2` on this machine, each traced
(`--step-trace`) under a load that climbs from light to past the knee (the bench's own client
and workload), and the sweep's profile refitted to their steps (pdserve/sim/calibrate.py).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from pdserve.bench.client import Target, run_load
from pdserve.bench.run import prepare
from pdserve.bench.workload import parse_workload
from pdserve.errors import PdserveError
from pdserve.measure.server import running

logger = logging.getLogger("pdserve.measure")


# A staircase of chat and documents over the run's thirds: x1, x2, then x3.5 (past the knee of
# SmolLM2 on two cores). Scale it to the hardware with --served-rate-scale.
def load(duration_s: float) -> str:
    third = duration_s / 3
    steps = f"step({third:g},{third:g},2) step({2 * third:g},{third:g},3.5)"
    return (
        f"chat: poisson(2) prompt=lognormal(128,0.6,16,1024) output=uniform(8,96) {steps}; "
        f"docs: poisson(0.1) prompt=uniform(400,1600) output=uniform(4,32) {steps}"
    )


DURATION_S = 90.0
DEPLOYMENTS = (("dpd", ["--prefill", "1", "--decode", "1"]), ("colocated", ["--colocated", "2"]))
MAX_FAILED_SHARE = 0.05  # more failed requests than this, and the trace is not of serving


def trace(
    model: str,
    folder: Path,
    *,
    threads: int | None,
    rate_scale: float = 1.0,
    seed: int = 7,
    duration_s: float = DURATION_S,
) -> list[Path]:
    """One step trace per deployment, each under the same load (the staircase cut at `duration_s`)."""
    workload = parse_workload(load(duration_s), seed, None, duration_s, rate_scale)
    prepared = prepare(workload, model, "completions", "ids", seed)
    traces = []
    for name, flags in DEPLOYMENTS:
        path = folder / f"steps-{name}.jsonl"
        logger.info("served steps: %s under %d requests in %g s", name, len(prepared), duration_s)
        with running(model, [*flags, "--step-trace", str(path)], threads) as server:
            records, _ = asyncio.run(
                run_load(Target(server.url, model, request_timeout_s=300.0), prepared, drain_timeout_s=300.0)
            )
        failed = [r.error for r in records if r.error]
        if len(failed) > MAX_FAILED_SHARE * len(records):
            raise PdserveError(
                f"the served-steps probe ({name}): {len(failed)} of {len(records)} requests failed: {failed[0]}"
            )
        traces.append(path)
    return traces
