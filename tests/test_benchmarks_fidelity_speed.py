"""benchmarks/fidelity_speed.py: the host's speed checks read as the simulation's factors, one per
rate or per config, the prompt work's own against the steps'."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from benchmark_scripts import benchmark

ROOT = Path(__file__).resolve().parents[1]


def speeds() -> ModuleType:
    return benchmark("fidelity_speed")


def options(**given: Any) -> argparse.Namespace:
    defaults = {"profile": ROOT / "profiles" / "cpu-avx2-epyc-smollm2-served.json", "check_every_rate": True}
    return argparse.Namespace(**(defaults | given))


def test_each_rate_gets_the_checks_around_it_or_one_factor_for_all() -> None:
    module = speeds()
    checks = [1.0, 1.21, 1.0]  # before the first rate, between the two, after the last
    assert module.rate_factors(checks, per_rate=True, one_factor=None) == pytest.approx([1.1, 1.1])
    assert module.rate_factors([1.0, 4.0], per_rate=False, one_factor=None) == pytest.approx([2.0])
    (every,) = module.rate_factors(checks, per_rate=True, one_factor="mean")
    assert every == pytest.approx(1.21 ** (1 / 3))
    # One check caught in a stall: the median keeps to the others, the mean follows it.
    stalled = [1.02, 1.03, 1.18, 1.06, 1.60]
    assert module.rate_factors(stalled, per_rate=True, one_factor="median") == pytest.approx([1.06])
    assert module.rate_factors(stalled, per_rate=True, one_factor="mean")[0] > 1.15
    assert module.check_names(options(), "dpd", [0.5, 1.0]) == [f"dpd-check-{i}.json" for i in range(3)]
    assert module.check_names(options(check_every_rate=False), "dpd", [0.5, 1.0]) == [
        "dpd-check-before.json",
        "dpd-check-after.json",
    ]


def test_the_prompt_work_is_scaled_by_what_the_checks_read_of_it(tmp_path: Path) -> None:
    """Checks that read the prompt steps 10% faster than the rest: the config's prompt work runs at
    0.9 of its steps' factor (--one-speed: no ratio, one factor for all)."""
    from pdserve.sim import profile as profiles
    from pdserve.sim import speed

    module = speeds()
    args = options(one_speed=False)
    then = speed.reference(profiles.load(args.profile), str(args.profile))
    for i in range(3):  # a host that slowed from one check to the next, the prompts always 10% less
        steps = tuple(
            (step, seconds * (1 + i / 10) * (0.9 if step.prefill_tokens and not step.decode_streams else 1.0))
            for step, seconds in then.steps
        )
        replace(then, steps=steps).save(tmp_path / f"dpd-check-{i}.json")
    assert module.prompt_ratio(args, tmp_path, "dpd", [0.5, 1.0]) == pytest.approx(0.9)
    assert module.prompt_ratio(options(one_speed=True), tmp_path, "dpd", [0.5, 1.0]) is None
