"""The arrival processes and length distributions a workload class draws from."""

from __future__ import annotations

import numpy as np
import pytest

from pdserve.bench.distributions import Constant, Fixed, Gamma, Lognormal, Poisson, Uniform


def _gaps(times: np.ndarray) -> np.ndarray:
    return np.diff(times, prepend=0.0)


@pytest.mark.parametrize(
    ("process", "cv"),
    [(Poisson(2.0), 1.0), (Gamma(2.0, 1.0), 1.0), (Gamma(2.0, 0.25), 2.0), (Gamma(2.0, 4.0), 0.5)],
)
def test_random_arrivals_have_the_mean_gap_and_the_spread_asked_for(
    process: Poisson | Gamma, cv: float
) -> None:
    gaps = _gaps(process.times(np.random.default_rng(1), 40_000, None))
    assert gaps.size == 40_000 and (gaps >= 0).all()
    assert gaps.mean() == pytest.approx(0.5, rel=0.04)
    # Gamma's coefficient of variation is 1/sqrt(burstiness): burstiness < 1 is burstier.
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.06)


def test_constant_arrivals_are_evenly_spaced_from_one_gap_after_the_start() -> None:
    times = Constant(4.0).times(np.random.default_rng(0), 8, None)
    np.testing.assert_allclose(times, np.arange(1, 9) / 4.0)
    # A duration cap keeps only what arrives before it.
    np.testing.assert_allclose(Constant(4.0).times(np.random.default_rng(0), None, 1.0), [0.25, 0.5, 0.75])


def test_lengths_are_whole_numbers_within_their_bounds() -> None:
    rng = np.random.default_rng(0)
    uniform = Uniform(3, 5).sample(rng, 2000)
    assert set(uniform.tolist()) == {3, 4, 5}  # both ends included
    tiny = Lognormal(0.2, 2.0).sample(rng, 2000)
    assert tiny.min() >= 1
    clipped = Lognormal(100, 1.5, min=16, max=400).sample(rng, 5000)
    assert clipped.min() == 16 and clipped.max() == 400
    assert np.median(Lognormal(100, 0.5).sample(rng, 20_000)) == pytest.approx(100, rel=0.03)
    assert (Fixed(7).sample(rng, 3) == 7).all()
