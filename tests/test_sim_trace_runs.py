"""What each traced run was: its workers against the host's CPUs, and the pace it was served at
against the profile's speed check."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
from test_sim_calibrate import written_trace
from test_sim_profile import fixed_profile

from pdserve.costmodel import Step
from pdserve.sim.calibrate import calibrated, read_busy_trace
from pdserve.sim.profile import HostCpu
from pdserve.sim.speed import SpeedCheck
from pdserve.sim.trace_runs import against_the_check, runs_with_a_free_cpu


def test_a_run_that_left_a_cpu_free_is_told_by_its_workers(tmp_path: Path) -> None:
    steps = [(Step(decode_streams=1), 0.01)] * 40
    traces = [written_trace(tmp_path / "c2.jsonl", 2, steps), written_trace(tmp_path / "c1.jsonl", 1, steps)]
    pools = read_busy_trace(traces, 2)
    assert runs_with_a_free_cpu(pools, 2) == {1}
    assert runs_with_a_free_cpu(pools, 4) == {0, 1} and runs_with_a_free_cpu(pools, 1) == set()


def test_a_run_served_at_another_pace_than_the_check_is_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # The profile's check timed a one-stream step at 10 ms; one traced run served them at 10.2 ms,
    # another at 12.5 (a slow patch the check did not see): both said, the second loudly.
    check = SpeedCheck("tiny", "cpu", "float32", 1, ((Step(decode_streams=1, decode_context=33), 0.010),))
    base = replace(
        fixed_profile(), host=HostCpu(cpus=1), meta={"device": "cpu", "speed_check": check.to_json()}
    )
    steady = written_trace(tmp_path / "steady.jsonl", 1, [(Step(decode_streams=1), 0.0102)] * 40)
    slow = written_trace(tmp_path / "slow.jsonl", 1, [(Step(decode_streams=1), 0.0125)] * 40)
    pools = read_busy_trace([steady, slow], 1)
    with caplog.at_level(logging.WARNING, logger="pdserve.sim"):
        notes = against_the_check(base, pools, [steady, slow])
    assert (
        notes[0] == "steady.jsonl: its one-stream decode steps x1.02 the speed check's (10.2 against 10.0 ms)"
    )
    assert notes[1].startswith("slow.jsonl: its one-stream decode steps x1.25") and "trace again" in notes[1]
    assert [r.getMessage() for r in caplog.records] == [notes[1]]
    assert any(
        a.startswith("slow.jsonl: its one-stream") for a in calibrated(base, [steady, slow]).assumptions
    )
    # No check in the profile (or too few such steps): nothing to say.
    assert against_the_check(fixed_profile(), pools, [steady, slow]) == []
    few = written_trace(tmp_path / "few.jsonl", 1, [(Step(decode_streams=1), 0.0125)] * 10)
    assert against_the_check(base, read_busy_trace([few], 1), [few]) == []
