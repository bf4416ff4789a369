"""One admitted request's answer as it is built: its detokenizer, response builder, logprobs and
the latency it records. Pure Python (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve import wire
from pdserve.router import openai_types as oa
from pdserve.router.logprobs import LogprobsFormatter, TokenLogprobs
from pdserve.router.metrics import RouterMetrics
from pdserve.router.request_state import RequestFailed, RequestState, TokenEvent
from pdserve.signals import Signals
from pdserve.text.detok import IncrementalDetokenizer


@dataclass(frozen=True)
class Delta:
    """What one worker message added to the answer."""

    text: str
    finish: str | None
    stop_reason: int | str | None
    logprobs: TokenLogprobs | None  # of the tokens it brought, when the request asked for them


def checked_logprobs(run: Answer, event: TokenEvent) -> list[tuple[int, float, dict[int, float]]] | None:
    """The event's logprobs when the request asked for them; a worker that leaves them out fails
    the request rather than answering without them."""
    if run.logprobs is None or not event.token_ids:
        return None
    if event.logprobs is None or len(event.logprobs) != len(event.token_ids):
        raise RequestFailed(
            f"a worker sent {len(event.token_ids)} tokens without their logprobs "
            f"({0 if event.logprobs is None else len(event.logprobs)} came)"
        )
    return event.logprobs


@dataclass
class Answer:
    """One admitted request on its way through `Router._deltas`."""

    state: RequestState
    prompt_ids: list[int]
    params: wire.WireSamplingParams
    detok: IncrementalDetokenizer
    builder: oa.ResponseBuilder
    stream: bool
    include_usage: bool
    ignore_eos: bool
    arrived: float
    logprobs: LogprobsFormatter | None = None  # None: the request asked for none
    output_ids: list[int] = field(default_factory=list)
    latency: Latency = field(init=False)

    def __post_init__(self) -> None:
        self.latency = Latency(self.arrived)

    def token_arrived(self, now: float, event: TokenEvent, metrics: RouterMetrics, signals: Signals) -> None:
        self.latency.token_arrived(now, event, metrics, signals)

    def render_logprobs(self, logprobs: TokenLogprobs | None) -> dict[str, Any] | None:
        if self.logprobs is None or logprobs is None:
            return None
        return self.logprobs.render(logprobs)

    def finished(self, now: float, metrics: RouterMetrics) -> None:
        self.latency.finished(now, len(self.output_ids), metrics)


@dataclass
class Latency:
    """What one request's tokens record as they reach the client: the TTFT and ITL metrics and the
    planner's gaps. The router's answers and the simulator's front (pdserve.sim.front) both keep one."""

    arrived: float
    first_token_at: float | None = None
    last_token_at: float | None = None
    last_pool: str = ""

    def token_arrived(self, now: float, event: TokenEvent, metrics: RouterMetrics, signals: Signals) -> None:
        count = len(event.token_ids)
        if not count:
            return
        ttft, itl = metrics.pool_latency(event.pool)
        if self.first_token_at is None:
            self.first_token_at = now
            ttft.observe(now - self.arrived)
        elif self.last_token_at is not None:
            itl.observe(now - self.last_token_at)
            if event.pool == self.last_pool:
                # Not the hand-off (first token from the prefill pool, next from decode): that gap
                # is the KV transfer's and the first step's, which more decode workers do not shorten.
                signals.gap(event.pool, now - self.last_token_at, now)
        self.last_token_at = now
        self.last_pool = event.pool
        metrics.generation_tokens.inc(count)

    def finished(self, now: float, output_tokens: int, metrics: RouterMetrics) -> None:
        metrics.e2e.observe(now - self.arrived)
        if self.first_token_at is not None and output_tokens > 1:
            metrics.tpot.observe((now - self.first_token_at) / (output_tokens - 1))
