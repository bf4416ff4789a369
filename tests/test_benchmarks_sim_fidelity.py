"""benchmarks/sim_fidelity.py: the host's speed checks as the simulation's factors, the measured runs
read back, the simulated knee's fine grid (its scoring: test_benchmarks_fidelity_score.py)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from benchmark_scripts import benchmark

ROOT = Path(__file__).resolve().parents[1]


def fidelity() -> ModuleType:
    return benchmark("sim_fidelity")


def options(**given: Any) -> argparse.Namespace:
    defaults = {
        "profile": ROOT / "profiles" / "cpu-avx2-epyc-smollm2-served.json",
        "model": "smollm2-135m",
        "workload": "chat: poisson(1) prompt=lognormal(64,0.3,16,128) output=uniform(8,16)",
        "duration": 20.0,
        "slo": "ttft=2000,itl=250",
        "drain_timeout": 60.0,
        "speed_check": True,
        "check_every_rate": True,
        "fresh_per_rate": True,
    }
    return argparse.Namespace(**(defaults | given))


def test_each_rate_is_read_from_its_own_run(tmp_path: Path) -> None:
    module = fidelity()
    args = options()
    for scale in ("0.5", "1"):  # one bench compare a rate names its runs by the label alone
        (tmp_path / f"dpd@{scale}").mkdir()
        runs = {"runs": {"dpd": [{"rate": scale}]}, "timelines": {"dpd": [{"at": scale}]}}
        (tmp_path / f"dpd@{scale}" / "summaries.json").write_text(json.dumps(runs))
    measured, timelines = module.read_measured(args, tmp_path, ["dpd"], [0.5, 1.0])
    assert measured == {"dpd@0.5": [{"rate": "0.5"}], "dpd@1": [{"rate": "1"}]}
    assert timelines["dpd@1"] == [{"at": "1"}]


def test_each_rate_is_simulated_at_the_speed_checked_around_it() -> None:
    """Two rates alike but for their factor: the one checked slower is simulated slower."""
    module = fidelity()
    args = options()
    fast, slow = module.simulate_rates(args, "--colocated 1", [1.0, 1.0], 0, [1.0, 1.5])
    for metric in ("ttft_ms", "itl_ms"):
        assert module.value(slow, metric, "p50") > 1.3 * module.value(fast, metric, "p50")
    same = module.simulate_rates(args, "--colocated 1", [1.0], 0, [1.0])[0]
    assert module.value(same, "ttft_ms", "p50") == module.value(fast, "ttft_ms", "p50")


def test_the_speed_options_refuse_to_go_alone(capsys: pytest.CaptureFixture[str]) -> None:
    module = fidelity()
    base = ["--profile", "p.json", "--workload", "w", "--config", "dpd=--prefill 1 --decode 1", "--out", "o"]
    assert module.parse_args([*base, "--speed-check", "--check-every-rate"]).fresh_per_rate
    every_rate = [*base, "--speed-check", "--check-every-rate", "--one-factor"]
    assert module.parse_args(every_rate).one_factor == "mean"  # the flag alone, as before
    assert module.parse_args([*every_rate, "median"]).one_factor == "median"
    for bad in ("1,x", "0.5,0", "-1"):
        with pytest.raises(SystemExit):
            module.parse_args([*base, "--knee-scales", bad])
        assert "--knee-scales takes rate scales > 0" in capsys.readouterr().err
    for alone, needs in (("--check-every-rate", "--speed-check"), ("--one-factor", "--check-every-rate")):
        with pytest.raises(SystemExit):
            module.parse_args([*base, alone])
        assert f"{alone} goes with {needs}" in capsys.readouterr().err


def test_a_simulated_knee_is_found_between_the_rates_on_fresh_deployments() -> None:
    """--knee-scales: more rates simulated, each fresh; a rate already simulated is not run again."""
    module = fidelity()
    args = options(knee_scales="1,6", repeats=1, seed=0, duration=15.0)
    shares = module.knee_shares(args, "--colocated 1", [1.0, 1.0], {1.0: 0.5})
    assert shares[1.0] == 0.5  # given: not simulated again
    assert shares[6.0] < 0.9  # six times the load on one worker misses the SLO
    assert module.knee_shares(options(knee_scales=""), "--colocated 1", [None], {1.0: 0.5}) == {1.0: 0.5}
