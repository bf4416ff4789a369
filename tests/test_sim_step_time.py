"""A step's time as a profile holds it: the linear and roofline formulas worked by hand, the spread
bands a simulated step deviates by, and the stream GEMV's passes."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pdserve.costmodel import Step
from pdserve.sim.step_time import LinearStep, ProfileError, RooflineStep, Spread, StreamPasses


def test_the_linear_and_roofline_step_times_are_their_formulas() -> None:
    linear = LinearStep((0.01, 1e-4, 1e-8, 2e-3, 1e-6))
    assert linear.seconds(Step(100, 5050, 3, 600)) == pytest.approx(0.01 + 0.01 + 5.05e-5 + 0.006 + 6e-4)
    roof = RooflineStep(0.004, 2e9, 1e3, 1e9, 1e5, 1e12, 1e11)
    # One decode stream at 1000 tokens: memory-bound, (1e9 + 1e5 * 1000) / 1e11 = 11 ms.
    assert roof.seconds(Step(0, 0, 1, 1000)) == pytest.approx(0.004 + 0.011)
    # A 4000-token prompt: compute-bound, (2e9 * 4000 + 1e3 * 8e6) / 1e12 = 8.008 s.
    assert roof.seconds(Step(4000, 8_000_000, 0, 0)) == pytest.approx(0.004 + 8.008)
    assert roof.seconds(Step()) == 0.004
    # A step's deviation from the fit is drawn from its length's band of the measured spread.
    banded = LinearStep(linear.coefficients, spread=(Spread(0.05, (0.9, 3.0)), Spread(None, (1.0, 1.2))))
    assert banded.spread_at(0.04) == (0.9, 3.0) and banded.spread_at(0.5) == (1.0, 1.2)
    assert linear.spread_at(0.04) == ()
    bounded = LinearStep(linear.coefficients, spread=(Spread(0.05, (0.9, 3.0)), Spread(0.4, (1.0, 1.2))))
    assert bounded.spread_at(0.3) == (1.0, 1.2) and bounded.spread_at(0.5) == (pytest.approx(1.1),)
    # A step with prompt tokens beside streams, by the mixed steps' own spread where it is known.
    apart = replace(banded, mixed_spread=(1.05, 1.3))
    assert apart.spread_at(0.04, mixed=True) == (1.05, 1.3) and apart.spread_at(0.04) == (0.9, 3.0)
    assert banded.spread_at(0.04, mixed=True) == (0.9, 3.0)
    # A worker on a host with a CPU free of workers, by the free runs' spread where it is known
    # (its mixed steps by theirs), else as any other.
    free = replace(apart, free_spread=(Spread(None, (0.98, 1.05)),), free_mixed_spread=(0.9, 1.0))
    assert free.spread_at(0.04, free_cpu=True) == (0.98, 1.05) and free.spread_at(0.04) == (0.9, 3.0)
    assert free.spread_at(0.04, mixed=True, free_cpu=True) == (0.9, 1.0)
    assert apart.spread_at(0.04, free_cpu=True) == (0.9, 3.0)
    # Free runs without mixed steps of their own spread all their steps by band, as they were fitted.
    banded_only = replace(free, free_mixed_spread=())
    assert banded_only.spread_at(0.04, mixed=True, free_cpu=True) == (0.98, 1.05)
    with pytest.raises(ProfileError, match="free_mixed_spread goes with a free_spread"):
        replace(apart, free_mixed_spread=(0.9, 1.0))
    with pytest.raises(ProfileError, match="spread bands must end"):
        replace(banded, free_spread=(Spread(0.05, (1.0,)), Spread(0.04, (1.0,))))
    with pytest.raises(ProfileError, match="ascending ratios"):
        replace(free, free_mixed_spread=(1.2, 1.0))


def test_a_step_on_the_stream_gemv_costs_a_pass_every_rows_per_pass_rows() -> None:
    # The fp32 stream GEMV of an AVX2 CPU: 4 rows a pass, up to 32 rows, the logits' too.
    passes = StreamPasses(rows_per_pass=4, stream_rows=32, logits_rows=32)
    line = (0.008, 0.003, 0.0, 0.002, 0.0)
    step = LinearStep(line, passes=passes, pass_coefficients=(0.012, 0.15, 0.001))
    # 1 to 4 streams share one pass over the weights (every step makes one: the line's base
    # holds it); the 5th starts a second.
    for streams, expected_passes in ((1, 1), (4, 1), (5, 2), (8, 2), (9, 3), (32, 8)):
        expected = 0.008 + 0.002 * streams + 0.012 * (expected_passes - 1)
        assert step.seconds(Step(decode_streams=streams)) == pytest.approx(expected)
    # Past 32 rows a GEMM runs the layers, each row at c1 (here 3 ms), and past 32 streams another
    # GEMM the logits.
    assert step.seconds(Step(decode_streams=40)) == pytest.approx(0.008 + (0.003 + 0.002) * 40 + 0.15 + 0.001)
    # Prompt tokens are rows too: 30 of them beside 3 streams take the layers' GEMM, but the
    # logits stay on the GEMV (a prompt's logits are its last token's).
    mixed = Step(prefill_tokens=30, decode_streams=3)
    assert step.seconds(mixed) == pytest.approx(0.008 + 0.003 * 33 + 0.002 * 3 + 0.15)
    # On the GEMV a prompt's rows cost its passes, as streams do: no cost a row besides.
    assert step.seconds(Step(prefill_tokens=29, decode_streams=3)) == pytest.approx(
        0.008 + 0.002 * 3 + 0.012 * 7
    )
    assert step.seconds(Step()) == pytest.approx(0.008)  # an empty step: no pass at all
    # A logits' GEMV narrower than the layers' (bf16 plans): the logits' GEMM before the layers'.
    narrow = replace(step, passes=StreamPasses(rows_per_pass=8, stream_rows=32, logits_rows=16))
    assert narrow.seconds(Step(decode_streams=16)) == pytest.approx(0.008 + 0.002 * 16 + 0.012)
    assert narrow.seconds(Step(decode_streams=20)) == pytest.approx(0.008 + 0.002 * 20 + 0.012 * 2 + 0.001)
    # Without the GEMV known, the line alone.
    assert LinearStep(line).seconds(Step(decode_streams=40)) == pytest.approx(0.008 + 0.002 * 40)
