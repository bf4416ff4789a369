"""How served steps spread around their fit (`pdserve profile --from-trace`, calibrate.py): the
measured / fitted ratios at quantiles, in bands of fitted step length, and a prompt beside streams
apart. The simulation draws each step's deviation from them (pdserve/sim/cluster.py). No torch."""

from __future__ import annotations

import numpy as np

from pdserve.costmodel import Step
from pdserve.sim.step_time import LinearStep, Spread

# Steps a pool role needs to fit five coefficients with any confidence (calibrate.py), a spread band
# to stand alone, or a role's mixed steps to spread apart.
MIN_STEPS = 30
SPREAD_POINTS = 50  # quantiles of a role's measured / fitted step times kept in the profile, a band
SPREAD_BANDS = 3  # bands of fitted step length, each with its own spread


def spreads(
    alone: LinearStep, busy: LinearStep, samples: list[tuple[Step, float, float]]
) -> tuple[tuple[Spread, ...], tuple[float, ...], list[float]]:
    """How `samples` (step, seconds, b) spread around the fit alone x (1 - b) + busy x b: the
    bands (`spread_of`), the mixed steps' own quantiles, and each step's relative error."""
    fitted_and_measured = [
        (fitted, t, step.prefill_tokens > 0 and step.decode_streams > 0)
        for step, t, b in samples
        if (fitted := alone.seconds(step) + (busy.seconds(step) - alone.seconds(step)) * b) > 0
    ]
    errors = [abs(fitted / t - 1) for fitted, t, _ in fitted_and_measured]  # |fit - measured| / measured
    # Mixed steps (prompt tokens beside streams) spread by their own where there are enough of
    # them and of the others: on a decode worker they ran over the line the rest set.
    mixed = [(fitted, t) for fitted, t, is_mixed in fitted_and_measured if is_mixed]
    others = [(fitted, t) for fitted, t, is_mixed in fitted_and_measured if not is_mixed]
    apart = len(mixed) >= MIN_STEPS and len(others) >= MIN_STEPS
    every = others if apart else [(fitted, t) for fitted, t, _ in fitted_and_measured]
    return spread_of(every), ratio_quantiles(mixed) if apart else (), errors


def spread_of(fitted_and_measured: list[tuple[float, float]]) -> tuple[Spread, ...]:
    """How the measured steps spread around their fit, in up to SPREAD_BANDS bands of fitted length
    that each took a like share of the time (each of MIN_STEPS steps or more, but for one band when
    there are fewer): measured / fitted at the quantiles (i + 0.5) / SPREAD_POINTS (fewer with fewer
    steps) in each. The simulation draws each step's deviation from its band, so that its steps
    spread, and add up, as the served ones did: their right tail puts their mean 2-11% above the
    fit's median, and the tail is a short step's (a 40 ms step that waited on another process took
    up to 3.5x; a 300 ms one 1.8x at most)."""
    steps = sorted(fitted_and_measured)
    if not steps:
        return ()
    total = sum(t for _, t in steps)
    bands: list[list[tuple[float, float]]] = [[]]
    done = 0.0
    for fitted, t in steps:
        share = len(bands) / SPREAD_BANDS  # the time the bands so far should hold between them
        if (
            done >= share * total
            and len(bands[-1]) >= MIN_STEPS
            and len(bands) < SPREAD_BANDS
            and fitted > bands[-1][-1][0]  # not inside a run of like steps: a band ends between two
        ):
            bands.append([])
        bands[-1].append((fitted, t))
        done += t
    if len(bands) > 1 and len(bands[-1]) < MIN_STEPS:  # too few to stand alone: the band before
        bands[-2].extend(bands.pop())
    spread = []
    for index, band in enumerate(bands):
        # A band ends where the next begins (halfway between their steps), the last just past its
        # longest step: a longer one's deviation was not measured.
        if index + 1 < len(bands):
            below = float(f"{(band[-1][0] + bands[index + 1][0][0]) / 2:.6g}")
        else:
            below = float(f"{band[-1][0] * 1.001:.6g}")
        spread.append(Spread(below, ratio_quantiles(band)))
    return tuple(spread)


def spread_p90(bands: tuple[Spread, ...]) -> float:
    """The first (shortest steps') band's 90th percentile over its median: how long its tail is."""
    if not bands:
        return 1.0
    ratios = bands[0].quantiles
    return ratios[int(0.9 * len(ratios))] / ratios[len(ratios) // 2]


def ratio_quantiles(fitted_and_measured: list[tuple[float, float]]) -> tuple[float, ...]:
    """measured / fitted at the quantiles (i + 0.5) / SPREAD_POINTS (fewer with fewer steps)."""
    ratios = np.array([t / fitted for fitted, t in fitted_and_measured])
    n = min(SPREAD_POINTS, len(ratios))
    return tuple(float(f"{q:.4g}") for q in np.quantile(ratios, (np.arange(n) + 0.5) / n))
