"""`pdserve profile --served`: a profile's steps as they run in serving (no torch here). A real
`pdserve serve --prefill 1 --decode 1` and then `--colocated 2` on this machine (and, on two
CPUs, which those fill, a `--colocated 1` that leaves one free, at half the load), each traced
(`--step-trace`) under a load that climbs from light to past the knee (the bench's own client
and workload: a built-in staircase of chat and documents, or `--served-workload`, the workload
to plan for, at 0.5x, 1x, 2x and 3.5x its rate), and the sweep's profile refitted to their steps
(pdserve/sim/calibrate.py).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from pdserve.bench.client import Target, run_load
from pdserve.bench.compare import prompt_seed
from pdserve.bench.run import conversation_encoder, prepare
from pdserve.bench.workload import Workload, parse_workload
from pdserve.errors import PdserveError
from pdserve.measure.server import running

logger = logging.getLogger("pdserve.measure")


# Chat and documents at these rates climb a staircase over the run's quarters: x0.5, x1, x2, then
# x3.5 (past the knee of SmolLM2 on two cores). Scale it to the hardware with --served-rate-scale.
CLASSES = (
    "chat: poisson(2) prompt=lognormal(128,0.6,16,1024) output=uniform(8,96)",
    "docs: poisson(0.1) prompt=uniform(400,1600) output=uniform(4,32)",
)
# A workload's rate times these, a part of the run each, one after another. The first is light:
# the fit's idle term is only as good as the idle steps it sees (the AVX2 EPYC's light-load steps
# of another run came x1.2-1.4 over a fit without such a phase; on the AVX512 EPYC the light
# quarter's median step sat on the fit, in sample and held out: docs/performance.md).
STAIRCASE = (0.5, 1.0, 2.0, 3.5)
DURATION_S = 120.0


def load(duration_s: float) -> str:
    """The built-in staircase as one workload: CLASSES at STAIRCASE[0] times their rate (the
    workload's rate scale says it), stepping up to each next multiple for its part of the run."""
    part = duration_s / len(STAIRCASE)
    steps = " ".join(
        f"step({i * part:g},{part:g},{factor / STAIRCASE[0]:g})" for i, factor in enumerate(STAIRCASE) if i
    )
    return "; ".join(f"{spec} {steps}" for spec in CLASSES)


# (name, flags, share of the load): two workers each, under the whole load.
DEPLOYMENTS = (("dpd", ["--prefill", "1", "--decode", "1"], 1.0), ("colocated", ["--colocated", "2"], 1.0))
# Where those fill the host's CPUs (two): one worker that leaves a CPU free, under the same load a
# worker. Its steps spread otherwise (the router and the client run on the free CPU, not between
# its steps: pdserve/sim/calibrate.py `set_free_runs_apart`); the simulation draws a deployment
# that leaves a CPU free from them.
FREE_CPU_DEPLOYMENT = ("colocated-1", ["--colocated", "1"], 0.5)
MAX_FAILED_SHARE = 0.05  # more failed requests than this, and the trace is not of serving


def phases(workload: str | None, duration_s: float, rate_scale: float, seed: int) -> list[Workload]:
    """The load the servers are traced under: the built-in staircase (one workload), or `workload`
    (the bench's spec: classes, presets, trace replays, conversations) at each STAIRCASE multiple
    of `rate_scale` for an equal part of `duration_s`, one after another, each drawn with its own
    seed."""
    if workload is None:
        return [parse_workload(load(duration_s), seed, None, duration_s, rate_scale * STAIRCASE[0])]
    part = duration_s / len(STAIRCASE)
    try:
        # A closed loop needs a request count to parse at all: one, to ask what it is.
        if parse_workload(workload, seed, 1, part, rate_scale).concurrency is not None:
            raise PdserveError(
                "a closed loop (concurrency(n)) has no rate to climb; give an arrival process "
                "(poisson, gamma, constant) or a trace replay"
            )
        return [
            parse_workload(workload, seed + i, None, part, rate_scale * factor)
            for i, factor in enumerate(STAIRCASE)
        ]
    except PdserveError as exc:
        raise PdserveError(f"--served-workload: {exc}") from None


def trace(
    model: str,
    folder: Path,
    *,
    threads: int | None,
    rate_scale: float = 1.0,
    seed: int = 7,
    duration_s: float = DURATION_S,
    workload: str | None = None,
    cpus: int | None = None,
) -> list[Path]:
    """One step trace per deployment, each under the same load: the staircase cut at `duration_s`,
    or `workload` climbing through STAIRCASE (so that the fit sees the mix of prompts and outputs
    the plan is for, from light to past the knee). `cpus`: the host's (the profile's); on two,
    FREE_CPU_DEPLOYMENT is traced too."""
    deployments = [*DEPLOYMENTS, *([FREE_CPU_DEPLOYMENT] if cpus == 2 else [])]
    traces = []
    for name, flags, share in deployments:
        loads = phases(workload, duration_s, rate_scale * share, seed)
        # Each phase's prompts of their own: a server's prefix cache would find the last phase's.
        prepared = [
            prepare(w, model, "completions", "ids", prompt_seed(seed, i)) for i, w in enumerate(loads)
        ]
        # Conversations go on with their answers, which come back as text: re-encoded for the next turn.
        encode = conversation_encoder(loads[0], model, "completions", "ids")
        total = sum(len(p) for p in prepared)
        path = folder / f"steps-{name}.jsonl"
        logger.info("served steps: %s under %d requests in %g s", name, total, duration_s)
        records = []
        with running(model, [*flags, "--step-trace", str(path)], threads) as server:
            for phase, requests in zip(loads, prepared, strict=True):
                done, _ = asyncio.run(
                    run_load(
                        Target(server.url, model, request_timeout_s=300.0),
                        requests,
                        duration_s=phase.duration_s,  # a conversation's later turns stop with it
                        drain_timeout_s=300.0,
                        encode=encode,
                    )
                )
                records += done
        failed = [r.error for r in records if r.error]
        if len(failed) > MAX_FAILED_SHARE * len(records):
            raise PdserveError(
                f"the served-steps probe ({name}): {len(failed)} of {len(records)} requests failed: {failed[0]}"
            )
        traces.append(path)
    return traces
