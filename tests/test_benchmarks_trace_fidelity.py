"""benchmarks/trace_fidelity.py: a served run simulated by the checks around it, by its own steps'
speed and by that speed replayed over time, each cell's error against the run."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest
from benchmark_scripts import benchmark
from test_sim_profile import fixed_profile

from pdserve.cli import main as pdserve
from pdserve.sim import speed

trace_fidelity = benchmark("trace_fidelity")

WORKLOAD = "poisson(20) prompt=uniform(20,200) output=uniform(2,20)"


def test_a_run_is_a_label_a_rate_and_the_servers_flags() -> None:
    run = trace_fidelity.parse_run("dpd@2=--prefill 1 --decode 1")
    assert (run.label, run.scale, run.serve_args, run.name) == ("dpd", 2.0, "--prefill 1 --decode 1", "dpd@2")
    for bad in (
        "dpd=--prefill 1",
        "dpd@x=--colocated 1",
        "dpd@0=--colocated 1",
        "dpd@2=",
        "@2=--colocated 1",
    ):
        with pytest.raises(argparse.ArgumentTypeError, match="LABEL@RATE_SCALE=SERVE ARGS"):
            trace_fidelity.parse_run(bad)


def test_a_share_is_off_by_points_a_latency_by_its_fraction() -> None:
    assert trace_fidelity.error("all ttft p50", 110.0, 100.0) == pytest.approx(0.10)
    assert trace_fidelity.error("docs in SLO", 0.5, 0.4) == pytest.approx(0.10)
    assert trace_fidelity.error("all ttft p50", None, 100.0) is None
    assert trace_fidelity.error("all ttft p50", 5.0, 0.0) is None


def test_a_run_simulated_by_its_own_trace_comes_out_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The "served" run: a host twice as slow as the profile (the profile scaled x2, simulated), its
    # steps traced. Read with --measured, the trace's factor brings the simulation back to it, and
    # with no checks beside the run the checks' column is empty.
    served = replace(fixed_profile(step=0.010, per_token=1e-4, per_stream=2e-3), steps_from="serving")
    served.save(tmp_path / "served.json")
    speed.scaled(served, 2.0).save(tmp_path / "slow.json")
    folder = tmp_path / "out" / "dpd@1"
    run = ["--prefill", "1", "--decode", "1", "--workload", WORKLOAD, "--duration", "3", "--seed", "0"]
    traced = ["--step-trace", str(folder / "steps.jsonl"), "--out", str(folder / "bench")]
    slow = ["sim", "--profile", str(tmp_path / "slow.json"), *run, *traced, "--report-slo", "ttft=100,itl=50"]
    assert pdserve(slow) == 0
    argv = [
        "--profile",
        str(tmp_path / "served.json"),
        "--out",
        str(tmp_path / "out"),
        "--workload",
        WORKLOAD,
    ]
    argv += [
        "--run",
        "dpd@1=--prefill 1 --decode 1",
        "--duration",
        "3",
        "--slo",
        "ttft=100,itl=50",
        "--measured",
    ]
    assert trace_fidelity.main(argv) == 0
    rows = json.loads((tmp_path / "out" / "trace_fidelity.json").read_text())["dpd@1"]
    assert rows["all ttft p90"]["measured"] > 0
    for name in ("all ttft p50", "all ttft p90", "all itl p50", "all itl p90", "all in SLO"):
        assert rows[name]["checks"] is None
        assert rows[name]["trace"] == pytest.approx(0.0, abs=1e-6), name
        assert rows[name]["replay"] == pytest.approx(0.0, abs=1e-6), name  # a steady host: x1 throughout
    table = (tmp_path / "out" / "trace_fidelity.md").read_text()
    assert "### dpd@1" in table and "| all ttft p50 |" in table and "+0%" in table
    # Nothing measured where --measured looks: said, and no table.
    argv[argv.index("dpd@1=--prefill 1 --decode 1")] = "other@1=--colocated 1"
    assert trace_fidelity.main(argv) == 2
    assert "no measured run there" in capsys.readouterr().err
    # A sweep's profile (its steps not served ones) is refused before anything is served.
    replace(served, steps_from="alone").save(tmp_path / "sweep.json")
    argv[argv.index(str(tmp_path / "served.json"))] = str(tmp_path / "sweep.json")
    assert trace_fidelity.main(argv) == 2
    assert "only a profile fitted to served steps" in capsys.readouterr().err


def test_the_options_are_checked_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["--profile", "p.json", "--out", "o", "--workload", WORKLOAD, "--run", "a@1=--colocated 1"]
    with pytest.raises(SystemExit):
        trace_fidelity.parse_args([*base, "--window", "0.5"])
    assert "--window must be at least 1 second" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        trace_fidelity.parse_args([*base, "--duration", "0"])
    assert "--duration and --drain-timeout must be > 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        trace_fidelity.parse_args([*base, "--run", "a@1=--colocated 2"])
    assert "two runs share a LABEL@SCALE" in capsys.readouterr().err
