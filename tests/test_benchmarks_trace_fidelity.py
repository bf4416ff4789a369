"""benchmarks/trace_fidelity.py: a served run simulated by the checks around it, by its own steps'
speed and by that speed replayed over time, each cell's error against the run."""

from __future__ import annotations

import argparse
import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

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
        "--draws",
        "1",  # one simulation a mode: the columns' arithmetic is the test's, not the draws' spread
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
    assert "repeat" not in table and not (tmp_path / "out" / "repeats.json").exists()  # a run of its own
    # The same run served again (here: its copy) under a label of its own: the two read against
    # each other, every latency cell the same, in the table and in repeats.json.
    shutil.copytree(folder, tmp_path / "out" / "dpd-b@1", ignore=shutil.ignore_patterns("sim-*"))
    assert trace_fidelity.main([*argv, "--run", "dpd-b@1=--prefill 1  --decode 1"]) == 0
    rows = json.loads((tmp_path / "out" / "trace_fidelity.json").read_text())["dpd-b@1"]
    assert rows["all ttft p90"]["repeat"] == pytest.approx(0.0) and rows["all in SLO"]["repeat"] == 0.0
    (group,) = json.loads((tmp_path / "out" / "repeats.json").read_text())
    assert (
        group["runs"] == ["dpd@1", "dpd-b@1"]
        and group["within"]["repeat"][0] == group["within"]["repeat"][1] > 0
    )
    assert "### repeats: dpd@1, dpd-b@1" in (tmp_path / "out" / "trace_fidelity.md").read_text()
    assert trace_fidelity.main(argv) == 0  # one of them read alone again: no repeats left behind
    assert not (tmp_path / "out" / "repeats.json").exists()
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


def _rows(measured: dict[str, float], checks: float | None, draws: tuple[float, float]) -> dict[str, Any]:
    """A run's compared rows by hand: each cell measured, the checks' error, the draws' range."""
    return {
        name: {
            "measured": value,
            "checks": checks,
            "trace": 0.0,
            "replay": None,
            "draws": {"trace": list(draws)} | ({} if checks is None else {"checks": list(draws)}),
        }
        for name, value in measured.items()
    }


def test_repeats_of_a_run_predict_one_another_and_are_scored_beside_the_simulation() -> None:
    # Three servings of one DPD at x2 (labels differ, flags and rate do not; one of them lacks the
    # checks beside it), one at another rate and a colocated one at the same rate: one group.
    runs = [
        trace_fidelity.parse_run(text)
        for text in (
            "dpd@2=--prefill 1 --decode 1",
            "dpd-b@2=--prefill 1  --decode 1",
            "dpd-c@2=--prefill 1 --decode 1",
            "dpd@3=--prefill 1 --decode 1",
            "colocated@2=--colocated 2",
        )
    ]
    groups = trace_fidelity.repeat_groups(runs)
    assert [[run.name for run in group] for group in groups] == [["dpd@2", "dpd-b@2", "dpd-c@2"]]
    results = {
        "dpd@2": _rows({"all ttft p50": 100.0, "all itl p90": 20.0, "all in SLO": 0.9}, 0.05, (90, 110)),
        "dpd-b@2": _rows({"all ttft p50": 150.0, "all itl p90": 21.0, "all in SLO": 0.7}, None, (140, 160)),
        "dpd-c@2": _rows({"all ttft p50": 104.0, "all itl p90": 22.0, "all in SLO": 0.8}, -0.2, (100, 120)),
        "dpd@3": _rows({"all ttft p50": 500.0}, 0.0, (400, 600)),
        "colocated@2": _rows({"all ttft p50": 90.0}, 0.0, (80, 100)),
    }
    trace_fidelity.add_repeats(results, groups)
    # Each run against the median of the other two: a latency by its fraction, a share by points.
    assert results["dpd@2"]["all ttft p50"]["repeat"] == pytest.approx(127.0 / 100.0 - 1)
    assert results["dpd-b@2"]["all ttft p50"]["repeat"] == pytest.approx(102.0 / 150.0 - 1)
    assert results["dpd-c@2"]["all itl p90"]["repeat"] == pytest.approx(20.5 / 22.0 - 1)
    assert results["dpd-b@2"]["all in SLO"]["repeat"] == pytest.approx(0.85 - 0.7)
    assert "repeat" not in results["dpd@3"]["all ttft p50"]
    summary = trace_fidelity.repeat_summary(results, groups[0])
    assert summary["runs"] == ["dpd@2", "dpd-b@2", "dpd-c@2"]
    # Latency cells only (the share is not one): repeat within 10% for the three ITL p90s (+2.5%,
    # 0%, -7%) and none of the TTFTs (+27%, -32%, +21%); checks where the run had them.
    assert summary["within"]["repeat"] == (3, 6)
    assert summary["within"]["checks"] == (2, 4)
    assert summary["within"]["trace"] == (6, 6)
    assert summary["within"]["replay"] == (0, 0)
    ttft = summary["ranges"]["all ttft p50"]
    assert ttft["runs"] == [100.0, 150.0]
    assert ttft["trace"] == [90, 160]
    assert ttft["checks"] == [90, 120]  # dpd-b@2 had no checks
    assert "replay" not in ttft and "all in SLO" not in summary["ranges"]
    text = trace_fidelity.repeat_table([summary])
    assert "### repeats: dpd@2, dpd-b@2, dpd-c@2" in text
    assert "repeat 3 of 6, checks 2 of 4, trace 6 of 6, replay 0 of 0" in text
    assert "| all ttft p50 | 100..150 (50%) | 90..120 (33%) | 90..160 (78%) | - |" in text
    assert "| checks draws (2 of 3 runs) | trace draws | replay draws (0 of 3 runs) |" in text
    # The runs' table grows a repeat column, "-" for a run without repeats.
    table = trace_fidelity.table(results)
    assert "| cell | measured | checks | trace | replay | repeat |" in table
    assert "| all ttft p50 | 500 ms | +0% | +0% | - | - |" in table
