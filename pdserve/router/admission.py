"""Whether a request is admitted: 503 when no decode worker is up, 429 (with Retry-After) at the
in-flight limit, when the prompt would overfill its pool's queue, or (--reject-on-slo-miss) when
its predicted TTFT misses the SLO. Each check runs before the request costs anything more. No
torch.

An admitted request holds a reservation until the dispatcher starts it (for a streamed answer,
when the response begins): it counts against the in-flight limit and its prompt is queued ahead of
the next one in every prediction, so a burst admitted within the same few milliseconds is not
judged against a queue that does not show it yet. A reservation whose request never starts (the
client left first) lapses after RESERVATION_TTL_S.

The SLO check is judged on what the cost model predicts, scaled by how wrong its predictions have
been of late: the SLO percentile of observed / predicted TTFT over the signals' window (never
below 1). The model predicts a mean; the SLO is a percentile. Before the model is ready (a fresh
server's first seconds) a prompt's wait is estimated from its pool's measured prefill rate, and
before even that is known a pool takes one waiting prompt per worker.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from pdserve import clock
from pdserve.errors import PdserveError
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement import NEVER_READY, STREAM_POOLS, Placement, Unavailable
from pdserve.router.workers import WorkerSet
from pdserve.signals import Signals
from pdserve.slo import quantile

RESERVATION_TTL_S = 30.0
# Observed / predicted TTFT samples needed before they scale the prediction.
MIN_CALIBRATION_SAMPLES = 10


class Overloaded(PdserveError):
    """Too many requests in flight, or an SLO the request would miss (HTTP 429)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after  # seconds, for the Retry-After header


@dataclass(frozen=True)
class _Reservation:
    at: float  # monotonic time of admission
    pool: str  # the pool whose queue its prompt joins
    prompt_tokens: int


class Admission:
    def __init__(
        self,
        workers: WorkerSet,
        config: RouterConfig,
        metrics: RouterMetrics,
        signals: Signals,
        placement: Placement,
        at_bounds: Callable[[], bool] | None = None,
    ) -> None:
        self.workers = workers
        self.config = config
        self.metrics = metrics
        self.signals = signals
        self.placement = placement
        self.in_flight = 0  # requests started and not finished (`start`, `finish`)
        self.admitting = 0  # requests being admitted (`admitting_one`)
        # Whether every pool is at its bound (or its budget), from whoever manages the pools.
        # Without one, the pools are as they are: always at their bounds.
        self.at_bounds: Callable[[], bool] = at_bounds or (lambda: True)
        self._reserved: dict[int, _Reservation] = {}
        self._ids = itertools.count()

    # -- the whole admission -------------------------------------------------------------------------
    def admit(self, prompt_tokens: int) -> int:
        """The queue and SLO checks for a tokenized prompt (Overloaded), then a reservation for it:
        its id, for `release` when the request starts."""
        self.check_queue(prompt_tokens)
        pool = self.check_slo(prompt_tokens)
        reservation = next(self._ids)
        self._reserved[reservation] = _Reservation(clock.monotonic(), pool, prompt_tokens)
        return reservation

    def release(self, reservation: int) -> None:
        """The request ended before it started (the client left)."""
        self._reserved.pop(reservation, None)

    @contextlib.contextmanager
    def admitting_one(self) -> Iterator[None]:
        """A request past its first availability check and being admitted (its prompt tokenized
        on the router's thread pool): it counts against max_in_flight meanwhile, or a burst would
        pass the check while it waits for the tokenizer and pile up beyond the limit."""
        self.admitting += 1
        try:
            yield
        finally:
            self.admitting -= 1

    def start(self, reservation: int | None) -> None:
        """A request begins on the workers: its reservation (if it was admitted) ends and it counts
        as in flight until `finish`. Raises Unavailable or Overloaded as `check_available`."""
        if reservation is not None:
            self.release(reservation)
        self.check_available()
        self.in_flight += 1
        self.metrics.in_flight.inc()

    def finish(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.dec()

    def _lapse(self) -> None:
        edge = clock.monotonic() - RESERVATION_TTL_S
        for key in [k for k, r in self._reserved.items() if r.at < edge]:
            del self._reserved[key]

    def reserved(self) -> dict[str, list[int]]:
        """Pool -> the prompt tokens of each request admitted there and not started, oldest first."""
        self._lapse()
        pools: dict[str, list[int]] = {}
        for r in self._reserved.values():
            pools.setdefault(r.pool, []).append(r.prompt_tokens)
        return pools

    # -- the checks ----------------------------------------------------------------------------------
    def check_slo(self, prompt_tokens: int) -> str:
        """--reject-on-slo-miss: Overloaded (429, Retry-After) when the pools cannot grow and the
        predicted TTFT is above slo_reject_factor x the SLO. Before the request waits, not after.
        Returns the pool whose queue the prompt would join."""
        reserved = self.reserved()
        slo = self.config.slo
        judged = self.config.reject_on_slo_miss and slo.ttft_s is not None and self.at_bounds()
        # The fitted model even with --path-choice threshold: the prediction is what counts here.
        # Not judged: the threshold's path (no simulation) is enough to say which pool it joins.
        cost = self.signals.cost if judged else NEVER_READY
        try:
            choice, prefill, local = self.placement.choose_path(prompt_tokens, cost, reserved)
        except Unavailable:
            return "decode"  # the dispatcher answers 503
        pool = prefill.pool if prefill is not None else local.pool if local is not None else "decode"
        if not judged or slo.ttft_s is None:
            return pool
        limit = self.config.slo_reject_factor * slo.ttft_s
        limits = f"{self.config.slo_reject_factor:g}x the TTFT SLO ({slo.ttft_s * 1000:.0f} ms)"
        chosen = prefill or local
        if chosen is None:
            return pool  # nobody there to predict for: the path choice answers
        # A prompt that goes to a worker with nothing queued ahead of it (sent or reserved) is
        # judged on the plain prediction (none at all while the model is cold): it would start
        # at once, and a server that refused on a pessimistic guess would never serve the
        # requests that correct it.
        idle = chosen.queued_prompt_tokens == 0 and not reserved.get(pool)
        if not self.signals.cost.ready:
            if not idle:
                self._check_cold(pool, prompt_tokens, reserved.get(pool, []), limit, limits)
            return pool
        if choice.predicted_ttft is None:
            return pool
        scale = 1.0 if idle else self._calibration()
        predicted = choice.predicted_ttft * scale
        if predicted <= limit:
            return pool
        self.metrics.slo_rejections.labels("predicted").inc()
        wait = predicted - (choice.alone_s or 0.0)
        how = (
            ""
            if scale == 1.0
            else (
                f" (the cost model's {choice.predicted_ttft:.2f} s x {scale:.2f}, its recent error at "
                f"p{slo.percentile * 100:g})"
            )
        )
        raise Overloaded(
            f"the predicted time to first token, {predicted:.2f} s{how}, is above {limits} and the pools "
            "are at their bounds; retry later",
            retry_after=max(1.0, wait),
        )

    def _calibration(self) -> float:
        """How far the observed TTFT has run past the predicted one of late, at the SLO percentile
        (1 with too few samples; never below 1)."""
        ratios = self.signals.prediction_ratios(clock.monotonic())
        if len(ratios) < MIN_CALIBRATION_SAMPLES:
            return 1.0
        return max(1.0, quantile(ratios, self.config.slo.percentile) or 1.0)

    def _check_cold(
        self, pool: str, prompt_tokens: int, reserved: list[int], limit: float, limits: str
    ) -> None:
        """Before the cost model is ready, with a prompt already queued on the worker it would go
        to: the new prompt's TTFT from the pool's measured prefill rate (the tokens queued and
        reserved there, then its own, at the rate of the workers that have one; the slow steps
        of a cold worker make it pessimistic, as it should be with so little known); with no
        rate measured yet, refused."""
        links = self.workers.up(pool)
        rate = sum(link.prefill_tokens_per_s or 0.0 for link in links)
        if rate > 0:
            queued = sum(link.queued_prompt_tokens for link in links) + sum(reserved)
            predicted = (queued + prompt_tokens) / rate
            if predicted <= limit:
                return
            why = f"its pool's measured prefill rate predicts a first token in {predicted:.2f} s, above {limits}"
            retry_after = queued / rate  # until what is queued now has been prefilled
        else:
            why = f"the {pool} worker it would go to has a prompt waiting and no prefill rate is measured yet"
            retry_after = 1.0
        self.metrics.slo_rejections.labels("cold").inc()
        raise Overloaded(
            f"the cost model has too few measurements yet (a fresh server) and {why}; retry later",
            retry_after=max(1.0, retry_after),
        )

    def check_queue(self, prompt_tokens: int) -> None:
        """Overloaded (429) if this prompt would take its pool's queue past the limit."""
        pool = "colocated" if self.workers.count_up("colocated") else "prefill"
        links = self.workers.up(pool)
        if not links:
            return  # nothing up there: the path choice says so, more clearly
        queued = sum(link.queued_prompt_tokens for link in links) + sum(self.reserved().get(pool, []))
        limit = self.config.max_queued_prompt_tokens * len(links)
        if queued + prompt_tokens <= limit or queued == 0:  # an empty queue takes any one prompt
            return
        rates = [link.prefill_tokens_per_s for link in links if link.prefill_tokens_per_s]
        retry_after = queued / sum(rates) if rates else 1.0
        self.metrics.queue_rejections.labels(pool).inc()
        raise Overloaded(
            f"the {pool} pool has {queued} prompt tokens queued (limit {limit}): retry later",
            retry_after=max(1.0, retry_after),
        )

    def check_available(self, admitting_self: bool = False) -> None:
        """Unavailable (503) with no decode worker up; Overloaded (429) at the in-flight limit,
        counting the requests being admitted (`admitting_self`: the caller is one of them) and
        those admitted that have not started."""
        if not self.workers.count_up(*STREAM_POOLS):
            raise Unavailable("no decode worker is up: the decode pool is empty")
        self._lapse()
        taken = self.in_flight + self.admitting + len(self._reserved) - (1 if admitting_self else 0)
        if taken >= self.config.max_in_flight:
            raise Overloaded(
                f"{taken} requests in flight or being admitted (limit {self.config.max_in_flight}); retry later",
                retry_after=1.0,
            )
