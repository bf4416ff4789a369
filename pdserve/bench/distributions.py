"""What a workload class draws from: arrival processes (when its requests come) and length
distributions (how many prompt and output tokens each has). No torch; numpy only.

Each is a frozen dataclass named as in the `--workload` spec (see pdserve.bench.workload), whose
describe() writes it back in that syntax. `Replay` and `LengthRows` hold what was read from a CSV
file (see pdserve.bench.traces).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Literal, Self

import numpy as np
import numpy.typing as npt

from pdserve.errors import PdserveError

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
Rng = np.random.Generator


class WorkloadError(PdserveError, ValueError):
    """A workload spec, a trace file or a parameter is wrong; the message says what and where."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise WorkloadError(message)


def check_positive(name: str, value: float) -> None:
    require(value > 0 and math.isfinite(value), f"{name} must be a finite number > 0, got {value}")


def check_caps(max_n: int | None, duration_s: float | None) -> None:
    require(max_n is not None or duration_s is not None, "give max_requests and/or duration_s")
    require(max_n is None or max_n >= 1, f"max_requests must be >= 1, got {max_n}")
    if duration_s is not None:
        check_positive("duration_s", duration_s)


class _Described:
    """describe() in the spec's own syntax, from the dataclass fields (defaults left out)."""

    def describe(self) -> str:
        shown = [(f.name, getattr(self, f.name)) for f in fields(self)]  # type: ignore[arg-type]
        defaults = {f.name: f.default for f in fields(self)}  # type: ignore[arg-type]
        args = [f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in shown if v != defaults[k]]
        return f"{type(self).__name__.lower()}({', '.join(args)})"


# --- arrival processes ------------------------------------------------------------------------


@dataclass(frozen=True)
class _Renewal(_Described):
    """Arrivals separated by independent gaps. The first comes one gap after the start, as in a
    process that was already running, so that classes merged at t=0 do not all fire at once."""

    rate: float  # requests per second

    def __post_init__(self) -> None:
        check_positive("rate", self.rate)

    def _gaps(self, rng: Rng, size: int) -> FloatArray:
        raise NotImplementedError

    def times(self, rng: Rng, max_n: int | None, duration_s: float | None) -> FloatArray:
        """Arrival times in seconds after the start: at most max_n, all before duration_s."""
        check_caps(max_n, duration_s)
        # Chunks of about the expected count, then one cumsum over all the gaps: the times depend
        # only on the stream (numpy draws element by element), never on the chunking.
        chunk = max_n or 1
        if duration_s is not None:
            chunk = min(int(duration_s * self.rate * 1.2) + 16, 1 << 20, max_n or 1 << 20)
        parts: list[FloatArray] = []
        count, times = 0, np.zeros(0)
        while (max_n is None or count < max_n) and (
            duration_s is None or not times.size or times[-1] < duration_s
        ):
            size = chunk if max_n is None else min(chunk, max_n - count)
            parts.append(self._gaps(rng, size))
            count += size
            times = np.cumsum(np.concatenate(parts))
        return times[times < duration_s] if duration_s is not None else times

    def scaled(self, factor: float) -> Self:
        return replace(self, rate=self.rate * factor)


@dataclass(frozen=True)
class Poisson(_Renewal):
    def _gaps(self, rng: Rng, size: int) -> FloatArray:
        return rng.exponential(1.0 / self.rate, size)


@dataclass(frozen=True)
class Gamma(_Renewal):
    """Gamma gaps as `vllm bench serve --burstiness`: shape = burstiness, scale = 1/(rate *
    burstiness). The mean gap stays 1/rate; the coefficient of variation is 1/sqrt(burstiness)."""

    burstiness: float  # 1 = Poisson; < 1 burstier; > 1 more regular

    def __post_init__(self) -> None:
        super().__post_init__()
        check_positive("burstiness", self.burstiness)

    def _gaps(self, rng: Rng, size: int) -> FloatArray:
        return rng.gamma(self.burstiness, 1.0 / (self.rate * self.burstiness), size)


@dataclass(frozen=True)
class Constant(_Renewal):
    def _gaps(self, rng: Rng, size: int) -> FloatArray:
        return np.full(size, 1.0 / self.rate)


@dataclass(frozen=True)
class Concurrency(_Described):
    """Closed loop: no arrival times; the client keeps n requests in flight."""

    n: int

    def __post_init__(self) -> None:
        require(self.n >= 1, f"concurrency must be >= 1, got {self.n}")

    def scaled(self, factor: float) -> Concurrency:
        return Concurrency(max(1, round(self.n * factor)))


@dataclass(frozen=True)
class Replay:
    """Arrival times replayed from a trace, already offset and scaled (see traces.load_trace)."""

    arrivals_s: tuple[float, ...]  # sorted
    source: str  # what was loaded, for describe()
    time_scale: float = 1.0

    def times(self, rng: Rng, max_n: int | None, duration_s: float | None) -> FloatArray:
        check_caps(max_n, duration_s)
        times = np.asarray(self.arrivals_s[:max_n], dtype=np.float64)
        return times[times < duration_s] if duration_s is not None else times

    def scaled(self, factor: float) -> Replay:
        return Replay(tuple(t / factor for t in self.arrivals_s), self.source, self.time_scale / factor)

    def describe(self) -> str:
        n, span = len(self.arrivals_s), self.arrivals_s[-1]
        rate = f"{n / span:.3g} req/s" if span > 0 else "all at 0"
        return f"trace({self.source}, time_scale={self.time_scale:.4g}: {n} arrivals in {span:.4g} s, {rate})"


# --- rate steps -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Step(_Described):
    """`step(at_s, for_s, factor)`: the class's arrival rate times `factor` from `at_s` for `for_s`
    seconds (0 = no arrivals then). Steps that overlap multiply."""

    at_s: float  # seconds after the start
    for_s: float
    factor: float

    def __post_init__(self) -> None:
        ok = self.at_s >= 0 and math.isfinite(self.at_s)
        require(ok, f"at_s must be a finite number >= 0, got {self.at_s}")
        check_positive("for_s", self.for_s)
        ok = self.factor >= 0 and math.isfinite(self.factor)
        require(ok, f"factor must be a finite number >= 0, got {self.factor}")

    @property
    def end_s(self) -> float:
        return self.at_s + self.for_s


@dataclass(frozen=True)
class Stepped:
    """A renewal process (poisson, gamma, constant) whose rate is multiplied, piecewise, by steps.

    Drawn by a change of time: the base process runs in "operational time" u, and each arrival is
    placed at the t where Λ(t) = u, Λ(t) being the integral of the rate multiplier from 0 to t. For
    Poisson that is exactly the Poisson process of rate `rate · multiplier(t)` (the time-change
    theorem); constant arrivals come `factor` times as often during a step; gamma gaps keep their
    shape and shrink by `factor` (within a step it is gamma(rate · factor, burstiness)). The draws
    are those of the base process, from the same stream: the same seed gives the same requests, and
    a step only moves arrival times, never changes the lengths drawn."""

    base: Poisson | Gamma | Constant
    steps: tuple[Step, ...]

    def __post_init__(self) -> None:
        require(bool(self.steps), "a stepped arrival process needs at least one step")

    def segments(self) -> tuple[FloatArray, FloatArray]:
        """(starts, multipliers): the multiplier is multipliers[k] from starts[k] to starts[k + 1]
        (the last one, 1, runs on for ever). starts[0] = 0."""
        edges = sorted({0.0, *(s.at_s for s in self.steps), *(s.end_s for s in self.steps)})
        factors = [math.prod(s.factor for s in self.steps if s.at_s <= start < s.end_s) for start in edges]
        return np.asarray(edges, dtype=np.float64), np.asarray(factors, dtype=np.float64)

    def operational(self, t: float) -> float:
        """Λ(t): the integral of the multiplier from 0 to t, in seconds of the base process."""
        starts, mult = self.segments()
        ends = np.append(starts[1:], np.inf)
        return float(np.sum(mult * np.clip(np.minimum(ends, t) - starts, 0.0, None)))

    def times(self, rng: Rng, max_n: int | None, duration_s: float | None) -> FloatArray:
        check_caps(max_n, duration_s)
        until = None if duration_s is None else self.operational(duration_s)
        if until is not None and until <= 0:  # a pause from 0 to the end: nothing arrives
            return np.zeros(0)
        u = self.base.times(rng, max_n, until)
        starts, mult = self.segments()
        lengths = np.diff(starts) * mult[:-1]
        cum = np.concatenate([[0.0], np.cumsum(lengths)])  # Λ at each start
        # The segment holding u: the last whose Λ(start) <= u. side="right" skips the segments of
        # factor 0 (their Λ does not grow): an arrival at the very start of a pause comes at its end.
        k = np.searchsorted(cum, u, side="right") - 1
        times: FloatArray = starts[k] + (u - cum[k]) / mult[k]
        return times[times < duration_s] if duration_s is not None else times  # rounding at the end

    def scaled(self, factor: float) -> Stepped:
        return replace(self, base=self.base.scaled(factor))

    def describe(self) -> str:
        return " ".join([self.base.describe(), *(s.describe() for s in self.steps)])


Arrival = Poisson | Gamma | Constant | Concurrency | Replay | Stepped


# --- lengths (all >= 1) -----------------------------------------------------------------------


@dataclass(frozen=True)
class Fixed(_Described):
    n: int

    def __post_init__(self) -> None:
        require(self.n >= 1, f"a length must be >= 1, got {self.n}")

    def sample(self, rng: Rng, size: int) -> IntArray:
        return np.full(size, self.n, dtype=np.int64)


@dataclass(frozen=True)
class Uniform(_Described):
    lo: int  # inclusive
    hi: int  # inclusive

    def __post_init__(self) -> None:
        require(1 <= self.lo <= self.hi, f"uniform needs 1 <= lo <= hi, got lo={self.lo}, hi={self.hi}")

    def sample(self, rng: Rng, size: int) -> IntArray:
        return rng.integers(self.lo, self.hi, size, dtype=np.int64, endpoint=True)


@dataclass(frozen=True)
class Lognormal(_Described):
    median: float
    sigma: float  # of the log; 0 = always the median
    min: int = 1  # draws are clipped to [min, max] rather than redrawn, to keep the count exact
    max: int | None = None

    def __post_init__(self) -> None:
        check_positive("median", self.median)
        require(self.sigma >= 0 and math.isfinite(self.sigma), f"sigma must be >= 0, got {self.sigma}")
        ok = self.min >= 1 and (self.max is None or self.max >= self.min)
        require(ok, f"lognormal needs 1 <= min <= max, got min={self.min}, max={self.max}")

    def sample(self, rng: Rng, size: int) -> IntArray:
        draws = np.rint(rng.lognormal(math.log(self.median), self.sigma, size))
        return np.clip(draws, self.min, self.max or 1 << 31).astype(np.int64)


@dataclass(frozen=True)
class Empirical:
    """Draws, with replacement, from observed lengths (e.g. a CSV column)."""

    values: tuple[int, ...]
    source: str = ""  # where the values came from, for describe()

    def __post_init__(self) -> None:
        require(bool(self.values) and min(self.values) >= 1, "empirical needs values, all >= 1")

    def sample(self, rng: Rng, size: int) -> IntArray:
        return np.asarray(self.values, dtype=np.int64)[rng.integers(0, len(self.values), size)]

    def describe(self) -> str:
        if self.source:
            return f"empirical({self.source}: {len(self.values)} values, median {np.median(self.values):g})"
        return f"empirical({', '.join(map(str, self.values[:8]))}{', ...' if len(self.values) > 8 else ''})"


LengthDist = Fixed | Uniform | Lognormal | Empirical


@dataclass(frozen=True)
class SyntheticLengths:
    """Prompt and output lengths drawn independently, each from its own stream."""

    prompt: LengthDist
    output: LengthDist

    def draw(self, rng_prompt: Rng, rng_output: Rng, n: int) -> tuple[IntArray, IntArray]:
        return self.prompt.sample(rng_prompt, n), self.output.sample(rng_output, n)

    def describe(self) -> str:
        return f"prompt={self.prompt.describe()} output={self.output.describe()}"


@dataclass(frozen=True)
class LengthRows:
    """(prompt, output) rows of a CSV, kept paired (a long prompt's output stays its own): drawn
    at random, or in file order wrapping around. Already scaled and clipped (see traces.load_lengths)."""

    prompts: tuple[int, ...]
    outputs: tuple[int, ...]
    source: str
    order: Literal["sample", "file"] = "sample"

    def draw(self, rng_prompt: Rng, rng_output: Rng, n: int) -> tuple[IntArray, IntArray]:
        if self.order == "sample":
            rows = rng_prompt.integers(0, len(self.prompts), n)
        else:
            rows = np.arange(n) % len(self.prompts)
        return np.asarray(self.prompts, dtype=np.int64)[rows], np.asarray(self.outputs, dtype=np.int64)[rows]

    def describe(self) -> str:
        medians = f"median prompt {np.median(self.prompts):g}, output {np.median(self.outputs):g}"
        return f"lengths({self.source}, order={self.order}: {len(self.prompts)} rows, {medians})"


Lengths = SyntheticLengths | LengthRows
