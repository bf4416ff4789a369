"""benchmarks/served_fit_phases.py: a served trace's steps, phase by phase of the staircase, against
a fit; a simulated run's trace of a known profile, fitted back, meets its steps in every phase."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from benchmark_scripts import benchmark
from test_sim_calibrate import traced_run
from test_sim_profile import fixed_profile

from pdserve.sim import calibrate


def phases_module() -> ModuleType:
    return benchmark("served_fit_phases")


def test_each_step_falls_in_its_phase_and_a_fit_of_the_truth_meets_every_phase(tmp_path: Path) -> None:
    module = phases_module()
    truth = fixed_profile(step=0.01, per_token=1e-4, per_stream=2e-3)
    trace = traced_run(tmp_path, truth, "--colocated", "1")
    pools = module.phased(truth, [trace], load_s=4.0)
    rows = pools["colocated"]
    first = min(float(r["t_s"]) - float(r["seconds"]) for r in rows)
    for row in rows:  # a second a phase; the drain counts as the last
        assert row["phase"] == min(3, int((float(row["t_s"]) - first) / 1.0))
    assert {row["phase"] for row in rows} == {0, 1, 2, 3}
    pair = module.fit(calibrate, "ratio", truth, "colocated", rows, None)
    assert module.cells(pair, rows).split() == ["1.00/1.00"] * 4
