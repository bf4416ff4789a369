"""How benchmarks/sim_fidelity.py reads the host's speed checks (`pdserve profile --speed-check`,
run before, between and after a config's rates) as the factors its simulations are scaled by: one
per config or per rate, and the prompt work's own against the steps'."""

from __future__ import annotations

import argparse
import itertools
import statistics
from pathlib import Path


def check_names(args: argparse.Namespace, label: str, scales: list[float]) -> list[str]:
    """The config's speed checks in the order they ran: before and after its runs, or (with
    --check-every-rate) before each rate and after the last."""
    if args.check_every_rate:
        return [f"{label}-check-{i}.json" for i in range(len(scales) + 1)]
    return [f"{label}-check-before.json", f"{label}-check-after.json"]


def check_factors(args: argparse.Namespace, folder: Path, label: str, scales: list[float]) -> list[float]:
    """Each of the config's checks as a factor against the profile's own check."""
    from pdserve.sim import profile as profiles
    from pdserve.sim import speed

    then = speed.reference(profiles.load(args.profile), str(args.profile))
    names = check_names(args, label, scales)
    return [speed.speed_factor(then, speed.load(folder / name))[0] for name in names]


def prompt_ratio(args: argparse.Namespace, folder: Path, label: str, scales: list[float]) -> float | None:
    """How much faster (< 1) or slower the config's checks read the prompt work than the steps as a
    whole: the median of their prompt-only steps' factors over the median of their factors (None:
    a check without prompt-only steps in common, or --one-speed). A rate's prompt cost is scaled by
    its factor times this, as `pdserve sim --speed-check` scales it."""
    from pdserve.sim import profile as profiles
    from pdserve.sim import speed

    if args.one_speed:
        return None
    then = speed.reference(profiles.load(args.profile), str(args.profile))
    checks = [speed.load(folder / name) for name in check_names(args, label, scales)]
    prompts = [speed.prompt_factor(then, check) for check in checks]
    if any(p is None for p in prompts):
        return None
    steps = speed.combined_factor([speed.speed_factor(then, check)[0] for check in checks])
    return speed.combined_factor([p for p in prompts if p is not None]) / steps


def rate_factors(checks: list[float], per_rate: bool, one_factor: str | None) -> list[float]:
    """The speed factors the simulation is scaled by, from the config's checks in the order they
    ran: without `per_rate`, one (the geometric mean of the checks before and after the runs);
    with it, one per rate (the mean of the two checks around it), or with `one_factor` one for
    every rate: the geometric mean of all the checks ("mean": a single check is noisy at the
    half-minute scale) or their median ("median": one check in five read x1.60 where the others
    read x1.02-1.18, and a mean follows it)."""
    if per_rate and one_factor == "median":
        from pdserve.sim import speed

        return [speed.combined_factor(checks)]
    if not per_rate or one_factor:
        return [statistics.geometric_mean(checks)]
    return [statistics.geometric_mean(pair) for pair in itertools.pairwise(checks)]
