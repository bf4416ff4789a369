"""A served run's own speed, read from its step trace (`pdserve serve --step-trace`): the factor of
the whole run, the prompt work's factor, and how the host's speed moved over the run. No torch.

`pdserve sim --speed-trace FILE` scales a profile fitted to served steps by what the trace's steps
took against that fit: the run's median (`TraceSpeed.factor`), and, as a speed check does
(`speed.prompt_factor`), its prompt-only steps' median for the prompt work (`TraceSpeed.prompt`),
and its mixed steps' (prompt tokens beside decode streams) for those (`TraceSpeed.mixed`); the
run's factor is then its decode-only steps' median. Where the fit knows the stream GEMV, the
prompt-only steps on the GEMM (more rows than it takes) are a kind of their own
(`TraceSpeed.gemm`), and each pool reads every kind from its own steps where it has enough of
them (`TraceSpeed.pools`): the kernels and the pools' fits do not move alike.
A DPD run at its knee on the AVX512 EPYC read x0.982 over all its steps but x0.895 over its
prefill worker's: scaled by the one factor the simulated prefill worker ran ~9% slow, near
saturation, and its documents' TTFT p50 came +29% (p90 +50%); scaled by both, -3% (+22%).

`--speed-window S` replays the host's speed over time too (`SpeedCourse`): a shared host stalls
for tens of seconds (the same run's steps 1.2-1.5x their fit for 30 s, after 40 s at 0.92-1.02),
a backlog forms at the knee and lasts past the stall, and no one factor reproduces that. Each
window of S seconds of the trace, per pool, takes its steps' time against their fit relative to
the whole run's (each kind of step against its kind's); the simulation's steps (and the worker
loop's time) run that much longer in the same window of the workload (both clocks from the
workload's start: the trace's from its first step, which comes a prompt's time after the first
request). A diagnosis, not a prediction: it
says whether a miss was the model's or the host's, and needs the measured run's own trace.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace
from pathlib import Path

from pdserve.sim.profile import Profile
from pdserve.sim.speed import MIN_PAIRS
from pdserve.sim.step_time import LinearStep, ProfileError, StepTime

MIN_KIND_STEPS = 20  # a trace's prompt-only (or mixed) steps, at least, for that kind's own factor
MIN_WINDOW_STEPS = 3  # a window's steps of one pool, at least, for a factor of its own (else x1)
MIN_WINDOW_S = 1.0  # a window holds a few steps (the trace's clock is its load reports')


@dataclass(frozen=True)
class TracedStep:
    """One step of the trace against the profile's fit."""

    pool: str
    t_s: float  # when its load report came, seconds since the trace's first step
    seconds: float  # measured
    expected: float  # the fit's, beside its neighbours as busy as they were, at the fit's median
    # "prompt" (prompt tokens only), "gemm" (those, past the stream GEMV where the fit knows it),
    # "mixed" (prompt tokens beside decode streams) or "decode"
    kind: str

    @property
    def ratio(self) -> float:
        return self.seconds / self.expected


@dataclass(frozen=True)
class PoolSpeed:
    """One pool's steps against the fit, each kind where the pool has enough of its own (decode
    steps MIN_PAIRS, the others MIN_KIND_STEPS), else at the run's."""

    factor: float
    prompt: float | None
    mixed: float | None
    gemm: float | None
    steps: int

    def kinds(self) -> tuple[float, float | None, float | None, float | None]:
        return self.factor, self.prompt, self.mixed, self.gemm


@dataclass(frozen=True)
class TraceSpeed:
    """What a served run's steps took against the profile's fit."""

    factor: float  # the median of measured / fitted over its decode-only steps (all: too few of them)
    prompt: float | None  # the same over its prompt-only steps (None: fewer than MIN_KIND_STEPS)
    mixed: float | None  # ... over its steps of prompt tokens beside decode streams
    gemm: float | None  # ... over its prompt-only steps on the GEMM (those then not in `prompt`)
    steps: int
    prompt_steps: int
    mixed_steps: int
    gemm_steps: int
    # Each pool's own: a decode worker's local prompts ran at 1.22 of the fit where the prefill
    # worker's ran at 0.87 in one DPD run (the decode pool's fit for prompt-only steps is the
    # least measured), and by their one median the prefill worker's prompt steps ran 35% slow.
    pools: dict[str, PoolSpeed]


@dataclass(frozen=True)
class SpeedCourse:
    """How much longer than the run's own pace each window's steps took, per pool: the time the
    window's steps took over their fitted time, divided by the same over the whole run (x1 where a
    window has fewer than MIN_WINDOW_STEPS steps of that pool, and after the trace's end)."""

    window_s: float
    factors: dict[str, tuple[float, ...]]  # pool -> one factor per window, the first from 0

    def at(self, pool: str, seconds: float) -> float:
        """The factor for a step of `pool` that starts `seconds` after the workload began."""
        windows = self.factors.get(pool, ())
        index = int(seconds // self.window_s) if seconds >= 0 else -1
        return windows[index] if 0 <= index < len(windows) else 1.0

    def describe(self) -> str:
        return "; ".join(
            f"{pool} " + " ".join(f"{factor:.2f}" for factor in factors)
            for pool, factors in self.factors.items()
        )


def traced_steps(profile: Profile, traces: list[Path]) -> list[TracedStep]:
    """Every step of the traces of a pool the profile has, against the profile's fit there, each
    fitted beside its neighbours as busy as the trace says (as the fit reads them) and against the
    fit's own median deviation at its length. Only a profile fitted to served steps
    (`steps_from: serving`): a sweep's leaves out the router's and the client's CPU, which the
    served steps hold and the simulation adds again."""
    from pdserve.sim import (  # the trace's reader and neighbours' reckoning, as the fit's
        calibrate,
        trace_runs,
    )

    if profile.steps_from != "serving":
        raise ProfileError(
            "a step trace can only scale a profile fitted to served steps (pdserve profile --served "
            "or --from-trace): this one's steps are a sweep's"
        )
    cpus = profile.host.cpus if profile.host is not None else 1
    pools = calibrate.read_busy_trace(traces, cpus)
    free_runs = trace_runs.runs_with_a_free_cpu(pools, cpus)
    rows = [row for rows in pools.values() for row in rows]
    first = min((float(row["t_s"]) for row in rows), default=0.0)
    traced = []
    for row in rows:
        pool, seconds, busy = str(row["pool"]), float(row["seconds"]), float(row["busy"])
        if pool not in profile.steps and not (pool == "colocated" and "decode" in profile.steps):
            continue
        alone = profile.step_time(pool)
        beside = profile.busy_step_time(pool) or alone
        step = calibrate.read_step(row)
        fitted = alone.seconds(step) * (1 - busy) + beside.seconds(step) * busy
        if fitted > 0 and seconds > 0:
            # Against the fit's own median there (its spread bands): the fit is of the relative
            # error, and its steps' median ratio is 0.96-1.02 by band, not 1. The profile's own
            # traces read x1.000 so.
            kind = "decode" if step.prefill_tokens == 0 else "mixed" if step.decode_streams else "prompt"
            if kind == "prompt" and isinstance(alone, LinearStep) and alone.passes is not None:
                kind = "prompt" if alone.passes.on_stream(step) else "gemm"
            free_cpu = row["trace"] in free_runs  # its steps spread as such a run's (`free_spread`)
            expected = fitted * _spread_median(alone, fitted, kind == "mixed", free_cpu)
            traced.append(TracedStep(pool, float(row["t_s"]) - first, seconds, expected, kind))
    return traced


def trace_speed(profile: Profile, traces: list[Path]) -> TraceSpeed:
    """How much longer than `profile`'s served fit the steps of a served run took: the median of
    its decode-only steps (of every step where fewer than MIN_PAIRS are: the factor that scales
    the rest of the profile too), of its prompt-only steps and of its mixed steps (`traced_steps`;
    a kind with fewer than MIN_KIND_STEPS steps runs at the first), of its prompt-only steps on the
    GEMM (`gemm`), and the same for each pool from its own steps (`pools`: a kind a pool has too
    few of at the run's, `_speed_of`). The served steps' speed while
    they ran, from thousands of steps rather than a check's seconds; the steps only (the loop, the
    router's CPU and the pulls may have moved otherwise). By kind because the host moves them
    apart: in one hour a DPD run's decode-only steps ran at 0.958 of the fit, its decode worker's
    mixed steps at 0.997 and its prompts at 0.874-0.905; scaled by the run's median (0.963) and
    the prompts', the mixed steps, 40% of the tokens, came 6% fast and ITL p50 -10%."""
    steps = traced_steps(profile, traces)
    if len(steps) < MIN_PAIRS:
        raise ProfileError(
            f"the step trace has {len(steps)} steps of the profile's roles (at least {MIN_PAIRS}): no factor"
        )
    run, counts = _speed_of(steps, None)
    pools = {
        pool: _speed_of([s for s in steps if s.pool == pool], run)[0]
        for pool in sorted({s.pool for s in steps})
    }
    return TraceSpeed(run.factor, run.prompt, run.mixed, run.gemm, len(steps), *counts, pools)


def _speed_of(steps: list[TracedStep], run: PoolSpeed | None) -> tuple[PoolSpeed, tuple[int, int, int]]:
    """The steps' speed by kind (the run's where `run` is None; else one pool's, a kind with too
    few of its steps at the run's), and (prompt, mixed, gemm) steps counted. Too few GEMM steps for
    a factor of their own count with the other prompts where those then have their own; where the
    prompts too are the run's, the GEMM's is the run's as well."""
    by_kind = {
        kind: [s.ratio for s in steps if s.kind == kind] for kind in ("decode", "prompt", "mixed", "gemm")
    }
    gemm_fallback = None
    if len(by_kind["gemm"]) < MIN_KIND_STEPS:
        if run is None or len(by_kind["prompt"]) + len(by_kind["gemm"]) >= MIN_KIND_STEPS:
            by_kind["prompt"] += by_kind.pop("gemm")  # with the other prompts, at their factor
            by_kind["gemm"] = []
        else:
            gemm_fallback = run.gemm

    def median(kind: str, fallback: float | None) -> float | None:
        return statistics.median(by_kind[kind]) if len(by_kind[kind]) >= MIN_KIND_STEPS else fallback

    if len(by_kind["decode"]) >= MIN_PAIRS:
        factor = statistics.median(by_kind["decode"])
    else:
        factor = statistics.median(s.ratio for s in steps) if run is None else run.factor
    speed = PoolSpeed(
        factor,
        median("prompt", None if run is None else run.prompt),
        median("mixed", None if run is None else run.mixed),
        median("gemm", gemm_fallback),
        len(steps),
    )
    return speed, (len(by_kind["prompt"]), len(by_kind["mixed"]), len(by_kind["gemm"]))


def speed_course(profile: Profile, traces: list[Path], window_s: float) -> SpeedCourse:
    """The host's speed over the run, window by window (SpeedCourse). One run's trace: another
    run's clock is not this one's. Each step against its kind's pace over the whole run (the
    simulation runs each kind at its own: `trace_speed`), so that a window busy with prompts reads
    the host, not its mix."""
    if not window_s >= MIN_WINDOW_S:
        raise ProfileError(f"a speed window must be at least {MIN_WINDOW_S:g} s (got {window_s})")
    if len(traces) != 1:
        raise ProfileError("the speed over time replays one run: give one step trace with a window")
    steps = traced_steps(profile, traces)
    factors: dict[str, tuple[float, ...]] = {}
    for pool in sorted({step.pool for step in steps}):
        mine = [step for step in steps if step.pool == pool]
        if sum(step.kind == "gemm" for step in mine) < MIN_KIND_STEPS:  # as trace_speed reads them
            mine = [replace(step, kind="prompt") if step.kind == "gemm" else step for step in mine]
        pace = {}  # each kind's measured over fitted over the whole run
        for kind in {s.kind for s in mine}:
            of_kind = [s for s in mine if s.kind == kind]
            pace[kind] = sum(s.seconds for s in of_kind) / sum(s.expected for s in of_kind)
        count = int(max(s.t_s for s in mine) // window_s) + 1
        windows: list[list[TracedStep]] = [[] for _ in range(count)]
        for step in mine:
            windows[int(step.t_s // window_s)].append(step)
        factors[pool] = tuple(
            sum(s.seconds for s in w) / sum(s.expected * pace[s.kind] for s in w)
            if len(w) >= MIN_WINDOW_STEPS
            else 1.0
            for w in windows
        )
    return SpeedCourse(window_s, factors)


def _spread_median(step_time: StepTime, fitted: float, mixed: bool, free_cpu: bool) -> float:
    quantiles = step_time.spread_at(fitted, mixed, free_cpu) if isinstance(step_time, LinearStep) else ()
    return statistics.median(quantiles) if quantiles else 1.0
