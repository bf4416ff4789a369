"""A profile's step times fitted to a served run's own steps (`pdserve profile --from-trace`). No
torch.

A sweep times one engine alone on a quiet CPU; a server's steps run beside the router, the other
workers, the client of a benchmark and their memory traffic, and between two steps its worker loop
sends tokens and handles messages. On a small shared host that moves a step's time by 10-30%,
more than any fit's error, and by how much depends on the load. `pdserve serve --step-trace FILE`
writes every worker's steps as its load reports bring them (router.recorder.STEP_TRACE_KEYS);
this fits each pool role's step time to the steps that pool's workers ran, and each role's worker
loop time around a step (per step and per stream, and each stream count's own where the trace
ran it often: loop_fit.py; its waits on KV pulls left out) and, where
the trace says what they moved, its waits on KV pulls (per pull and per block, as the steps,
alone and beside busy neighbours), into a copy of a base profile (its KV transfers, start time,
blocks and overhead are kept). Each step is fitted as alone x (1 - b) + beside busy neighbours x b,
b how busy the other workers were while it ran (read from the trace as the simulation reckons
it), so the fit keeps how the steps move as the load rises; how they spread around it is kept too
(spread_fit.py), apart for runs that left a CPU free of workers, as is their worker loop
(`set_free_runs_apart`: the fit is of the runs that filled the host). The result says `steps_from: serving`: the simulation then adds the
neighbours' term and no stretch for the router's and the client's CPU (that is in the fit, at the
loads the trace covered: trace a load that climbs past the knee, as `pdserve profile --served` does).
"""

from __future__ import annotations

import bisect
import datetime
import json
import statistics
from collections import defaultdict
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from pdserve import slo
from pdserve.costmodel import Step
from pdserve.router.recorder import STEP_TRACE_KEYS
from pdserve.sim.loop_fit import fit_loop, loop_note
from pdserve.sim.profile import LoopTime, Profile, ServedPull, TransferTime
from pdserve.sim.spread_fit import MIN_STEPS, spread_p90, spreads
from pdserve.sim.step_time import LinearStep, ProfileError, StreamPasses, line_features
from pdserve.sim.trace_runs import against_the_check, by_run, runs_with_a_free_cpu

OPTIONAL_KEYS = (
    "pull_wait_seconds",
    "pull_blocks",
    "pull_seconds",
)  # traces from before they were traced lack them
MIN_PULL_STEPS = 20  # steps that waited on pulls, for a role's served pull wait to be fitted
FREE_RUNS = "of runs with a CPU free of workers"  # said of what such runs alone fitted
SERVED_TRANSPORT = "shm"  # what a step trace's pulls went over: `pdserve serve`'s default on one host
PROMPT_CHUNK_TOKENS = 128  # a step with this many prompt tokens or more computes a prompt's chunk


def read_trace(paths: list[Path]) -> dict[str, list[dict[str, Any]]]:
    """Each pool's steps, from one or more step traces (JSON lines)."""
    pools: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for index, path in enumerate(paths):
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise ProfileError(f"cannot read the step trace {path}: {exc.strerror or exc}") from None
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                missing = [key for key in STEP_TRACE_KEYS if key not in row and key not in OPTIONAL_KEYS]
                if missing:
                    raise ValueError(f"no {', '.join(missing)}")
                float(row["seconds"]), float(row["t_s"]), read_step(row)
                row["trace"] = index  # one run's workers share a host; another run's did not
                pools[str(row["pool"])].append(row)
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise ProfileError(
                    f"{path}:{number} is not a step trace line (pdserve serve --step-trace): {exc}"
                ) from None
    return dict(pools)


def read_step(row: dict[str, Any]) -> Step:
    """What a step trace's row computed."""
    return Step(
        int(row["prefill_tokens"]),
        int(row["prefill_attention"]),
        int(row["decode_streams"]),
        int(row["decode_context"]),
    )


def others_busy(rows: list[dict[str, Any]], cpus: int) -> list[float]:
    """For each step, how busy the host's other CPUs were with other workers' steps while it ran
    (0 to 1), as the simulation's `HostLoad.others_busy` reckons it for a step about to run. A
    step ran from its report's time less its own seconds to its report (a report follows its
    steps within 0.1 s): a decode step inside a prompt step of seconds ran beside it, however
    long before it began."""
    spans = sorted(
        (float(row["t_s"]) - float(row["seconds"]), float(row["t_s"]), str(row["worker"])) for row in rows
    )
    starts = [start for start, _, _ in spans]
    longest = max((end - start for start, end, _ in spans), default=0.0)
    busy = []
    for row in rows:
        end, worker = float(row["t_s"]), str(row["worker"])
        start = end - float(row["seconds"])
        if end <= start:
            busy.append(0.0)
            continue
        first, last = bisect.bisect_left(starts, start - longest), bisect.bisect_left(starts, end)
        beside = sum(
            max(0.0, min(end, other_end) - max(start, other_start))
            for other_start, other_end, other in spans[first:last]
            if other != worker
        )
        busy.append(min(1.0, beside / (end - start) / max(1, cpus - 1)))
    return busy


def _both_sides(flags: list[int]) -> bool:
    """Whether MIN_STEPS steps or more ran a GEMM's step and as many did not: a term that every
    step (or none) shows is the line's base, not a step of its own. An AMX Xeon runs the logits
    on a GEMM at every stream count (`logits_rows` 0): its decode pool's steps all showed that
    term, and a free fit split their base between the two at random (20.7 of 31.9 ms on the
    term), so that a prompt alone on a decode worker would have stepped 20 ms short."""
    shown = sum(1 for flag in flags if flag)
    return shown >= MIN_STEPS and len(flags) - shown >= MIN_STEPS


def fit_alone_and_busy(
    samples: list[tuple[Step, float, float]],
    prompt_from: tuple[LinearStep, LinearStep] | None = None,
    passes: StreamPasses | None = None,
    attention_per_token: float | None = None,
    context_from: tuple[LinearStep, LinearStep] | None = None,
) -> tuple[LinearStep, LinearStep]:
    """(alone, busy): seconds = alone(x) x (1 - b) + busy(x) x b, b how busy the other CPUs were,
    fitted on the relative error with every coefficient of alone and of busy >= 0 (the form
    `pdserve.sim.cluster` steps by, with `Profile.steps_busy`). Neither is bound to be the larger:
    whether a step beside idle CPUs runs faster is the trace's to say (a host's idle cores may
    clock or be scheduled otherwise), not the form's.
    `prompt_from`: another role's (alone, busy) fit whose prompt coefficients (per prompt token,
    per token attended) are taken as they are, the rest fitted around them. `attention_per_token`:
    the prompt's cost per token attended over its cost per token (c2 / c1), as the sweep measured
    it on chunks of every length: the fit then scales that shape, and does not split it. Served
    steps hardly tell the two apart (a colocated worker's later chunks, the dear ones, ran beside
    whatever else ran), and a free fit set the colocated role's cost per token attended to 0, its
    long prompts' later chunks as cheap as their first. `passes`: the engine's stream GEMV, whose
    terms (`StreamPasses.features`) are fitted too, alike alone and beside busy neighbours, each
    where MIN_STEPS steps or more show it and as many do not (with fewer steps on the GEMV, the
    line alone).
    `context_from`: another role's (alone, busy) fit whose cost per token of a decode stream's
    context (c4) is taken as it is (`calibrated` says when)."""
    given = [1, 2] if prompt_from is not None else []
    shaped = attention_per_token is not None and prompt_from is None
    ratio = attention_per_token if shaped and attention_per_token is not None else 0.0
    kernels = [passes.features(step) for step, _, _ in samples] if passes is not None else []
    if passes is not None and sum(1 for step, _, _ in samples if passes.on_stream(step)) < MIN_STEPS:
        passes, kernels = None, []  # too few steps on the GEMV to tell its passes from the line
    known = np.zeros(13 if passes is not None else 10)
    if prompt_from is not None:
        alone_c, busy_c = prompt_from[0].coefficients, prompt_from[1].coefficients
        for i in given:
            known[i], known[i + 5] = alone_c[i], busy_c[i]
    given_context = context_from is not None
    if context_from is not None:
        known[4], known[9] = context_from[0].coefficients[4], context_from[1].coefficients[4]
    rows = []
    for index, (step, seconds, b) in enumerate(samples):
        x = np.array(line_features(step, passes), dtype=float) / seconds
        if shaped:  # one prompt term: per token plus its attention at the sweep's ratio
            x[1], x[2] = x[1] + ratio * x[2], 0.0
        kernel = np.array(kernels[index] if kernels else (), dtype=float) / seconds
        rows.append(np.concatenate([x * (1 - b), x * b, kernel]))
    a = np.array(rows)
    target = np.ones(len(rows)) - a @ known  # what the given coefficients leave to explain
    scale = np.abs(a).max(axis=0)  # columns of like size, for the solver; a column of zeros stays 0
    scale[scale == 0] = 1.0
    a = a / scale
    active = [
        i
        for i in range(10)
        if i % 5 not in given and not (shaped and i % 5 == 2) and not (given_context and i % 5 == 4)
    ]
    if passes is not None:  # the GEMMs' steps where the steps show them and steps without
        active.append(10)
        active += [11] if _both_sides([layers for _, layers, _ in kernels]) else []
        active += [12] if _both_sides([logits for _, _, logits in kernels]) else []
    coef = _nonnegative_fit(a, target, active)
    if coef is None:
        raise ProfileError("the served steps fit no step time with non-negative coefficients")
    c = [float(x) for x in coef / scale + known]
    if shaped:
        c[2], c[7] = ratio * c[1], ratio * c[6]
    pass_coefficients = (c[10], c[11], c[12]) if passes is not None else (0.0, 0.0, 0.0)
    alone = LinearStep((c[0], c[1], c[2], c[3], c[4]), passes=passes, pass_coefficients=pass_coefficients)
    busy = LinearStep((c[5], c[6], c[7], c[8], c[9]), passes=passes, pass_coefficients=pass_coefficients)
    spread, mixed_spread, errors = spreads(alone, busy, samples)
    return (
        replace(
            alone,
            samples=len(samples),
            median_error=round(slo.quantile(errors, 0.5) or 0.0, 4),
            p90_error=round(slo.quantile(errors, 0.9) or 0.0, 4),
            spread=spread,
            mixed_spread=mixed_spread,
        ),
        replace(busy, samples=len(samples)),
    )


def _nonnegative_fit(a: np.ndarray, target: np.ndarray, active: list[int]) -> np.ndarray | None:
    """Least squares with every coefficient >= 0, over the columns `active` (the rest 0), by an
    active set: the most negative dropped and the rest refitted. None: no column is left."""
    active = list(active)
    while active:
        coef = np.zeros(a.shape[1])
        solution, *_ = np.linalg.lstsq(a[:, active], target, rcond=None)
        coef[active] = solution
        negative = [i for i in active if coef[i] < 0]
        if not negative:
            return coef
        active.remove(min(negative, key=lambda i: coef[i]))
    return None


def fit_pull(
    rows: list[dict[str, Any]], key: str = "pull_wait_seconds", relative: bool = False
) -> tuple[TransferTime, TransferTime, int] | None:
    """(alone, busy, steps) of a served pull's wait (`key`: or of its copy, `pull_seconds`):
    seconds = alone(n) + (busy(n) - alone(n)) x b for a step whose loop waited on pulls of n blocks
    (`pull_blocks`), b how busy the other workers were (`busy`), each coefficient >= 0. The wait:
    least squares on the seconds, so that the fit keeps the waits' mean (their right tail, a few
    waits of 20-50 ms, is time the streams lose). The copy: `relative`, on the relative error, as
    each pull's own time is a request's transfer part, a 2-block chat prompt's as much as a
    document's. None: fewer than MIN_PULL_STEPS such steps (or a trace from before the pulls'
    blocks were traced)."""
    waits = [
        (int(r["pull_blocks"]), float(r[key]), float(r["busy"]))
        for r in rows
        if int(r.get("pull_blocks", 0)) > 0 and float(r.get(key, 0.0)) > 0
    ]
    if len(waits) < MIN_PULL_STEPS:
        return None
    a = np.array([(1.0, n, b, n * b) for n, _, b in waits])
    target = np.array([t for _, t, _ in waits])
    if relative:  # each row over its own seconds
        a, target = a / target[:, None], np.ones(len(waits))
    scale = np.abs(a).max(axis=0)
    scale[scale == 0] = 1.0
    coef = _nonnegative_fit(a / scale, target, [0, 1, 2, 3])
    if coef is None:
        return None
    base, per_block, busy_base, busy_block = (float(x) for x in coef / scale)
    alone = TransferTime(round(base, 7), round(per_block, 8))
    busy = TransferTime(round(base + busy_base, 7), round(per_block + busy_block, 8))
    return alone, busy, len(waits)


def stream_passes(profile: Profile) -> StreamPasses | None:
    """The engine's stream GEMV as the profile's measurement recorded it (meta `stream_passes`,
    `pdserve profile` on a CPU); None: not recorded (a GPU's, a roofline's, an older profile)."""
    body = profile.meta.get("stream_passes")
    return StreamPasses.from_json(body, "meta.stream_passes") if body is not None else None


def attention_ratio(base: Profile, role: str) -> float | None:
    """A prompt's cost per token attended over its cost per token (c2 / c1) in `base`'s step time
    for `role` (the decode role's for colocated, as the sweep measures one engine for both), where
    `base` is a sweep's (`steps_from: alone`: steps timed on chunks of every length and context,
    which tell the two apart); None otherwise."""
    if base.steps_from != "alone":
        return None
    step = base.steps.get(role) or (base.steps.get("decode") if role == "colocated" else None)
    if not isinstance(step, LinearStep) or step.coefficients[1] <= 0 or step.coefficients[2] <= 0:
        return None
    return step.coefficients[2] / step.coefficients[1]


def read_busy_trace(traces: list[Path], cpus: int) -> dict[str, list[dict[str, Any]]]:
    """`read_trace`, each row with `busy`: how busy the other workers of its run were while it ran
    (`others_busy`, as the fit and the simulation reckon it)."""
    pools = read_trace(traces)
    for rows in by_run(pools):
        for row, busy in zip(rows, others_busy(rows, cpus), strict=True):
            row["busy"] = busy
    return pools


def set_free_runs_apart(
    pools: dict[str, list[dict[str, Any]]], cpus: int, notes: list[str]
) -> dict[str, list[dict[str, Any]]]:
    """Takes out of `pools` the steps of runs that left a CPU free of workers (fewer workers than
    the host's CPUs: the router and the client ran there, not between the workers' steps), for
    each role that keeps MIN_STEPS timed steps of runs that did not; returns them by role. A
    host's steps spread otherwise with a CPU to spare (`LinearStep.free_spread`), and the fit is
    of the runs that fill it: on two CPUs, 1P+1D and colocated 2 (`pdserve profile --served`
    traces a colocated 1 beside them there). A run's workers are the workers its trace names (a
    run the planner scaled counts as the most it had). A role with fewer such steps keeps its free
    runs' steps in its fit, and its one spread is then theirs or partly theirs (said in `notes`)."""
    free_runs = runs_with_a_free_cpu(pools, cpus)
    apart = {}
    for role, rows in pools.items():
        filled = [row for row in rows if row["trace"] not in free_runs]
        if len(filled) == len(rows):
            continue
        if len(timed_steps(filled)) >= MIN_STEPS:
            apart[role] = [row for row in rows if row["trace"] in free_runs]
            pools[role] = filled
        else:
            notes.append(
                f"{role} steps: {len(timed_steps(filled))} of runs whose workers filled the host's {cpus} CPUs "
                f"(< {MIN_STEPS}): fitted with those of runs that left one free, and spread and loop as they "
                "did, for every deployment"
            )
    return apart


def _loop_of(role: str, rows: list[dict[str, Any]]) -> LoopTime:
    """The role's worker loop in these rows."""
    if role == "prefill":  # a prompt step's loop: its first tokens out, the next prompts in
        return LoopTime(round(statistics.median(float(r.get("loop_seconds", 0.0)) for r in rows), 6))
    return fit_loop(rows)


def timed_steps(rows: list[dict[str, Any]]) -> list[tuple[Step, float, float]]:
    """(step, seconds, how busy the others were) of each traced step that took time."""
    return [(read_step(r), float(r["seconds"]), float(r["busy"])) for r in rows if float(r["seconds"]) > 0]


def calibrated(base: Profile, traces: list[Path]) -> Profile:
    """`base` with each traced pool role's step time (alone, and beside busy neighbours), and its
    worker loop's time, fitted to the traces (the runs that filled the host's CPUs, where there
    are such; the steps of runs that left one free spread around the fit on their own, and their
    worker loop is their own: `free_spread`, `free_loops`)."""
    cpus = base.host.cpus if base.host is not None else 1
    pools = read_busy_trace(traces, cpus)
    notes = against_the_check(base, pools, traces)
    free_rows = set_free_runs_apart(pools, cpus, notes)
    steps: dict[str, LinearStep] = {}
    steps_busy: dict[str, LinearStep] = {}
    passes = stream_passes(base)
    timed_by_role = {role: timed_steps(rows) for role, rows in pools.items()}

    def prompt_steps(role: str) -> int:
        return sum(1 for step, _, _ in timed_by_role[role] if step.prefill_tokens >= PROMPT_CHUNK_TOKENS)

    # Roles that ran real prompt chunks first: a role that did not (a decode pool computes only a
    # pulled prompt's last partial block) takes its prompt coefficients from one that did (on a
    # CPU every role runs the same kernels), rather than stretching a few-token line to a chunk.
    for role in sorted(pools, key=lambda r: (prompt_steps(r) < MIN_STEPS, r)):
        timed = timed_by_role[role]
        if len(timed) < MIN_STEPS:
            notes.append(f"the {role} pool ran {len(timed)} steps in the trace (< {MIN_STEPS}): not fitted")
            continue
        donor = None
        if prompt_steps(role) < MIN_STEPS:
            donor = next(
                (d for d in ("colocated", "prefill") if d in steps and prompt_steps(d) >= MIN_STEPS), None
            )
        if donor is not None:
            notes.append(
                f"{role} steps: the {donor} pool's cost per prompt token (the {role} pool ran "
                f"{prompt_steps(role)} steps of {PROMPT_CHUNK_TOKENS} prompt tokens or more)"
            )
        ratio = attention_ratio(base, role) if donor is None else None
        if ratio is not None:
            notes.append(
                f"{role} steps: a prompt's cost per token attended at the sweep's {ratio:.3g} of its "
                "cost per token (the served steps scale it, not split it)"
            )
        steps[role], steps_busy[role] = fit_alone_and_busy(
            timed, (steps[donor], steps_busy[donor]) if donor is not None else None, passes, ratio
        )
        if passes is not None and steps[role].passes is None:
            notes.append(
                f"{role} steps: one line (fewer than {MIN_STEPS} of them within the stream GEMV's "
                f"{passes.stream_rows} rows to fit its passes to)"
            )
    if not steps:
        raise ProfileError(
            f"no pool ran {MIN_STEPS} steps or more in {', '.join(map(str, traces))}: nothing to fit"
        )
    context = [step.coefficients[4] for step in (steps.get("decode"), steps_busy.get("decode")) if step]
    if "colocated" in steps and len(context) == 2 and min(context) > 0:
        # A decode worker's streams read their contexts as a colocated worker's do (one kernel),
        # and its steps tell the context from the streams apart (a document's 1024 tokens beside
        # a few chats); a colocated worker's long contexts came with many streams (a mean of 5
        # at 800-1200 tokens, 36 past 3200 on the AVX512 EPYC), and a free fit there put a token
        # of context at 1.9x the decode pool's: its documents' ITL then came +20-30% at light
        # loads. The fit's own error did not move (median 8.86% either way): the trace could not
        # say. On all three hosts profiled the decode pool's came within 10% of the sweep's.
        # Its prompt cost as first fitted (the decode pool's was taken from it), the rest again.
        free = steps["colocated"].coefficients[4]
        steps["colocated"], steps_busy["colocated"] = fit_alone_and_busy(
            timed_by_role["colocated"],
            (steps["colocated"], steps_busy["colocated"]),
            passes,
            context_from=(steps["decode"], steps_busy["decode"]),
        )
        notes.append(
            f"colocated steps: the decode pool's cost per token of a stream's context "
            f"({steps['decode'].coefficients[4]:.3g} s; fitted on their own, {free:.3g} s: its long "
            "contexts came with many streams, the decode pool's apart from them)"
        )
    free_loops: dict[str, LoopTime] = {}
    for role, rows in free_rows.items():
        free_steps = timed_steps(rows)
        if role not in steps or len(free_steps) < MIN_STEPS:
            notes.append(
                f"{role} steps {FREE_RUNS}: {len(free_steps)} (< {MIN_STEPS}), "
                "left out; such a worker spreads and loops as the others"
            )
            continue
        free_spread, free_mixed, _ = spreads(steps[role], steps_busy[role], free_steps)
        steps[role] = replace(steps[role], free_spread=free_spread, free_mixed_spread=free_mixed)
        notes.append(
            f"{role} steps {FREE_RUNS} ({len(free_steps)}): their own spread around "
            f"the fit (p90 {spread_p90(free_spread):.3g} of the median, against "
            f"{spread_p90(steps[role].spread):.3g} with every CPU a worker's; the fit and the pulls are "
            "of the latter, the worker loop their own)"
        )
        # Their loop apart too: the router and the client ran on the free CPU, not on the worker's.
        loop = _loop_of(role, rows)
        if not (loop.by_streams or loop.step_s > 0 or loop.stream_s > 0):  # nothing seen: no guess of 0
            notes.append(
                f"{role} worker loop {FREE_RUNS}: not seen in their steps; such a worker loops as the others"
            )
            continue
        free_loops[role] = loop
        notes.append(
            loop_note(role, loop, FREE_RUNS)
            if loop.by_streams
            else f"{role} worker loop {FREE_RUNS}: {loop.step_s * 1000:.2f} ms + {loop.stream_s * 1000:.3f} ms a stream"
        )
    loops = {role: _loop_of(role, pools[role]) for role in steps}
    notes += [loop_note(role, loop) for role, loop in loops.items() if loop.by_streams]
    pulls = {}
    for role in steps:
        fitted = fit_pull(pools[role]) if role != "prefill" else None
        if fitted is not None:
            copy = fit_pull(pools[role], "pull_seconds", relative=True)
            pulls[role] = ServedPull(
                SERVED_TRANSPORT, *fitted, *(copy[:2] if copy is not None else (None, None))
            )
            notes.append(
                f"{role} pulls: their wait fitted to {fitted[2]} served steps that waited on pulls, "
                f"taken as over {SERVED_TRANSPORT} (pdserve serve's default on one host)"
            )
    kept = sorted(set(base.steps) - set(steps))
    if "colocated" not in steps and "decode" in steps:
        kept = [role for role in kept if role != "colocated"]  # a mixed worker steps like a decode one
        notes.append("colocated steps: the decode pool's served fit (no colocated pool in the trace)")
    for role in kept:
        notes.append(f"{role} steps: the base profile's (no {role} pool in the trace)")
    counts = ", ".join(f"{role} {len(pools[role])}" for role in sorted(steps))
    names = ", ".join(Path(t).name for t in traces)
    return replace(
        base,
        steps={**{role: base.steps[role] for role in kept}, **steps},
        steps_busy={
            **{role: base.steps_busy[role] for role in kept if role in base.steps_busy},
            **steps_busy,
        },
        steps_from="serving",
        loops=loops,
        free_loops=free_loops,
        pulls=pulls,
        meta=base.meta
        | {
            "calibrated": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "step_traces": names,
        },
        assumptions=[
            *base.assumptions,
            f"step times fitted to served steps ({counts}{', of the runs that filled the host' * bool(free_rows)}) "
            f"from {names}, alone and beside busy "
            "neighbours: the router's and the client's CPU at the loads traced is in them, so the "
            "simulation adds no stretch of its own",
            *notes,
        ],
    )
