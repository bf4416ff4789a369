"""How the router admits, places and retries requests: its configuration, shared by the
dispatcher, the admission checks and the placement of requests on workers. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve.router import policy
from pdserve.slo import SLO

PATH_CHOICES = ("cost", "threshold")


@dataclass(frozen=True)
class RouterConfig:
    # cost: the cost model chooses each request's path (the threshold decides while it is cold);
    # threshold: always the fixed threshold (as before the cost model; for comparisons).
    path_choice: str = "cost"
    local_prefill_threshold: int = policy.DEFAULT_LOCAL_PREFILL_THRESHOLD
    max_retries: int = 2  # re-prefills of one request before it fails
    prefill_timeout: float = 300.0  # AddRequest -> first token on a prefill worker, queueing included
    token_timeout: float = 60.0  # the longest wait for the next token of a running stream
    max_in_flight: int = 512  # admitted requests; beyond this new ones get 429
    # Prompt tokens sent to a pool's workers and not yet prefilled, per worker that is up: a prompt
    # that would take the pool past this gets 429 (Retry-After: the time the queue needs). It
    # bounds what a burst can pile up (router and worker memory, and waits no SLO accepts).
    max_queued_prompt_tokens: int = 131072
    slo: SLO = field(default_factory=SLO)
    # 429 at admission when the pools are at their bounds and the predicted TTFT is above
    # slo_reject_factor x the TTFT SLO.
    reject_on_slo_miss: bool = False
    slo_reject_factor: float = 2.0
