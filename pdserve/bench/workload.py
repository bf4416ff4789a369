"""The workload of `pdserve bench`: which requests are sent, and when. No torch; numpy only.

A workload is one or more classes (name + arrival process + lengths), each drawing its own
arrival stream; the streams are merged by arrival time and cut at `max_requests` and/or
`duration_s`, whichever comes first. It is pure: the same classes, caps and seed give the same
requests.

The command-line spec (`parse_workload`):

    spec  := PRESET | class (';' class)*          PRESET: a key of NAMED_MIXES, e.g. "chat+docs"
    class := [NAME ':'] item ...                  a single unnamed class is called "default"
    item  := poisson(rate) | gamma(rate, burstiness) | constant(rate) | concurrency(n)
           | step(at_s, for_s, factor)               repeatable; with poisson, gamma or constant
           | prompt=DIST | output=DIST
           | turns=DIST followup=DIST think=DIST     conversations (pdserve/bench/conversations.py):
                                                   turns each, followup new tokens a turn, think ms
           | lengths(path, order=sample|file, length_scale=1, max_prompt_tokens, max_output_tokens)
           | trace(path, time_scale | rate, length_scale=1, max_prompt_tokens, max_output_tokens, start_s=0)
    DIST  := fixed(n) | uniform(lo, hi) | lognormal(median, sigma, min=1, max=none)
           | empirical(v1, v2, ...) | empirical(path, column)

Arguments are positional (in that order) or name=value. `trace(...)` brings its own arrival times
and lengths (see traces.load_trace); `lengths(...)` takes (prompt, output) rows of a CSV, kept
paired, and needs an arrival process. `step(at_s, for_s, factor)` multiplies the class's rate by
`factor` from `at_s` for `for_s` seconds (0: a pause; steps that overlap multiply; see
distributions.Stepped for how it is drawn); a closed loop (concurrency) and a trace have no rate
to step. Load is scaled by the `rate_scale` argument of
`parse_workload` (not in the spec): it multiplies every class's rate (a trace is replayed that
much faster) and the n of `concurrency(n)`; `describe()` shows the scaled values.

The arrival processes and length distributions are in pdserve.bench.distributions, the CSV readers
in pdserve.bench.traces; this module builds classes and workloads from them and parses the spec.
"""

from __future__ import annotations

import difflib
import inspect
import re
import zlib
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from pdserve.bench.conversations import Session
from pdserve.bench.distributions import (
    Arrival,
    Concurrency,
    Constant,
    Empirical,
    Fixed,
    Gamma,
    LengthDist,
    LengthRows,
    Lengths,
    Lognormal,
    Poisson,
    Replay,
    Rng,
    Step,
    Stepped,
    SyntheticLengths,
    Uniform,
    WorkloadError,
    check_caps,
    check_positive,
    require,
)
from pdserve.bench.traces import empirical_column, load_lengths, load_trace


@dataclass(frozen=True)
class RequestSpec:
    index: int
    cls: str  # the class name
    arrival_s: float | None  # seconds after the start; None in closed-loop (concurrency) mode
    prompt_tokens: int  # a later turn of a conversation: its new tokens (the rest is the conversation)
    output_tokens: int
    session: int | None = None  # a conversation's turn: the index of its first (bench/conversations.py)
    turn: int = 0  # 0: the first (or only) turn; later turns have no planned send time
    think_s: float = 0.0  # a later turn: sent this long after the answer before it ended


# --- classes and workloads --------------------------------------------------------------------

_NAME = r"[A-Za-z_][\w.+-]*"


@dataclass(frozen=True)
class WorkloadClass:
    name: str
    arrival: Arrival
    lengths: Lengths
    session: Session | None = None  # a class of conversations: the arrivals start them

    def __post_init__(self) -> None:
        require(re.fullmatch(_NAME, self.name) is not None, f"bad class name {self.name!r}")

    def scaled(self, factor: float) -> WorkloadClass:
        return replace(self, arrival=self.arrival.scaled(factor))

    def describe(self) -> str:
        session = f" {self.session.describe()}" if self.session else ""
        return f"{self.name}: {self.arrival.describe()} {self.lengths.describe()}{session}"


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

    @property
    def steps(self) -> list[tuple[str, Step]]:
        """(class name, step) of every class's rate steps, by start time."""
        found = [(c.name, s) for c in self.classes if isinstance(c.arrival, Stepped) for s in c.arrival.steps]
        return sorted(found, key=lambda item: (item[1].at_s, item[1].for_s))

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
    require(len(classes) > 0, "a workload needs at least one class")
    require(seed >= 0, f"seed must be >= 0, got {seed}")
    check_caps(max_requests, duration_s)
    repeated = [n for n, k in Counter(c.name for c in classes).items() if k > 1]
    require(not repeated, f"class names must be unique; repeated: {', '.join(repeated)}")
    for c in classes:
        for step in c.arrival.steps if isinstance(c.arrival, Stepped) else ():
            if duration_s is not None and step.at_s >= duration_s:
                raise WorkloadError(
                    f"class {c.name}: {step.describe()} starts after the run ends ({duration_s:g} s)"
                )
    first = classes[0]
    if any(isinstance(c.arrival, Concurrency) for c in classes):
        require(len(classes) == 1, "concurrency(n) is a closed loop and must be the only class")
        require(
            max_requests is not None, "concurrency(n) needs max_requests (a closed loop has no arrival times)"
        )
        assert max_requests is not None
        _, rng_prompt, rng_output = class_rngs(seed, first.name)
        prompts, outputs = first.lengths.draw(rng_prompt, rng_output, max_requests)
        pairs = zip(prompts.tolist(), outputs.tolist(), strict=True)
        closed = [RequestSpec(i, first.name, None, p, o) for i, (p, o) in enumerate(pairs)]
        return Workload(tuple(classes), seed, max_requests, duration_s, closed, spec)
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
    later = _later_turns(classes, seed, merged)
    requests: list[RequestSpec] = []
    for t, k, n, p, o in merged:  # each conversation's later turns right after its first
        session = len(requests) if (k, n) in later else None
        requests.append(RequestSpec(len(requests), classes[k].name, t, p, o, session))
        for turn, (followup, output, think_s) in enumerate(later.get((k, n), ()), start=1):
            requests.append(
                RequestSpec(len(requests), classes[k].name, None, followup, output, session, turn, think_s)
            )
    return Workload(tuple(classes), seed, max_requests, duration_s, requests[:max_requests], spec)


def _later_turns(
    classes: Sequence[WorkloadClass], seed: int, merged: list[tuple[float, int, int, int, int]]
) -> dict[tuple[int, int], list[tuple[int, int, float]]]:
    """(class, draw) of each conversation's first turn -> its later turns' (new prompt tokens,
    output tokens, think seconds)."""
    later: dict[tuple[int, int], list[tuple[int, int, float]]] = {}
    for k, c in enumerate(classes):
        if c.session is None:
            continue
        firsts = sorted(n for _, kk, n, _, _ in merged if kk == k)
        turns, followup_rng, think_rng = c.session.draw(seed, c.name, len(firsts))
        count = sum(t - 1 for t in turns)
        followups = c.session.followup.sample(followup_rng, count).tolist()
        thinks = c.session.think_ms.sample(think_rng, count).tolist()
        outputs = c.lengths.draw(followup_rng, think_rng, count)[1].tolist()
        at = 0
        for n, t in zip(firsts, turns, strict=True):
            later[(k, n)] = [(followups[i], outputs[i], thinks[i] / 1000) for i in range(at, at + t - 1)]
            at += t - 1
    return later


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
_STEPS: dict[str, Callable[..., Any]] = {"step": Step}
_DISTS: dict[str, Callable[..., Any]] = {
    "fixed": Fixed, "uniform": Uniform, "lognormal": Lognormal, "empirical": empirical_column
}  # fmt: skip


def _empirical_values(*values: int) -> Empirical:
    return Empirical(values)


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
        require(m is not None, f"expected name(...) or prompt=/output=name(...) at '{text[pos:].strip()}'")
        assert m is not None
        parts, close = _split(text, m.end(), ",")
        require(close < len(text), f"missing ')' in '{text[m.start() :].strip()}'")
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
    require(len(keys) == len(set(keys)), f"an argument is given twice in '{call.text}'")
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
    require(name is not None, f"with several classes, each needs a name ('chat: ...; docs: ...'): {where}")
    assert name is not None
    arrival: Arrival | None = None
    rows: LengthRows | None = None
    dists: dict[str, LengthDist] = {}
    steps: list[Step] = []
    given: dict[str, str] = {}  # what -> the call that gave it, to name both in a clash

    def claim(what: str, call: _Call) -> None:
        require(what not in given, f"two {what} in {where}: '{given.get(what)}' and '{call.text}'")
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
        elif call.key is None and call.fn in _STEPS:
            steps.append(_make(call, _STEPS))
        elif call.key is None:
            raise _unknown("arrival process", call.fn, call, [*_ARRIVALS, *_SOURCES, *_STEPS])
        elif call.key not in ("prompt", "output", *_SESSION_KEYS):
            known = ", ".join(("prompt", "output", *_SESSION_KEYS))
            raise WorkloadError(f"unknown key '{call.key}' in '{call.text}'; known: {known}")
        elif call.fn not in _DISTS:
            raise _unknown("distribution", call.fn, call, list(_DISTS))
        else:
            claim(f"{call.key}= lengths", call)
            dists[call.key] = _make(call, _DISTS)
    if arrival is None:
        raise WorkloadError(
            f"no arrival process in {where}; add one of {', '.join(_ARRIVALS)}, or a trace(path)"
        )
    if steps:
        arrival = _stepped(arrival, tuple(steps), given["arrival processes"])
    session = _session(dists, arrival, where)
    if rows is not None:
        drop = " and ".join(k + "=" for k in dists if k in ("prompt", "output"))
        require(not drop, f"'{given['length sources']}' gives both lengths; drop {drop}")
        return WorkloadClass(name, arrival, rows, session)
    missing = " and ".join(k + "=" for k in ("prompt", "output") if k not in dists)
    require(not missing, f"missing {missing} in {where} (or use lengths(path))")
    return WorkloadClass(name, arrival, SyntheticLengths(dists["prompt"], dists["output"]), session)


_SESSION_KEYS = ("turns", "followup", "think")


def _session(dists: dict[str, LengthDist], arrival: Arrival, where: str) -> Session | None:
    given = [k for k in _SESSION_KEYS if k in dists]
    if not given:
        return None
    missing = " and ".join(k + "=" for k in _SESSION_KEYS if k not in dists)
    require(
        not missing, f"conversations need turns=, followup= and think= together: missing {missing} in {where}"
    )
    require(
        not isinstance(arrival, Concurrency | Replay),
        f"conversations start at the arrivals of poisson, gamma or constant, not a closed loop or a trace: {where}",
    )
    return Session(dists["turns"], dists["followup"], dists["think"])


def _stepped(arrival: Arrival, steps: tuple[Step, ...], source: str) -> Stepped:
    if isinstance(arrival, Concurrency):
        raise WorkloadError(
            f"step(...) multiplies an arrival rate, and '{source}' is a closed loop with none; "
            "use poisson, gamma or constant arrivals"
        )
    if isinstance(arrival, Replay):
        raise WorkloadError(
            f"step(...) multiplies an arrival rate, and '{source}' replays its own arrival times; "
            "use poisson, gamma or constant arrivals (or scale the trace with time_scale or rate)"
        )
    assert not isinstance(arrival, Stepped)
    return Stepped(arrival, steps)


def parse_classes(spec: str, rate_scale: float = 1.0) -> list[WorkloadClass]:
    """The classes of a spec or preset name (see the module docstring), load scaled by rate_scale."""
    check_positive("rate_scale", rate_scale)
    text = spec.strip()
    if text and "(" not in text:
        known = ", ".join(NAMED_MIXES)
        require(text in NAMED_MIXES, f"unknown preset '{text}'; known: {known} (or a spec such as 'poisson(2) prompt=fixed(128) output=fixed(64)')")  # fmt: skip
        text = NAMED_MIXES[text]
    parts, end = _split(text, 0, ";")
    require(end == len(text), f"unmatched ')' in '{text[: end + 1]}'")
    parts = [p for p in parts if p.strip()]
    require(bool(parts), "empty workload spec")
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
