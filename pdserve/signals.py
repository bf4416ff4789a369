"""Per-phase signals, measured where they arise: the router records them, the planner and the path
choice read them. Pure Python, no torch.

Demand is counted at admission (a prompt when its path is chosen, a stream from then until the
request ends), not at completion, so a burst shows up before it has been served. Latencies are
the router's own records (TTFT per pool that produced the first token, every inter-token gap per
pool that streamed it). A prompt still waiting for its first token is a censored TTFT sample: its
age so far is a lower bound of its TTFT, so a queue that builds up is seen while it builds, not
only once it drains (`ttft_samples`). Step times come from the workers' load reports and feed the cost model;
the steps of a worker's first `cold_start_s` seconds are left out (page faults, allocator and
thread-pool warm-up make them slow and they say nothing about capacity).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pdserve.costmodel import Step, StepCostModel
from pdserve.slo import quantile


class Window:
    """Timed samples of the last `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, value: float, now: float) -> None:
        self._samples.append((now, value))
        self._trim(now)

    def _trim(self, now: float) -> None:
        edge = now - self.seconds
        while self._samples and self._samples[0][0] < edge:
            self._samples.popleft()

    def values(self, now: float, span: float | None = None) -> list[float]:
        """The values of the window (or of its last `span` seconds)."""
        self._trim(now)
        if span is None:
            return [v for _, v in self._samples]
        return [v for t, v in self._samples if t >= now - span]

    def count(self, now: float) -> int:
        self._trim(now)
        return len(self._samples)

    def rate(self, now: float, span: float | None = None) -> float:
        """Sum of the values per second over the window (or over the last `span` seconds)."""
        self._trim(now)
        span = min(span or self.seconds, self.seconds)
        return sum(v for t, v in self._samples if t >= now - span) / span

    def count_rate(self, now: float, span: float | None = None) -> float:
        """Samples per second over the window (or over its last `span` seconds)."""
        span = min(span or self.seconds, self.seconds)
        return len(self.values(now, span)) / span

    def mean(self, now: float, span: float | None = None) -> float | None:
        values = self.values(now, span)
        return sum(values) / len(values) if values else None

    def quantile(self, p: float, now: float, span: float | None = None) -> float | None:
        return quantile(self.values(now, span), p)


@dataclass
class PoolSignals:
    window_s: float
    prompts: Window = field(init=False)  # prompt tokens admitted to this pool's prefill
    service: Window = field(init=False)  # each admitted prompt's own prefill time (cost model)
    ttft: Window = field(init=False)  # TTFT of the requests whose first token this pool made
    ttft_excess: Window = field(init=False)  # TTFT - the prompt's own prefill time: the wait
    itl: Window = field(init=False)  # every gap between two tokens streamed by this pool
    streams: int = 0  # requests admitted whose stream is (or will be) on this pool, not ended
    # Prompts sent to this pool that have no first token yet: key -> (since, own prefill time).
    awaiting: dict[str, tuple[float, float | None]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.prompts = Window(self.window_s)
        self.service = Window(self.window_s)
        self.ttft = Window(self.window_s)
        self.ttft_excess = Window(self.window_s)
        self.itl = Window(self.window_s)

    def ttft_samples(self, now: float, span: float) -> tuple[list[float], list[float]]:
        """(TTFTs, their wait parts) of the last `span` seconds, with the prompts still waiting
        counted at their age within the span (a lower bound: their TTFT is at least that)."""
        ttfts = self.ttft.values(now, span)
        waits = self.ttft_excess.values(now, span)
        for since, alone_s in self.awaiting.values():
            age = now - max(since, now - span)
            ttfts.append(age)
            if alone_s is not None:
                waits.append(max(0.0, age - alone_s))
        return ttfts, waits


class Signals:
    def __init__(self, window_s: float = 30.0, cold_start_s: float = 5.0, cost: StepCostModel | None = None):
        self.window_s = window_s
        self.cold_start_s = cold_start_s
        self.cost = cost or StepCostModel()
        self.pools: dict[str, PoolSignals] = {}
        self.paths: Counter[str] = Counter()  # path -> requests, since start
        self._awaiting_pool: dict[str, str] = {}  # key -> the pool whose first token it awaits
        self.cold_steps_skipped = 0
        self._prediction_ratios = Window(window_s)  # observed / predicted TTFT, per request

    def pool(self, name: str) -> PoolSignals:
        signals = self.pools.get(name)
        if signals is None:
            signals = self.pools[name] = PoolSignals(self.window_s)
        return signals

    # -- recording -----------------------------------------------------------------------------------
    def prompt_admitted(self, pool: str, prompt_tokens: int, service_s: float | None, now: float) -> None:
        """A prompt goes to `pool` to be prefilled (its path is chosen)."""
        signals = self.pool(pool)
        signals.prompts.add(prompt_tokens, now)
        if service_s is not None:
            signals.service.add(service_s, now)

    def stream_started(self, pool: str) -> None:
        self.pool(pool).streams += 1

    def stream_ended(self, pool: str) -> None:
        signals = self.pool(pool)
        signals.streams = max(0, signals.streams - 1)

    def awaiting_first_token(self, key: str, pool: str, since: float, alone_s: float | None) -> None:
        """A prompt (`key`: its request) was sent to `pool` at `since` and waits for its first
        token there. Ended by `first_token` or `request_over`."""
        self.request_over(key)
        self._awaiting_pool[key] = pool
        self.pool(pool).awaiting[key] = (since, alone_s)

    def request_over(self, key: str) -> None:
        """No first token will come for `key` (it came, or the request failed or was cancelled)."""
        pool = self._awaiting_pool.pop(key, None)
        if pool is not None:
            self.pool(pool).awaiting.pop(key, None)

    def first_token(
        self, pool: str, ttft_s: float, alone_s: float | None, now: float, key: str | None = None
    ) -> None:
        if key is not None:
            self.request_over(key)
        signals = self.pool(pool)
        signals.ttft.add(ttft_s, now)
        if alone_s is not None:
            signals.ttft_excess.add(max(0.0, ttft_s - alone_s), now)

    def prediction_checked(self, observed_s: float, predicted_s: float, now: float) -> None:
        """A request's first token came `observed_s` after its arrival; the cost model had said
        `predicted_s` when it chose the path."""
        if predicted_s > 0:
            self._prediction_ratios.add(observed_s / predicted_s, now)

    def prediction_ratios(self, now: float) -> list[float]:
        """Observed / predicted TTFT of the requests of the window."""
        return self._prediction_ratios.values(now)

    def gap(self, pool: str, seconds: float, now: float) -> None:
        self.pool(pool).itl.add(seconds, now)

    def steps(self, samples: Iterable[Any], up_for_s: float) -> None:
        """A worker's step samples (wire.StepSample), unless it came up less than `cold_start_s` ago."""
        if up_for_s < self.cold_start_s:
            self.cold_steps_skipped += sum(1 for _ in samples)
            return
        for s in samples:
            step = Step(s.prefill_tokens, s.prefill_attention, s.decode_streams, s.decode_context)
            self.cost.add(step, s.seconds)

    # -- reading ---------------------------------------------------------------------------------------
    def describe(self, now: float, kv_used: dict[str, float | None]) -> dict[str, Any]:
        """What GET /pools shows under "signals"."""

        def percentiles(window: Window) -> dict[str, float | None] | None:
            values = window.values(now)
            if not values:
                return None
            return {f"p{round(p * 100)}": quantile(values, p) for p in (0.5, 0.9, 0.99)}

        pools = {
            name: {
                "ttft_s": percentiles(s.ttft),
                "itl_s": percentiles(s.itl),
                "kv_used": kv_used.get(name),
                "prompt_tokens_per_s": s.prompts.rate(now),
                "streams": s.streams,
            }
            for name, s in self.pools.items()
        }
        coef = self.cost.coefficients()
        return {
            "window_s": self.window_s,
            "pools": pools,
            "paths": dict(self.paths),
            "cost_model": {
                "samples": self.cost.num_samples,
                "ready": self.cost.ready,
                "cold_start_s": self.cold_start_s,
                "cold_steps_skipped": self.cold_steps_skipped,
                "coefficients": None
                if coef is None
                else dict(
                    zip(
                        ("step_s", "per_prompt_token_s", "per_attention_s", "per_stream_s", "per_context_s"),
                        coef,
                        strict=True,
                    )
                ),
            },
        }
