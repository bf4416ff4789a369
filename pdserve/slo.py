"""Service-level objectives: what `--slo ttft=MS,itl=MS` and `--slo-percentile` mean, and the one
definition of a percentile that the server, the planner and the bench all use. Pure Python.

An SLO holds at percentile p (0.9 by default) when p of the requests meet it: TTFT (arrival to the
first token) at or below `ttft_s`, every inter-token gap of their stream at or below `itl_s`
(p of the gaps, over a window). Either may be absent; the planner and the path choice only reason
about the ones given.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace

from pdserve.errors import PdserveError

DEFAULT_PERCENTILE = 0.9


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    itl_s: float | None = None
    percentile: float = DEFAULT_PERCENTILE

    def __post_init__(self) -> None:
        for name in ("ttft_s", "itl_s"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise PdserveError(f"the {name[:-2]} SLO must be > 0 ms, got {value * 1000:g}")
        if not 0.5 <= self.percentile < 1.0:
            raise PdserveError(f"the SLO percentile must be in [0.5, 1), got {self.percentile:g}")

    @property
    def given(self) -> bool:
        return self.ttft_s is not None or self.itl_s is not None

    def override(self, ttft_ms: float | None = None, itl_ms: float | None = None) -> SLO:
        """This SLO with a pool's own values where it has them (`[pools.X]` in the config)."""
        return replace(
            self,
            ttft_s=self.ttft_s if ttft_ms is None else ttft_ms / 1000,
            itl_s=self.itl_s if itl_ms is None else itl_ms / 1000,
        )

    def describe(self) -> dict[str, float | None]:
        return {"ttft_s": self.ttft_s, "itl_s": self.itl_s, "percentile": self.percentile}


def parse_limits(text: str | None, names: tuple[str, ...] = ("ttft", "itl")) -> dict[str, float]:
    """`ttft=500,itl=50` (milliseconds, each of `names` at most once) -> {"ttft": 0.5, "itl": 0.05}
    in seconds. Raises PdserveError. The server takes ttft and itl; the bench also tpot and e2e."""
    values: dict[str, float] = {}
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        name, sep, number = item.partition("=")
        name = name.strip().lower()
        if not sep or name not in names:
            wanted = " and/or ".join(f"{n}=MS" for n in names)
            raise PdserveError(f"--slo: expected {wanted} separated by commas, got {item!r}")
        if name in values:
            raise PdserveError(f"--slo: {name} is given twice")
        try:
            values[name] = float(number.strip().removesuffix("ms")) / 1000
        except ValueError:
            raise PdserveError(f"--slo: {name} must be a number of milliseconds, got {number!r}") from None
        if not values[name] > 0:
            raise PdserveError(f"--slo: {name} must be > 0 ms, got {number.strip()!r}")
    return values


def parse_slo(text: str | None, percentile: float = DEFAULT_PERCENTILE) -> SLO:
    """`ttft=500,itl=50` (milliseconds; either may be left out). Raises PdserveError."""
    values = parse_limits(text)
    return SLO(ttft_s=values.get("ttft"), itl_s=values.get("itl"), percentile=percentile)


def quantile(values: Iterable[float], p: float) -> float | None:
    """The p-quantile (0 <= p <= 1) by linear interpolation between the closest ranks, numpy's
    default and what vLLM's and our own benchmarks report; None if there are no values. The one
    definition: the server's windows, the planner, admission and the bench all use it."""
    ordered = sorted(values)
    if not ordered:
        return None
    rank = (len(ordered) - 1) * p
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


# The gaps' percentile a request's own ITL is judged at (with fewer than 100 gaps, about its largest).
ITL_VERDICT_PERCENTILE = 0.99


def request_meets(
    limits: Mapping[str, float],
    *,
    ttft: float | None,
    itls: Sequence[float] = (),
    tpot: float | None = None,
    e2e: float | None = None,
) -> bool:
    """The per-request verdict, one definition for the bench, the timeline and the simulator: a
    request meets `ttft`, `tpot` and `e2e` limits (seconds) by its own value, and an `itl` limit
    when the 99th percentile of its own gaps is within it; a value it does not have (None: the
    TPOT of a one-token answer) is not held against it. The caller says whether the request
    counts at all (a failed one, or one that streamed nothing, meets nothing)."""
    values = {"ttft": ttft, "tpot": tpot, "e2e": e2e, "itl": quantile(itls, ITL_VERDICT_PERCENTILE) or 0.0}
    for key, limit in limits.items():
        value = values[key]
        if value is not None and value > limit:
            return False
    return True


def ms_text(seconds: float | None) -> str:
    """A latency for a log line: "123 ms", or "-" when there is none."""
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"
