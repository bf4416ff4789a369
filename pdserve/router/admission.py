"""Whether a request is admitted: 503 when no decode worker is up, 429 (with Retry-After) at the
in-flight limit, when the prompt would overfill its pool's queue, or (--reject-on-slo-miss) when
its predicted TTFT misses the SLO. Each check runs before the request costs anything more. No
torch.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.errors import PdserveError
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement import STREAM_POOLS, Placement, Unavailable
from pdserve.router.workers import WorkerSet
from pdserve.signals import Signals


class Overloaded(PdserveError):
    """Too many requests in flight, or an SLO the request would miss (HTTP 429)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after  # seconds, for the Retry-After header


class Admission:
    def __init__(
        self,
        workers: WorkerSet,
        config: RouterConfig,
        metrics: RouterMetrics,
        signals: Signals,
        placement: Placement,
    ) -> None:
        self.workers = workers
        self.config = config
        self.metrics = metrics
        self.signals = signals
        self.placement = placement
        self.in_flight = 0  # admitted requests not finished (the dispatcher counts them)
        # Requests past their first availability check and still being admitted (their prompt
        # tokenized on the router's thread pool): they count against max_in_flight, or a burst
        # would pass the check while it waits for the tokenizer and pile up beyond the limit.
        self.admitting = 0
        # Whether every pool is at its bound (or its budget): set by whoever manages the pools.
        # Without one, the pools are as they are: always at their bounds.
        self.at_bounds: Callable[[], bool] = lambda: True

    def check_slo(self, prompt_tokens: int) -> None:
        """--reject-on-slo-miss: Overloaded (429, Retry-After) when the pools cannot grow and the
        predicted TTFT is above slo_reject_factor x the SLO. Before the request waits, not after."""
        slo = self.config.slo
        if not self.config.reject_on_slo_miss or slo.ttft_s is None or not self.signals.cost.ready:
            return
        if not self.at_bounds():  # cheap, before the simulation
            return
        try:  # the fitted model even with --path-choice threshold: the prediction is what counts here
            choice, _, _ = self.placement.choose_path(prompt_tokens, self.signals.cost)
        except Unavailable:
            return
        predicted = choice.predicted_ttft
        limit = self.config.slo_reject_factor * slo.ttft_s
        if predicted is None or predicted <= limit:
            return
        self.metrics.slo_rejections.inc()
        wait = predicted - (choice.alone_s or 0.0)
        raise Overloaded(
            f"the predicted time to first token, {predicted:.1f} s, is above {self.config.slo_reject_factor:g}x "
            f"the TTFT SLO ({slo.ttft_s * 1000:.0f} ms) and the pools are at their bounds; retry later",
            retry_after=max(1.0, wait),
        )

    def check_queue(self, prompt_tokens: int) -> None:
        """Overloaded (429) if this prompt would take its pool's queue past the limit."""
        pool = "colocated" if self.workers.up("colocated") else "prefill"
        links = self.workers.up(pool)
        if not links:
            return  # nothing up there: the path choice says so, more clearly
        queued = sum(link.queued_prompt_tokens for link in links)
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
        counting the requests being admitted (`admitting_self`: the caller is one of them)."""
        if not self.workers.up(*STREAM_POOLS):
            raise Unavailable("no decode worker is up: the decode pool is empty")
        taken = self.in_flight + self.admitting - (1 if admitting_self else 0)
        if taken >= self.config.max_in_flight:
            raise Overloaded(
                f"{taken} requests in flight or being admitted (limit {self.config.max_in_flight}); retry later",
                retry_after=1.0,
            )
