"""pdserve/sim/loop_fit.py: the worker loop's time around a decode step, fitted to served steps:
a line in the stream count, and each count's own time where the steps ran it often."""

from __future__ import annotations

import pytest

from pdserve.sim.loop_fit import MIN_TABLE_STEPS, fit_line, fit_loop


def test_the_loop_is_a_line_through_each_stream_counts_own_loop_time() -> None:
    rows = [{"decode_streams": n, "loop_seconds": 0.002 + 0.001 * n} for n in (1, 2, 4) for _ in range(6)]
    rows += [{"decode_streams": 2, "loop_seconds": 0.5}]  # a step that waited on a pull: a median ignores it
    rows += [{"decode_streams": 0, "loop_seconds": 9.0} for _ in range(6)]  # prompt steps: not the loop's
    rows += [{"decode_streams": 9, "loop_seconds": 1.0} for _ in range(4)]  # too few to have a median
    assert fit_line(rows) == pytest.approx((0.002, 0.001))
    assert fit_line([]) == (0.0, 0.0)
    # Where the trace says how long the loop waited on pulls, that is left out, though every
    # step waited (a median alone would take it in).
    waited = [
        {"decode_streams": n, "loop_seconds": 0.002 + 0.001 * n + 0.004 * n, "pull_wait_seconds": 0.004 * n}
        for n in (1, 2, 4)
        for _ in range(6)
    ]
    assert fit_line(waited) == pytest.approx((0.002, 0.001))
    # With the waits known, a count's few long loops count, as they cost the streams: its mean.
    skewed = [
        {"decode_streams": n, "loop_seconds": own, "pull_wait_seconds": 0.0}
        for n in (1, 2, 4)
        for own in [0.002 + 0.001 * n] * 5 + [0.008 + 0.001 * n]
    ]
    assert fit_line(skewed) == pytest.approx((0.003, 0.001))


def test_counts_run_often_keep_their_own_loop_time_beside_the_line() -> None:
    # A light load's many 1-3 stream steps loop in 0.5-0.9 ms; a heavy load's few wide steps in
    # 4-6 ms. One point a count, the line's base lands far above the light load's loops; the
    # counts run often keep their own (their mean: the waits are known), the rare ones the line.
    light = {1: 0.0005, 2: 0.0007, 3: 0.0009}
    rows = [
        {"decode_streams": n, "loop_seconds": seconds + 0.001 * (k % 2), "pull_wait_seconds": 0.0}
        for n, seconds in light.items()
        for k in range(MIN_TABLE_STEPS * 4)
    ]
    rows += [
        {"decode_streams": n, "loop_seconds": 0.005, "pull_wait_seconds": 0.0}
        for n in range(20, 41)
        for _ in range(6)
    ]
    loop = fit_loop(rows)
    assert (loop.step_s, loop.stream_s) == pytest.approx(fit_line(rows))
    assert loop.step_s + loop.stream_s > 0.0015  # the line alone: 50% over one stream's mean loop
    assert [n for n, _ in loop.by_streams] == [1, 2, 3]  # the wide counts ran too few steps each
    assert [s for _, s in loop.by_streams] == pytest.approx([seconds + 0.0005 for seconds in light.values()])
    assert loop.seconds(1) == pytest.approx(0.001) and loop.seconds(3) == pytest.approx(0.0014)
    assert loop.seconds(2) == pytest.approx(0.0012)
    assert loop.seconds(25) == pytest.approx(loop.step_s + 25 * loop.stream_s)  # past the table: the line
    # Older traces (no pull waits): each count's median, as the line's points; a few long loops
    # (a pull waited on, unsaid) then move it no more than any other.
    older = [{k: v for k, v in row.items() if k != "pull_wait_seconds"} for row in rows]
    older += [{"decode_streams": 1, "loop_seconds": 0.05} for _ in range(3)]
    medians = dict(fit_loop(older).by_streams)
    assert medians[1] == pytest.approx(0.0015) and medians[3] == pytest.approx(0.0014)
    with_waits = [
        *rows,
        *({"decode_streams": 1, "loop_seconds": 0.05, "pull_wait_seconds": 0.0} for _ in range(3)),
    ]
    assert dict(fit_loop(with_waits).by_streams)[1] > 0.002  # their mean: the long loops count
