"""How served steps spread around their fit: bands of fitted length and their quantiles, from few
steps, like steps and tiny ratios (the fit's own tests, with real fits: test_sim_calibrate.py)."""

from __future__ import annotations

import pytest

from pdserve.sim.spread_fit import spread_of, spread_p90
from pdserve.sim.step_time import LinearStep


def test_the_spread_of_few_steps_of_like_steps_and_of_tiny_ratios() -> None:
    assert spread_of([]) == ()
    # Fewer than a band's worth of steps: one band, a quantile a step, up to just past the longest.
    (one,) = spread_of([(0.01 * k, 0.01 * k * (1 + k / 100)) for k in range(1, 11)])
    assert len(one.quantiles) == 10 and one.below_s is not None and one.below_s > 0.1
    # Steps all alike: no band ends inside them.
    (alike,) = spread_of([(0.02, 0.02 * r) for r in (0.9, 1.0, 1.1) * 40])
    assert alike.quantiles[0] == pytest.approx(0.9) and alike.quantiles[-1] == pytest.approx(1.1)
    # A step far faster than its fit still makes a profile that loads (no ratio rounded to 0).
    tiny = spread_of([(1.0, 1e-5)] * 40)
    assert LinearStep((0.01, 0.0, 0.0, 0.0, 0.0), spread=tiny).spread_at(1.0)[0] > 0


def test_a_spreads_tail_is_its_shortest_bands_90th_percentile_over_its_median() -> None:
    bands = spread_of([(0.02, 0.02 * r) for r in [1.0] * 80 + [1.5] * 20])
    assert bands[0].quantiles[len(bands[0].quantiles) // 2] == 1.0
    assert spread_p90(bands) == pytest.approx(1.5)
    assert spread_p90(()) == 1.0  # no spread: no tail
