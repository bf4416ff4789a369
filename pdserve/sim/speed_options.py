"""What `pdserve sim`'s and `pdserve plan`'s speed options say of a profile: --speed-check (speed
checks of this host, pdserve/sim/speed.py), --speed-trace (a served run's steps,
pdserve/sim/trace_speed.py), --headroom, and `pdserve sim`'s --speed-window (the traced run's speed
over time). Each reading is said on stderr. No torch."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from pdserve.errors import PdserveError
from pdserve.sim import speed
from pdserve.sim.profile import Profile
from pdserve.sim.step_time import LinearStep
from pdserve.sim.trace_speed import SpeedCourse, speed_course, trace_speed


def host_speed(args: argparse.Namespace, profile: Profile) -> tuple[Profile, SpeedCourse | None]:
    """`profile` scaled as the options say (unchanged where none is given), and with
    --speed-window the traced run's speed over time."""
    headroom = getattr(args, "headroom", 0.0)
    if not (headroom >= 0 and math.isfinite(headroom)):
        raise PdserveError(f"--headroom must be a fraction >= 0 (0.1: a host 10% slower), got {headroom}")
    if args.speed_trace is not None and args.speed_check is not None:
        raise PdserveError("--speed-trace and --speed-check both say the host's speed: give one")
    window = getattr(args, "speed_window", None)
    if window is not None and args.speed_trace is None:
        raise PdserveError("--speed-window replays a served run's speed: give its --speed-trace")
    # The steps' factor, the prompt work's own where a check says it, a trace's mixed steps' and
    # GEMM prompts' own, and a trace's each pool's own kinds (by_role)
    factor, prompt, mixed, gemm = 1.0, None, None, None
    by_role: dict[str, speed.RoleKinds] = {}
    if args.speed_check is not None:
        factor, prompt = checked_factors(profile, args.speed_check, str(args.profile))
    if args.speed_trace is not None:
        traced = trace_speed(profile, list(args.speed_trace))
        factor, prompt, mixed, gemm = traced.factor, traced.prompt, traced.mixed, traced.gemm
        print(
            f"step trace {', '.join(map(str, args.speed_trace))}: its {traced.steps} steps took "
            f"x{factor:.3f} the profile's fit (the decode steps' median)"
            + ("" if prompt is None else f", its {traced.prompt_steps} prompt-only steps x{prompt:.3f}")
            + ("" if gemm is None else f", its {traced.gemm_steps} prompt-only steps on the GEMM x{gemm:.3f}")
            + ("" if mixed is None else f", its {traced.mixed_steps} mixed steps x{mixed:.3f}")
            + "; the profile's times scaled by it, each kind of step by its own, pool by pool:",
            file=sys.stderr,
        )
        by_role = {pool: own.kinds() for pool, own in traced.pools.items()}
        for pool, own in traced.pools.items():
            print(
                f"  its {pool} pool's {own.steps} steps, each kind by the pool's own where it has "
                f"enough of them: x{own.factor:.3f}"
                + "".join(
                    f", {name} x{value:.3f}"
                    for name, value in (
                        ("prompts", own.prompt),
                        ("on the GEMM", own.gemm),
                        ("mixed", own.mixed),
                    )
                    if value is not None
                ),
                file=sys.stderr,
            )
    course = None if window is None else speed_course(profile, list(args.speed_trace), window)
    if course is not None:
        print(
            f"--speed-window {window:g}: each pool's steps, window by window, as much slower than the "
            f"run's pace as the trace's: {course.describe()}",
            file=sys.stderr,
        )
    if headroom > 0:
        if not all(isinstance(step, LinearStep) for step in profile.steps.values()):
            raise PdserveError(
                "--headroom scales measured step times, and a roofline's are derived from the hardware's "
                "data sheet: it cannot scale them"
            )
        factor, prompt, mixed, gemm = _more((factor, prompt, mixed, gemm), 1 + headroom)
        by_role = {role: _more(kinds, 1 + headroom) for role, kinds in by_role.items()}
        print(
            f"--headroom {headroom:g}: the profile's times scaled by x{1 + headroom:g} more", file=sys.stderr
        )
    if args.speed_check is not None or args.speed_trace is not None or headroom > 0:
        profile = speed.scaled(profile, factor, prompt, mixed, gemm, by_role)
    return profile, course


def _more(kinds: speed.RoleKinds, times: float) -> speed.RoleKinds:
    def more(kind: float | None) -> float | None:
        return None if kind is None else kind * times

    factor, prompt, mixed, gemm = kinds
    return factor * times, more(prompt), more(mixed), more(gemm)


def checked_factors(profile: Profile, paths: list[Path], where: str) -> tuple[float, float | None]:
    """(the steps' factor, the prompt work's) from speed checks against the profile's own, each the
    checks' median, said on stderr. The prompt work's is None where a check lacks its steps."""
    then = speed.reference(profile, where)
    factors = [speed.speed_factor(then, speed.load(path)) for path in paths]
    prompts = [speed.prompt_factor(then, speed.load(path)) for path in paths]
    factor = speed.combined_factor([f for f, _ in factors])
    known = [p for p in prompts if p is not None]
    prompt = speed.combined_factor(known) if len(known) == len(prompts) else None
    checks = ", ".join(f"{path} x{f:.3f}" for path, (f, _) in zip(paths, factors, strict=True))
    how = f"the median of {factors[0][1]} steps" if len(factors) == 1 else "the checks' median"
    print(
        f"speed check{'s' if len(factors) > 1 else ''} {checks}: this host runs the engine's steps "
        f"x{factor:.3f} as long as when the profile was measured ({then.date}; {how})"
        + ("" if prompt is None else f", its prompt work x{prompt:.3f}")
        + "; the profile's times scaled by it"
        + ("" if prompt is None else ", a step's prompt work by its own"),
        file=sys.stderr,
    )
    return factor, prompt
