"""What the API layer and the dispatcher share about one request (no torch): its state as the
dispatcher records it, the tokens it streams, and how it failed."""

from __future__ import annotations

from dataclasses import dataclass, field

from pdserve import clock
from pdserve.errors import PdserveError
from pdserve.router import policy
from pdserve.router.workers import Leg


class RequestFailed(PdserveError):
    """The request failed on the workers after it was admitted (an error event or HTTP 500)."""


class RequestInvalid(RequestFailed):
    """A worker refused the request as the client sent it (its parameters): HTTP 400. The router
    validates every field first, so this is a check the router lacks; refused after a retry or a
    move (which change the request), it is the router's fault and a plain RequestFailed."""


@dataclass(frozen=True)
class TokenEvent:
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    pool: str = ""  # the pool of the worker that produced these tokens
    logprobs: list[tuple[int, float, dict[int, float]]] | None = None  # one per token, if asked for


@dataclass
class RequestState:
    """What the dispatcher did with one request; read by the API layer for logs and metrics."""

    request_id: str
    path: str = "none"
    retries: int = 0
    migrations: int = 0
    outcome: str = "aborted"  # until the request ends otherwise (a client that left, say)
    choice: policy.PathChoice | None = None  # the first attempt's path, and what was predicted
    legs: list[Leg] = field(default_factory=list)
    last_token_at: float | None = None  # monotonic time of the last token streamed
    reservation: int | None = None  # its place, from admission until it starts (Admission.admit)
    # Its arrival at the router, before its body was read: the one clock every TTFT counts from
    # (the metric, the planner's signals, the check of the path choice's prediction).
    created_at: float = field(default_factory=clock.monotonic)
    _next_leg: int = 0

    def new_leg_id(self) -> str:
        """`<request id>.<n>`: one per attempt (its prefill and decode legs share it) and per move."""
        leg_id = f"{self.request_id}.{self._next_leg}"
        self._next_leg += 1
        return leg_id
