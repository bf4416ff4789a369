"""A host's speed now against when its profile was measured: a speed check, and a profile scaled by it.

A shared machine's speed moves: on a 2-vCPU cloud host the same served decode steps were timed
24-35% apart by two profiles 25 minutes apart (docs/performance.md), more than a simulation's
own error. A full profile takes 10-20 minutes; a speed check takes seconds. `pdserve profile`
runs the check (a fixed, small plan of the engine's steps: `pdserve.measure.steps.speed_check`)
right after its sweep, as `pdserve profile --speed-check` runs it alone (a process of its own, a
fresh engine: on the sweep's own engine the same steps took 13-18% longer), and keeps it in the
profile (`meta.speed_check`). `pdserve sim` and `pdserve plan` with `--speed-check FILE` pair the two checks' steps,
take the median of now / then as the host's speed factor, and scale every time the profile
measured by it (steps, the worker loop, pulls, the serving overhead, the router's and client's
CPU, a worker's start): one number, said with the run, and the prompt work by a second where
the check's prompt-only steps say it (`prompt_factor`): a host's prompt work and its decode steps
need not slow alike. A served run's step trace says the same of that run (pdserve/sim/trace_speed.py).

Pure Python: the simulator and planner import it; only the measuring side runs the engine.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

from pdserve.costmodel import Step
from pdserve.sim.profile import HostCpu, Overhead, Profile, ServedPull, TransferTime
from pdserve.sim.step_time import LinearStep, ProfileError, Spread, StepTime

_Timed = TypeVar("_Timed", Overhead, HostCpu)

FORMAT = "pdserve-speed-check/1"
PLAN = "check-1"  # the steps the check runs (pdserve.measure.steps.speed_check): a new plan, a new name
MIN_PAIRS = 8  # steps both checks ran, at least, for a factor
MIN_PROMPT_STEPS = 3  # prompt-only steps both ran, at least, for the prompt work's own factor


@dataclass(frozen=True)
class SpeedCheck:
    """What the check's steps took on one engine: each step of the plan and its median seconds."""

    model: str
    device: str
    dtype: str
    threads: int
    steps: tuple[tuple[Step, float], ...]
    date: str = ""
    machine: str = ""
    plan: str = PLAN

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "plan": self.plan,
            "model": self.model,
            "device": self.device,
            "dtype": self.dtype,
            "threads": self.threads,
            "date": self.date,
            "machine": self.machine,
            # (prompt tokens, prompt attention, decode streams, decode context, seconds)
            "steps": [
                [s.prefill_tokens, s.prefill_attention, s.decode_streams, s.decode_context, seconds]
                for s, seconds in self.steps
            ],
        }

    @classmethod
    def from_json(cls, body: Any, where: str) -> SpeedCheck:
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            raise ProfileError(
                f"{where}: not a speed check (format {FORMAT}, from `pdserve profile --speed-check`)"
            )
        try:
            steps = tuple(
                (Step(int(a), int(b), int(c), int(d)), float(seconds))
                for a, b, c, d, seconds in body["steps"]
            )
            check = cls(
                model=str(body["model"]),
                device=str(body["device"]),
                dtype=str(body["dtype"]),
                threads=int(body["threads"]),
                steps=steps,
                date=str(body.get("date", "")),
                machine=str(body.get("machine", "")),
                plan=str(body["plan"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ProfileError(f"{where}: a malformed speed check ({exc})") from None
        if not all(seconds > 0 for _, seconds in steps):
            raise ProfileError(f"{where}: a speed check's step times must be > 0")
        return check

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n")


def load(path: Path) -> SpeedCheck:
    try:
        body = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ProfileError(f"cannot read the speed check {path}: {exc}") from None
    return SpeedCheck.from_json(body, str(path))


def reference(profile: Profile, where: str) -> SpeedCheck:
    """The check run when `profile` was measured."""
    body = profile.meta.get("speed_check")
    if body is None:
        raise ProfileError(
            f"{where} has no speed check (profiles measured before it was added, and rooflines, have "
            "none): measure the profile again with `pdserve profile` to scale it by --speed-check"
        )
    return SpeedCheck.from_json(body, f"{where} (meta.speed_check)")


def speed_factor(then: SpeedCheck, now: SpeedCheck) -> tuple[float, int]:
    """(the median of now / then over the steps both checks ran, how many steps that is). Refused
    for checks of another model, device, dtype, thread count or plan: those are not the same steps."""
    for field in ("plan", "model", "device", "dtype", "threads"):
        if getattr(then, field) != getattr(now, field):
            raise ProfileError(
                f"the speed check ran {field} {getattr(now, field)!r}, the profile's check "
                f"{getattr(then, field)!r}: run the check as the profile was measured"
            )
    before = dict(then.steps)
    ratios = [seconds / before[step] for step, seconds in now.steps if step in before]
    if len(ratios) < MIN_PAIRS:
        raise ProfileError(
            f"the speed check and the profile's have {len(ratios)} steps in common (at least {MIN_PAIRS} needed)"
        )
    return statistics.median(ratios), len(ratios)


def prompt_factor(then: SpeedCheck, now: SpeedCheck) -> float | None:
    """The median of now / then over the check's prompt-only steps (None: fewer than
    MIN_PROMPT_STEPS of them in common). A host's prompt work and its decode steps need not slow
    alike: on the AVX512 EPYC, every check of one hour read the prompt steps 5-11% faster than the
    decode steps (x1.01 against x1.10), which the whole check's median (39 of its 46 steps decode)
    does not say; a served trace of that hour agreed (its mixed steps x1.07, decode x1.18)."""
    if (then.plan, then.model, then.device, then.dtype, then.threads) != (
        now.plan,
        now.model,
        now.device,
        now.dtype,
        now.threads,
    ):
        return None  # speed_factor says why
    before = dict(then.steps)
    ratios = [
        seconds / before[step]
        for step, seconds in now.steps
        if step in before and step.prefill_tokens > 0 and step.decode_streams == 0
    ]
    return statistics.median(ratios) if len(ratios) >= MIN_PROMPT_STEPS else None


def combined_factor(factors: list[float]) -> float:
    """Several checks' factors as one: their median, taken on the logarithms (x2 and x0.5 make x1;
    two checks make their geometric mean). A check samples a few seconds; on a shared 2-vCPU host
    checks half a minute apart read x1.03 and x1.28, six back to back x1.24-1.49, and one of five
    between rates x1.60 where the rest read x1.02-1.18 (docs/performance.md): more checks over the
    time measured are steadier than the one nearest it, and their median does not follow one
    caught in a stall."""
    if not factors or not all(f > 0 for f in factors):
        raise ProfileError(f"speed factors must be > 0, at least one (got {factors})")
    return math.exp(statistics.median(math.log(f) for f in factors))


# A pool role's own (factor, prompt, mixed, gemm), as `scaled` takes them
RoleKinds = tuple[float, float | None, float | None, float | None]


def scaled(
    profile: Profile,
    factor: float,
    prompt: float | None = None,
    mixed: float | None = None,
    gemm: float | None = None,
    by_role: dict[str, RoleKinds] | None = None,
) -> Profile:
    """Every time `profile` measured, times `factor` (a slower host: > 1); with `prompt`
    (prompt_factor), the time a step's prompt work takes times that instead (a prompt-only step's
    whole time; in a step beside decode streams, what its prompt adds to theirs); with `mixed` (a
    served trace's, pdserve/sim/trace_speed.py), a step of prompt tokens beside decode streams
    times that as a whole; with `gemm` (a served trace's too), the prompt work of a step whose rows
    run on the GEMM, past the stream GEMV, times that instead of `prompt`. `by_role`: a pool role's
    step times by kinds of its own instead (a served trace's pools, each read apart), the rest of
    the profile by the others. Ratios (how steps spread around their fit) and counts stay; a
    roofline's steps are not a host's and are refused."""
    own = by_role or {}
    for f, *others in [(factor, prompt, mixed, gemm), *own.values()]:
        if not f > 0 or not all(o is None or o > 0 for o in others):
            raise ProfileError(f"a speed factor must be > 0 (got {f}; prompt, mixed, gemm {others})")
    host = profile.host
    measured, prompt = prompt, factor if prompt is None else prompt
    kinds = (factor, prompt, mixed, gemm)
    steps: dict[str, StepTime] = {role: _step(step, *kinds) for role, step in profile.steps.items()}
    steps_busy: dict[str, StepTime] = {role: _step(step, *kinds) for role, step in profile.steps_busy.items()}
    for role, (f, p, m, g) in own.items():
        # A colocated pool without a fit of its own steps by the decode pool's (Profile.step_time):
        # with kinds of its own, it gets a copy.
        steps[role] = _step(profile.step_time(role), f, f if p is None else p, m, g)
        busy = profile.busy_step_time(role)
        if busy is not None:
            steps_busy[role] = _step(busy, f, f if p is None else p, m, g)
    return replace(
        profile,
        steps=steps,
        steps_busy=steps_busy,
        transfers={name: _transfer(t, factor) for name, t in profile.transfers.items()},
        overhead=_times(profile.overhead, factor),
        start_s=profile.start_s * factor,
        start_busy_s=profile.start_busy_s * factor,
        host=None if host is None else _times(host, factor, keep=("cpus",)),
        loops={role: loop.scaled(factor) for role, loop in profile.loops.items()},
        free_loops={role: loop.scaled(factor) for role, loop in profile.free_loops.items()},
        pulls={role: _pull(pull, factor) for role, pull in profile.pulls.items()},
        meta=profile.meta
        | {
            "speed_factor": round(factor, 4),
            "speed_factor_prompt": None if measured is None else round(measured, 4),
            "speed_factor_mixed": None if mixed is None else round(mixed, 4),
            "speed_factor_gemm": None if gemm is None else round(gemm, 4),
        }
        | {
            # None without: a profile scaled again, or saved and loaded, keeps no stale entry
            "speed_factors_by_role": {
                role: [None if k is None else round(k, 4) for k in ks] for role, ks in own.items()
            }
            or None
        },
    )


def _times(item: _Timed, factor: float, keep: tuple[str, ...] = ()) -> _Timed:
    """Each field of `item` (all times, or CPU-seconds a second) times `factor`, but those in `keep`."""
    return replace(
        item, **{name: factor * getattr(item, name) for name in item.__dataclass_fields__ if name not in keep}
    )


def _scaled_bands(bands: tuple[Spread, ...], factor: float) -> tuple[Spread, ...]:
    """Spread bands of steps `factor` times as long: their ends move, their ratios stay."""
    return tuple(
        Spread(None if band.below_s is None else band.below_s * factor, band.quantiles) for band in bands
    )


def _step(
    step: StepTime, factor: float, prompt: float, mixed: float | None = None, gemm: float | None = None
) -> LinearStep:
    if not isinstance(step, LinearStep):
        raise ProfileError(
            "a roofline's step times are not measured on a host: a speed check cannot scale them"
        )
    return replace(
        step,
        coefficients=tuple(c * factor for c in step.coefficients),  # type: ignore[arg-type]
        pass_coefficients=tuple(c * factor for c in step.pass_coefficients),  # type: ignore[arg-type]
        spread=_scaled_bands(step.spread, factor),
        free_spread=_scaled_bands(step.free_spread, factor),
        # The check timed whole prompt-only steps (on a CPU with the stream GEMV, short prompts run
        # on its passes, not on the line's per-token term): their time against the rest's.
        prompt_scale=step.prompt_scale * prompt / factor,
        # Set by a trace's mixed steps (against this factor), kept through a scaling on top.
        mixed_scale=step.mixed_scale if mixed is None else (step.mixed_scale or 1.0) * mixed / factor,
        # Set by a trace's prompt steps on the GEMM; a check on top moves them with the rest of
        # the prompt work.
        gemm_prompt_scale=(
            (step.gemm_prompt_scale or step.prompt_scale) * gemm / factor
            if gemm is not None
            else None
            if step.gemm_prompt_scale is None
            else step.gemm_prompt_scale * prompt / factor
        ),
    )


def _transfer(t: TransferTime, factor: float) -> TransferTime:
    return TransferTime(t.base_s * factor, t.per_block_s * factor, [(b, s * factor) for b, s in t.samples])


def _pull(pull: ServedPull, factor: float) -> ServedPull:
    def scale(t: TransferTime | None) -> TransferTime | None:
        return None if t is None else _transfer(t, factor)

    return replace(
        pull,
        alone=_transfer(pull.alone, factor),
        busy=_transfer(pull.busy, factor),
        copy_alone=scale(pull.copy_alone),
        copy_busy=scale(pull.copy_busy),
    )
