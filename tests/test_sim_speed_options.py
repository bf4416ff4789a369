"""The speed options of `pdserve sim` and `pdserve plan` read into a profile: none leaves it as
measured; a trace scales it by its steps (with --headroom on top, every kind of step alike) and
with --speed-window says its speed over time; contradictions are refused before any reading."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest
from test_sim_profile import fixed_profile
from test_sim_trace_speed import write_trace

from pdserve.costmodel import Step
from pdserve.errors import PdserveError
from pdserve.sim.speed_options import host_speed
from pdserve.sim.step_time import ProfileError


def options(**changes: object) -> argparse.Namespace:
    base = {"profile": Path("p.json"), "speed_check": None, "speed_trace": None, "speed_window": None}
    return argparse.Namespace(**(base | {"headroom": 0.0} | changes))


SERVED = replace(fixed_profile(step=0.01, per_stream=0.002), steps_from="serving")
DECODE = Step(0, 0, 1, 100)


def test_no_option_leaves_the_profile_as_measured() -> None:
    assert host_speed(options(), SERVED) == (SERVED, None)
    # plan's options have no window: read as none
    planned = options()
    del planned.speed_window
    assert host_speed(planned, SERVED) == (SERVED, None)


def test_a_trace_scales_the_profile_and_a_window_replays_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "steps.jsonl"
    write_trace(trace, [2.0, 2.0, 6.0, 2.0])  # the run's steps x2 (its median), a window x6
    scaled, course = host_speed(options(speed_trace=[trace], speed_window=10.0), SERVED)
    assert scaled.step_time("colocated").seconds(DECODE) == pytest.approx(
        2 * SERVED.step_time("colocated").seconds(DECODE)
    )
    assert course is not None and course.factors["colocated"] == pytest.approx((2 / 3, 2 / 3, 2.0, 2 / 3))
    err = capsys.readouterr().err
    assert "its 40 steps took x2.000" in err and "--speed-window 10" in err
    # --headroom on top: everything x1.1 more; the course is the run's, unchanged.
    slower, again = host_speed(options(speed_trace=[trace], speed_window=10.0, headroom=0.1), SERVED)
    assert slower.meta["speed_factor"] == pytest.approx(2.2) and again == course
    # ... each pool's own kinds too (the trace's one pool, colocated: its steps x2.2 as well).
    assert slower.meta["speed_factors_by_role"]["colocated"][0] == pytest.approx(2.2)
    assert slower.step_time("colocated").seconds(DECODE) == pytest.approx(
        2.2 * SERVED.step_time("colocated").seconds(DECODE)
    )
    # No option given but --headroom: the profile as measured, x1.1.
    assert host_speed(options(headroom=0.1), SERVED)[0].meta["speed_factor"] == pytest.approx(1.1)


def test_contradictions_are_refused(tmp_path: Path) -> None:
    trace = tmp_path / "steps.jsonl"
    write_trace(trace, [1.0])
    with pytest.raises(PdserveError, match="give one"):
        host_speed(options(speed_trace=[trace], speed_check=[tmp_path / "check.json"]), SERVED)
    with pytest.raises(PdserveError, match="give its --speed-trace"):
        host_speed(options(speed_window=5.0), SERVED)
    with pytest.raises(PdserveError, match="--headroom must be a fraction >= 0"):
        host_speed(options(headroom=-0.5), SERVED)
    with pytest.raises(ProfileError, match="at least 1 s"):
        host_speed(options(speed_trace=[trace], speed_window=0.0), SERVED)
