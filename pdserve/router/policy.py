"""Routing decisions as plain functions over what the router knows of each worker. Pure Python.

Kept free of sockets and asyncio so that the simulator can reuse them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

# Prompts of at most this many tokens are prefilled on the decode worker itself. A remote prefill
# costs two RPC hops and a KV copy (about a millisecond on one host); a local prefill of a few
# tokens costs the decode batch little more than one of its own steps, while a longer one stalls
# every stream on that worker for as long as it runs. One KV block's worth is where we put the
# line; it has not been tuned by measurement yet.
DEFAULT_LOCAL_PREFILL_THRESHOLD = 16


@dataclass(frozen=True)
class PrefillView:
    worker_id: str
    queued_prompt_tokens: int  # sent by this router and not prefilled yet (exact, not sampled)
    reported_queued_tokens: int  # what the worker last reported (other routers' work included)


@dataclass(frozen=True)
class DecodeView:
    worker_id: str
    active_requests: int  # streams this router has on the worker
    kv_blocks_free: int | None  # from the worker's last Load; None before the first one
    kv_blocks_total: int | None


def choose_path(prompt_tokens: int, local_prefill_threshold: int, prefill_available: bool) -> str:
    """'remote' (prefill pool, then KV transfer) or 'local' (the decode worker prefills)."""
    if not prefill_available or prompt_tokens <= local_prefill_threshold:
        return "local"
    return "remote"


def choose_prefill(workers: list[PrefillView]) -> PrefillView | None:
    """Least predicted wait: the fewest prompt tokens queued ahead (prefill time grows with them)."""
    if not workers:
        return None
    return min(workers, key=lambda w: (max(w.queued_prompt_tokens, w.reported_queued_tokens), w.worker_id))


def choose_decode(workers: list[DecodeView], blocks_needed: int = 0) -> DecodeView | None:
    """The least loaded worker with room: fewest streams, then most free KV. A worker whose last
    report shows too few free blocks for this prompt is passed over while another has room."""
    if not workers:
        return None
    roomy = [w for w in workers if w.kv_blocks_free is None or w.kv_blocks_free >= blocks_needed]
    candidates = roomy or workers

    def load(w: DecodeView) -> tuple[float, float, str]:
        used = 0.0
        if w.kv_blocks_free is not None and w.kv_blocks_total:
            used = 1.0 - w.kv_blocks_free / w.kv_blocks_total
        return (w.active_requests, used, w.worker_id)

    return min(candidates, key=load)


def plan_rebalance(streams: dict[str, int]) -> dict[str, int]:
    """How many streams to move off each worker so that the pool's counts differ by at most one:
    worker id -> streams to move away. The busiest give first; nothing moves in a balanced pool.

    A stream that moves costs one KV transfer and one gap of a step or two; it pays back from then
    on with a shorter step on a smaller batch, so only real imbalance is worth it."""
    counts = dict(streams)
    moves: dict[str, int] = {}
    if len(counts) < 2:
        return moves
    while True:
        busiest = max(counts, key=lambda w: (counts[w], w))
        idlest = min(counts, key=lambda w: (counts[w], w))
        if counts[busiest] - counts[idlest] <= 1:
            return moves
        counts[busiest] -= 1
        counts[idlest] += 1
        moves[busiest] = moves.get(busiest, 0) + 1
