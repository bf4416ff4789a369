"""The workload of `pdserve bench`: which requests are sent, and when. No torch; numpy only.

A workload is one or more classes (name + arrival process + lengths), each drawing its own
arrival stream; the streams are merged by arrival time and cut at `max_requests` and/or
`duration_s`, whichever comes first. It is pure: the same classes, caps and seed give the same
requests.

The command-line spec (`parse_workload`):

    spec  := PRESET | class (';' class)*          PRESET: a key of NAMED_MIXES, e.g. "chat+docs"
    class := [NAME ':'] item ...                  a single unnamed class is called "default"
    item  := poisson(rate) | gamma(rate, burstiness) | constant(rate) | concurrency(n)
           | prompt=DIST | output=DIST
           | lengths(path, order=sample|file, length_scale=1, max_prompt_tokens, max_output_tokens)
           | trace(path, time_scale | rate, length_scale=1, max_prompt_tokens, max_output_tokens, start_s=0)
    DIST  := fixed(n) | uniform(lo, hi) | lognormal(median, sigma, min=1, max=none)
           | empirical(v1, v2, ...) | empirical(path, column)

Arguments are positional (in that order) or name=value. `trace(...)` brings its own arrival times
and lengths (see load_trace); `lengths(...)` takes (prompt, output) rows of a CSV, kept paired, and
needs an arrival process. Load is scaled by the `rate_scale` argument of `parse_workload` (not in
the spec): it multiplies every class's rate (a trace is replayed that much faster) and the n of
`concurrency(n)`; `describe()` shows the scaled values.
"""

from __future__ import annotations

import csv
import difflib
import inspect
import math
import re
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal, Self

import numpy as np
import numpy.typing as npt

from pdserve.errors import PdserveError

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
Rng = np.random.Generator

ARRIVED_COL, PROMPT_COL, OUTPUT_COL = "arrived_at", "num_prefill_tokens", "num_decode_tokens"


class WorkloadError(PdserveError, ValueError):
    """A workload spec, a trace file or a parameter is wrong; the message says what and where."""


@dataclass(frozen=True)
class RequestSpec:
    index: int
    cls: str  # the class name
    arrival_s: float | None  # seconds after the start; None in closed-loop (concurrency) mode
    prompt_tokens: int
    output_tokens: int


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise WorkloadError(message)


def _positive(name: str, value: float) -> None:
    _require(value > 0 and math.isfinite(value), f"{name} must be a finite number > 0, got {value}")


def _check_caps(max_n: int | None, duration_s: float | None) -> None:
    _require(max_n is not None or duration_s is not None, "give max_requests and/or duration_s")
    _require(max_n is None or max_n >= 1, f"max_requests must be >= 1, got {max_n}")
    if duration_s is not None:
        _positive("duration_s", duration_s)


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
        _positive("rate", self.rate)

    def _gaps(self, rng: Rng, size: int) -> FloatArray:
        raise NotImplementedError

    def times(self, rng: Rng, max_n: int | None, duration_s: float | None) -> FloatArray:
        """Arrival times in seconds after the start: at most max_n, all before duration_s."""
        _check_caps(max_n, duration_s)
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
        _positive("burstiness", self.burstiness)

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
        _require(self.n >= 1, f"concurrency must be >= 1, got {self.n}")

    def scaled(self, factor: float) -> Concurrency:
        return Concurrency(max(1, round(self.n * factor)))


@dataclass(frozen=True)
class Replay:
    """Arrival times replayed from a trace, already offset and scaled (see load_trace)."""

    arrivals_s: tuple[float, ...]  # sorted
    source: str  # what was loaded, for describe()
    time_scale: float = 1.0

    def times(self, rng: Rng, max_n: int | None, duration_s: float | None) -> FloatArray:
        _check_caps(max_n, duration_s)
        times = np.asarray(self.arrivals_s[:max_n], dtype=np.float64)
        return times[times < duration_s] if duration_s is not None else times

    def scaled(self, factor: float) -> Replay:
        return Replay(tuple(t / factor for t in self.arrivals_s), self.source, self.time_scale / factor)

    def describe(self) -> str:
        n, span = len(self.arrivals_s), self.arrivals_s[-1]
        rate = f"{n / span:.3g} req/s" if span > 0 else "all at 0"
        return f"trace({self.source}, time_scale={self.time_scale:.4g}: {n} arrivals in {span:.4g} s, {rate})"


Arrival = Poisson | Gamma | Constant | Concurrency | Replay


# --- lengths (all >= 1) -----------------------------------------------------------------------


@dataclass(frozen=True)
class Fixed(_Described):
    n: int

    def __post_init__(self) -> None:
        _require(self.n >= 1, f"a length must be >= 1, got {self.n}")

    def sample(self, rng: Rng, size: int) -> IntArray:
        return np.full(size, self.n, dtype=np.int64)


@dataclass(frozen=True)
class Uniform(_Described):
    lo: int  # inclusive
    hi: int  # inclusive

    def __post_init__(self) -> None:
        _require(1 <= self.lo <= self.hi, f"uniform needs 1 <= lo <= hi, got lo={self.lo}, hi={self.hi}")

    def sample(self, rng: Rng, size: int) -> IntArray:
        return rng.integers(self.lo, self.hi, size, dtype=np.int64, endpoint=True)


@dataclass(frozen=True)
class Lognormal(_Described):
    median: float
    sigma: float  # of the log; 0 = always the median
    min: int = 1  # draws are clipped to [min, max] rather than redrawn, to keep the count exact
    max: int | None = None

    def __post_init__(self) -> None:
        _positive("median", self.median)
        _require(self.sigma >= 0 and math.isfinite(self.sigma), f"sigma must be >= 0, got {self.sigma}")
        ok = self.min >= 1 and (self.max is None or self.max >= self.min)
        _require(ok, f"lognormal needs 1 <= min <= max, got min={self.min}, max={self.max}")

    def sample(self, rng: Rng, size: int) -> IntArray:
        draws = np.rint(rng.lognormal(math.log(self.median), self.sigma, size))
        return np.clip(draws, self.min, self.max or 1 << 31).astype(np.int64)


@dataclass(frozen=True)
class Empirical:
    """Draws, with replacement, from observed lengths (e.g. a CSV column)."""

    values: tuple[int, ...]
    source: str = ""  # where the values came from, for describe()

    def __post_init__(self) -> None:
        _require(bool(self.values) and min(self.values) >= 1, "empirical needs values, all >= 1")

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
    at random, or in file order wrapping around. Already scaled and clipped (see load_lengths)."""

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


# --- CSV files --------------------------------------------------------------------------------


def _read_columns(path: str | Path, columns: Sequence[str]) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {c: [] for c in columns}
    try:
        with Path(path).open(newline="") as f:
            reader = csv.DictReader(f, skipinitialspace=True)
            header = list(reader.fieldnames or [])
            missing = [c for c in columns if c not in header]
            found = ", ".join(header) or "nothing (empty file)"
            _require(not missing, f"{path}: missing column(s) {', '.join(missing)}; found: {found}")
            for row in reader:
                for c in columns:
                    raw = row[c]
                    try:
                        value = float(raw)
                    except (TypeError, ValueError):  # TypeError: a short row gives None
                        raise WorkloadError(
                            f"{path}:{reader.line_num}: bad number {raw!r} in column {c}"
                        ) from None
                    ok = value >= 0 and math.isfinite(value)
                    _require(ok, f"{path}:{reader.line_num}: {c} must be finite and >= 0, got {raw!r}")
                    out[c].append(value)
    except OSError as e:
        raise WorkloadError(f"cannot read {path}: {e.strerror}") from None
    _require(bool(out[columns[0]]), f"{path}: no rows")
    return out


def _tokens(values: Sequence[float], scale: float, cap: int | None) -> tuple[int, ...]:
    counts = np.maximum(1, np.rint(np.asarray(values) * scale)).astype(np.int64)
    return tuple((np.minimum(counts, cap) if cap is not None else counts).tolist())


def _source(path: str | Path, **options: Any) -> str:
    shown = [
        f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}" for k, v in options.items() if v is not None
    ]
    return ", ".join([f"path={path}", *shown])


def _length_options(scale: float, max_prompt: int | None, max_output: int | None) -> dict[str, Any]:
    _positive("length_scale", scale)
    for name, cap in (("max_prompt_tokens", max_prompt), ("max_output_tokens", max_output)):
        _require(cap is None or cap >= 1, f"{name} must be >= 1, got {cap}")
    scaled = scale if scale != 1 else None
    return {"length_scale": scaled, "max_prompt_tokens": max_prompt, "max_output_tokens": max_output}


def load_lengths(
    path: str | Path,
    order: str = "sample",
    length_scale: float = 1.0,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
) -> LengthRows:
    """Rows of num_prefill_tokens, num_decode_tokens (other columns ignored). Token counts are
    multiplied by length_scale and rounded (at least 1), then clipped to the maxima."""
    _require(order in ("sample", "file"), f"order must be 'sample' or 'file', got {order!r}")
    shown = _length_options(length_scale, max_prompt_tokens, max_output_tokens)
    cols = _read_columns(path, [PROMPT_COL, OUTPUT_COL])
    return LengthRows(
        _tokens(cols[PROMPT_COL], length_scale, max_prompt_tokens),
        _tokens(cols[OUTPUT_COL], length_scale, max_output_tokens),
        _source(path, **shown),
        "file" if order == "file" else "sample",
    )


def load_trace(
    path: str | Path,
    time_scale: float | None = None,
    rate: float | None = None,
    length_scale: float = 1.0,
    max_prompt_tokens: int | None = None,
    max_output_tokens: int | None = None,
    start_s: float = 0.0,
) -> tuple[Replay, LengthRows]:
    """A trace of arrived_at, num_prefill_tokens, num_decode_tokens, for replay.

    Rows arriving before start_s are skipped and the others moved start_s earlier. Their times are
    then multiplied by time_scale (0.5 = twice as fast), or scaled so that the mean rate (rows /
    last arrival) becomes `rate`. Lengths as in load_lengths, in file order, so that request i of
    a replay gets row i's arrival and lengths."""
    _require(time_scale is None or rate is None, "give time_scale or rate, not both")
    for name, value in (("time_scale", time_scale), ("rate", rate)):
        if value is not None:
            _positive(name, value)
    _require(start_s >= 0 and math.isfinite(start_s), f"start_s must be finite and >= 0, got {start_s}")
    shown = _length_options(length_scale, max_prompt_tokens, max_output_tokens)
    cols = _read_columns(path, [ARRIVED_COL, PROMPT_COL, OUTPUT_COL])
    arrived = np.asarray(cols[ARRIVED_COL])
    rows = np.argsort(arrived, kind="stable")  # a trace should be sorted; if not, rows stay paired
    rows = rows[arrived[rows] >= start_s]
    _require(rows.size > 0, f"{path}: no arrivals at or after start_s={start_s} (last: {arrived.max():g} s)")
    times = arrived[rows] - start_s
    if rate is not None:
        _require(times[-1] > 0, f"{path}: every arrival is at the same time; no rate to rescale")
        time_scale = rows.size / times[-1] / rate
    scale = 1.0 if time_scale is None else time_scale
    source = _source(path, start_s=start_s or None, rate=rate, **shown)
    prompts = _tokens([cols[PROMPT_COL][i] for i in rows], length_scale, max_prompt_tokens)
    outputs = _tokens([cols[OUTPUT_COL][i] for i in rows], length_scale, max_output_tokens)
    return Replay(tuple((times * scale).tolist()), source, scale), LengthRows(
        prompts, outputs, source, "file"
    )


def _empirical_values(*values: int) -> Empirical:
    return Empirical(values)


def _empirical_column(path: str, column: str) -> Empirical:
    return Empirical(_tokens(_read_columns(path, [column])[column], 1.0, None), _source(path, column=column))


# --- classes and workloads --------------------------------------------------------------------

_NAME = r"[A-Za-z_][\w.+-]*"


@dataclass(frozen=True)
class WorkloadClass:
    name: str
    arrival: Arrival
    lengths: Lengths

    def __post_init__(self) -> None:
        _require(re.fullmatch(_NAME, self.name) is not None, f"bad class name {self.name!r}")

    def scaled(self, factor: float) -> WorkloadClass:
        return replace(self, arrival=self.arrival.scaled(factor))

    def describe(self) -> str:
        return f"{self.name}: {self.arrival.describe()} {self.lengths.describe()}"


def class_rngs(seed: int, name: str) -> tuple[Rng, Rng, Rng]:
    """The (arrival, prompt, output) streams of a class. Keyed by the class's name, not its
    position, so that adding, removing or reordering classes leaves every other class's draws as
    they were; three streams, so that changing a length distribution keeps the arrival times."""
    seq = np.random.SeedSequence(seed, spawn_key=(zlib.crc32(name.encode()),))
    arrival, prompt, output = (np.random.default_rng(s) for s in seq.spawn(3))
    return arrival, prompt, output


@dataclass(frozen=True)
class Workload:
    classes: tuple[WorkloadClass, ...]
    seed: int
    max_requests: int | None
    duration_s: float | None
    requests: list[RequestSpec]  # by arrival time; index = position
    spec: str = ""  # the text it was parsed from, if any

    @property
    def concurrency(self) -> int | None:
        """The n of a closed-loop workload (the client keeps n requests in flight), else None."""
        arrival = self.classes[0].arrival
        return arrival.n if isinstance(arrival, Concurrency) else None

    def describe(self) -> str:
        counts = Counter(r.cls for r in self.requests)
        return "\n".join(f"{c.describe()}  [{counts[c.name]} requests]" for c in self.classes)


def build_workload(
    classes: Sequence[WorkloadClass],
    seed: int = 0,
    max_requests: int | None = None,
    duration_s: float | None = None,
    spec: str = "",
) -> Workload:
    """Draw every class's stream, merge them by arrival time, cut at max_requests / duration_s."""
    _require(len(classes) > 0, "a workload needs at least one class")
    _require(seed >= 0, f"seed must be >= 0, got {seed}")
    _check_caps(max_requests, duration_s)
    repeated = [n for n, k in Counter(c.name for c in classes).items() if k > 1]
    _require(not repeated, f"class names must be unique; repeated: {', '.join(repeated)}")
    first = classes[0]
    if any(isinstance(c.arrival, Concurrency) for c in classes):
        _require(len(classes) == 1, "concurrency(n) is a closed loop and must be the only class")
        _require(
            max_requests is not None, "concurrency(n) needs max_requests (a closed loop has no arrival times)"
        )
        assert max_requests is not None
        _, rng_prompt, rng_output = class_rngs(seed, first.name)
        prompts, outputs = first.lengths.draw(rng_prompt, rng_output, max_requests)
        pairs = zip(prompts.tolist(), outputs.tolist(), strict=True)
        requests = [RequestSpec(i, first.name, None, p, o) for i, (p, o) in enumerate(pairs)]
        return Workload(tuple(classes), seed, max_requests, duration_s, requests, spec)
    # Each class draws as if it were alone (up to max_requests of its own): the merge only picks
    # which draws make the cut and never changes them.
    merged: list[tuple[float, int, int, int, int]] = []
    for k, c in enumerate(classes):
        assert not isinstance(c.arrival, Concurrency)
        rng_arrival, rng_prompt, rng_output = class_rngs(seed, c.name)
        times = c.arrival.times(rng_arrival, max_requests, duration_s)
        prompts, outputs = c.lengths.draw(rng_prompt, rng_output, times.size)
        n = times.size
        merged += zip(times.tolist(), [k] * n, range(n), prompts.tolist(), outputs.tolist(), strict=True)
    merged.sort()  # ties: class order, then draw order
    requests = [
        RequestSpec(i, classes[k].name, t, p, o) for i, (t, k, _, p, o) in enumerate(merged[:max_requests])
    ]
    return Workload(tuple(classes), seed, max_requests, duration_s, requests, spec)


# --- the command-line spec --------------------------------------------------------------------

# Named mixes for SmolLM2-135M on a 2-core CPU (sized by hand, not measured; see rate_scale).
# chat: about one short turn a second (prompt mean ~113 tokens, 16..400; output 32..96, mean 64).
# chat+docs: the same chat plus a 1500-token document with a 16-token answer every 5 s: the long
# prefill that stalls colocated decoding, and that disaggregation should keep off chat's ITL.
_CHAT = "prompt=lognormal(median=100, sigma=0.5, min=16, max=400) output=uniform(32, 96)"
NAMED_MIXES: dict[str, str] = {
    "chat": f"chat: poisson(rate=1) {_CHAT}",
    "chat-bursty": f"chat: gamma(rate=1, burstiness=0.5) {_CHAT}",
    "chat+docs": f"chat: poisson(rate=1) {_CHAT}; docs: constant(rate=0.2) prompt=fixed(1500) output=fixed(16)",
}

_ARRIVALS: dict[str, Callable[..., Any]] = {
    "poisson": Poisson, "gamma": Gamma, "constant": Constant, "concurrency": Concurrency
}  # fmt: skip
_SOURCES: dict[str, Callable[..., Any]] = {"trace": load_trace, "lengths": load_lengths}
_DISTS: dict[str, Callable[..., Any]] = {
    "fixed": Fixed, "uniform": Uniform, "lognormal": Lognormal, "empirical": _empirical_column
}  # fmt: skip


@dataclass(frozen=True)
class _Call:
    key: str | None  # "prompt" in prompt=fixed(3)
    fn: str
    args: list[tuple[str | None, str]]  # (name or None, raw value)
    text: str


def _split(text: str, start: int, sep: str) -> tuple[list[str], int]:
    """Split text[start:] at sep outside quotes and parentheses, up to an unmatched ')'; returns
    the parts and where they ended (the index of that ')', else len(text))."""
    parts: list[str] = []
    depth, quote, begin = 0, "", start
    for i in range(start, len(text)):
        ch = text[i]
        if quote or ch in "'\"":
            quote = "" if ch == quote else quote or ch
        elif ch == ")" and depth == 0:
            return [*parts, text[begin:i]], i
        elif ch in "()":
            depth += 1 if ch == "(" else -1
        elif ch == sep and depth == 0:
            parts.append(text[begin:i])
            begin = i + 1
    return [*parts, text[begin:]], len(text)


_CALL = re.compile(r"\s*(?:([A-Za-z_]\w*)\s*=\s*)?([A-Za-z_]\w*)\s*\(")


def _scan_calls(text: str) -> list[_Call]:
    calls, pos = [], 0
    while text[pos:].strip():
        m = _CALL.match(text, pos)
        _require(m is not None, f"expected name(...) or prompt=/output=name(...) at '{text[pos:].strip()}'")
        assert m is not None
        parts, close = _split(text, m.end(), ",")
        _require(close < len(text), f"missing ')' in '{text[m.start() :].strip()}'")
        args: list[tuple[str | None, str]] = []
        for arg in parts if "".join(parts).strip() else []:
            kw = re.fullmatch(r"\s*([A-Za-z_]\w*)\s*=(.*)", arg, re.S)
            key, value = (kw.group(1), kw.group(2)) if kw else (None, arg)
            args.append((key, value.strip().strip("'\"")))
        calls.append(_Call(m.group(1), m.group(2), args, text[m.start() : close + 1].strip()))
        pos = close + 1
    return calls


def _whole(text: str) -> int:
    value = float(text)
    if not value.is_integer():
        raise ValueError(text)
    return int(value)


def _unknown(what: str, name: str, call: _Call, known: Sequence[str]) -> WorkloadError:
    close = difflib.get_close_matches(name, known, n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    return WorkloadError(f"unknown {what} '{name}' in '{call.text}'; known: {', '.join(known)}{hint}")


def _make(call: _Call, table: dict[str, Callable[..., Any]]) -> Any:
    """Bind a call's arguments to the parameters of the function or dataclass it names, convert
    each by its annotation (int: a whole number; float; else text) and call it."""
    fn = table[call.fn]
    if call.fn == "empirical" and all(k is None and re.fullmatch(r"[\d.eE+-]+", v) for k, v in call.args):
        fn = _empirical_values  # the list form, empirical(v1, v2, ...), rather than (path, column)
    sig = inspect.signature(fn)
    keys = [k for k, _ in call.args if k is not None]
    _require(len(keys) == len(set(keys)), f"an argument is given twice in '{call.text}'")
    try:
        bound = sig.bind(
            *[v for k, v in call.args if k is None], **{k: v for k, v in call.args if k is not None}
        )
    except TypeError as e:
        raise WorkloadError(f"{e} in '{call.text}'; {call.fn} takes {', '.join(sig.parameters)}") from None
    for name, raw in bound.arguments.items():
        kind = str(sig.parameters[name].annotation)
        convert: Callable[[str], Any] = _whole if "int" in kind else float if "float" in kind else str
        converted = []
        for text in raw if isinstance(raw, tuple) else (raw,):  # a tuple: *values
            try:
                converted.append(None if text.lower() == "none" and "None" in kind else convert(text))
            except ValueError:
                expected = "a whole number" if convert is _whole else "a number"
                raise WorkloadError(
                    f"bad value '{text}' for {name} in '{call.text}': expected {expected}"
                ) from None
        bound.arguments[name] = tuple(converted) if isinstance(raw, tuple) else converted[0]
    try:
        return fn(*bound.args, **bound.kwargs)
    except WorkloadError as e:
        raise WorkloadError(f"{e} (in '{call.text}')") from None


def _parse_class(text: str, name: str | None) -> WorkloadClass:
    named = re.match(rf"\s*({_NAME})\s*:", text)
    if named:
        name, text = named.group(1), text[named.end() :]
    where = f"'{text.strip()}'"
    _require(name is not None, f"with several classes, each needs a name ('chat: ...; docs: ...'): {where}")
    assert name is not None
    arrival: Arrival | None = None
    rows: LengthRows | None = None
    dists: dict[str, LengthDist] = {}
    given: dict[str, str] = {}  # what -> the call that gave it, to name both in a clash

    def claim(what: str, call: _Call) -> None:
        _require(what not in given, f"two {what} in {where}: '{given.get(what)}' and '{call.text}'")
        given[what] = call.text

    for call in _scan_calls(text):
        if call.key is None and call.fn in _ARRIVALS:
            claim("arrival processes", call)
            arrival = _make(call, _ARRIVALS)
        elif call.key is None and call.fn in _SOURCES:
            if call.fn == "trace":  # brings its own arrival times
                claim("arrival processes", call)
            claim("length sources", call)
            made = _make(call, _SOURCES)
            arrival, rows = made if call.fn == "trace" else (arrival, made)
        elif call.key is None:
            raise _unknown("arrival process", call.fn, call, [*_ARRIVALS, *_SOURCES])
        elif call.key not in ("prompt", "output"):
            raise WorkloadError(f"unknown key '{call.key}' in '{call.text}'; known: prompt, output")
        elif call.fn not in _DISTS:
            raise _unknown("distribution", call.fn, call, list(_DISTS))
        else:
            claim(f"{call.key}= lengths", call)
            dists[call.key] = _make(call, _DISTS)
    if arrival is None:
        raise WorkloadError(
            f"no arrival process in {where}; add one of {', '.join(_ARRIVALS)}, or a trace(path)"
        )
    if rows is not None:
        drop = " and ".join(k + "=" for k in dists)
        _require(not dists, f"'{given['length sources']}' gives both lengths; drop {drop}")
        return WorkloadClass(name, arrival, rows)
    missing = " and ".join(k + "=" for k in ("prompt", "output") if k not in dists)
    _require(not missing, f"missing {missing} in {where} (or use lengths(path))")
    return WorkloadClass(name, arrival, SyntheticLengths(dists["prompt"], dists["output"]))


def parse_classes(spec: str, rate_scale: float = 1.0) -> list[WorkloadClass]:
    """The classes of a spec or preset name (see the module docstring), load scaled by rate_scale."""
    _positive("rate_scale", rate_scale)
    text = spec.strip()
    if text and "(" not in text:
        known = ", ".join(NAMED_MIXES)
        _require(text in NAMED_MIXES, f"unknown preset '{text}'; known: {known} (or a spec such as 'poisson(2) prompt=fixed(128) output=fixed(64)')")  # fmt: skip
        text = NAMED_MIXES[text]
    parts, end = _split(text, 0, ";")
    _require(end == len(text), f"unmatched ')' in '{text[: end + 1]}'")
    parts = [p for p in parts if p.strip()]
    _require(bool(parts), "empty workload spec")
    classes = [_parse_class(p, "default" if len(parts) == 1 else None) for p in parts]
    return [c.scaled(rate_scale) for c in classes] if rate_scale != 1 else classes


def parse_workload(
    spec: str,
    seed: int = 0,
    max_requests: int | None = None,
    duration_s: float | None = None,
    rate_scale: float = 1.0,
) -> Workload:
    """Parse a spec or preset name (see the module docstring) and draw its requests."""
    classes = parse_classes(spec, rate_scale)
    return build_workload(classes, seed=seed, max_requests=max_requests, duration_s=duration_s, spec=spec)
