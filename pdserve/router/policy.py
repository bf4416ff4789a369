"""Routing decisions as plain functions over what the router knows of each worker. Pure Python.

Kept free of sockets and asyncio so that the simulator can reuse them unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.costmodel import Step, StepCostModel, chunk_attention

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
    cached: int = 0  # tokens of this prompt in its prefix cache (router/prefix.py)


@dataclass(frozen=True)
class DecodeView:
    worker_id: str
    active_requests: int  # streams this router has on the worker
    kv_blocks_free: int | None  # from the worker's last Load; None before the first one
    kv_blocks_total: int | None
    cached: int = 0  # tokens of this prompt in its prefix cache (router/prefix.py)


def choose_path(prompt_tokens: int, local_prefill_threshold: int, prefill_available: bool) -> str:
    """'remote' (prefill pool, then KV transfer) or 'local' (the decode worker prefills)."""
    if not prefill_available or prompt_tokens <= local_prefill_threshold:
        return "local"
    return "remote"


def choose_prefill(workers: list[PrefillView]) -> PrefillView | None:
    """Least predicted wait for the first token: the fewest prompt tokens to compute, those queued
    ahead and this prompt's own less what the worker has cached of it (prefill time grows with
    tokens computed, so the two weigh alike)."""
    if not workers:
        return None
    return min(
        workers, key=lambda w: (max(w.queued_prompt_tokens, w.reported_queued_tokens) - w.cached, w.worker_id)
    )


def cache_stream_slack(least_streams: int) -> int:
    """How many more streams than the least loaded worker one may have and still be chosen for the
    prefix it has cached: a few streams more lengthen its steps a little, recomputing (or moving)
    a conversation's KV costs far more. Not tuned by measurement yet."""
    return max(2, least_streams // 4)


def choose_decode(workers: list[DecodeView], blocks_needed: int = 0) -> DecodeView | None:
    """The worker with the most of this prompt cached, unless it has more than
    `cache_stream_slack` streams above the least loaded; else the least loaded with room: fewest
    streams, then most free KV. A worker whose last report shows too few free blocks for this
    prompt is passed over while another has room."""
    if not workers:
        return None
    roomy = [w for w in workers if w.kv_blocks_free is None or w.kv_blocks_free >= blocks_needed]
    candidates = roomy or workers

    def load(w: DecodeView) -> tuple[float, float, str]:
        used = 0.0
        if w.kv_blocks_free is not None and w.kv_blocks_total:
            used = 1.0 - w.kv_blocks_free / w.kv_blocks_total
        return (w.active_requests, used, w.worker_id)

    least = min(candidates, key=load)
    holder = max(candidates, key=lambda w: (w.cached, -w.active_requests))
    if holder.cached > least.cached and holder.active_requests <= least.active_requests + cache_stream_slack(
        least.active_requests
    ):
        return holder
    return least


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


# -- the path, by the cost model ----------------------------------------------------------------------
# A local prefill may lengthen its decode worker's step by this factor when no ITL SLO is given.
DEFAULT_STALL_FACTOR = 1.5
# The remote path spares the decode worker's streams and the prefill pool is there for prompts: a
# local prefill next to running streams must be faster by this margin to be worth its stall.
LOCAL_MARGIN = 0.9


@dataclass(frozen=True)
class PrefillCandidate:
    """The prefill worker a remote prefill would go to, as the cost model needs it."""

    worker_id: str
    ahead: tuple[int, ...]  # prompt tokens still to prefill there, oldest first
    chunk: int
    budget: int
    # A prompt of at most one chunk runs between two layers of the step in progress there,
    # rather than after it (wire.Ready.prefill_interrupts).
    interrupts: bool = False
    cached: int = 0  # tokens of this prompt in its prefix cache: not computed again


@dataclass(frozen=True)
class DecodeCandidate:
    """The decode (or colocated) worker a local prefill would run on."""

    worker_id: str
    streams: int  # decoding there now
    context_per_stream: float
    ahead: tuple[int, ...]  # prompts it is prefilling itself
    chunk: int
    budget: int
    cached: int = 0  # tokens of this prompt in its prefix cache: not computed again


@dataclass(frozen=True)
class PathChoice:
    path: str  # remote | local
    reason: str  # cost_model | stall | cold | no_prefill_worker | threshold
    predicted_ttft: float | None = None  # of the chosen path
    alone_s: float | None = None  # the prompt's own prefill time on an idle worker
    remote_ttft: float | None = None
    local_ttft: float | None = None
    stall_s: float | None = None  # the longest step the local prefill would give its streams
    chunk: int = 0  # local: at most this many prompt tokens per step (0: the worker's own chunk)
    stall_margin: float = 1.0  # the ITL budget was divided by this (the model's recent under-prediction)
    # local: the ITL budget its steps must keep (before the margin), for the decode worker to size
    # each chunk by its own step model as streams come and go (0: none)
    step_budget_s: float = 0.0


def choose_path_by_cost(
    cost: StepCostModel,
    prompt_tokens: int,
    prefill: PrefillCandidate | None,
    decode: DecodeCandidate,
    itl_budget_s: float | None,
    local_prefill_threshold: int,
    slo_percentile: float = 0.9,
) -> PathChoice:
    """Remote (prefill pool) or local (on `decode`): the faster predicted TTFT, local only when its
    stall fits `itl_budget_s` (None: DEFAULT_STALL_FACTOR x that worker's step), divided by the
    cost model's recent under-prediction of such steps at `slo_percentile`. Before the cost model
    is ready the fixed threshold decides."""
    if not cost.ready:
        path = choose_path(prompt_tokens, local_prefill_threshold, prefill is not None)
        return PathChoice(path, "cold" if prefill is not None else "no_prefill_worker")
    context = round(decode.streams * decode.context_per_stream)
    if prefill is None:  # colocated, or no prefill worker up: local, with what it predicts
        local, longest = cost.prefill_finish_seconds(
            prompt_tokens,
            decode.ahead,
            chunk=decode.chunk,
            budget=decode.budget,
            short_first=False,
            decode_streams=decode.streams,
            decode_context=context,
            cached=decode.cached,
        )
        alone = cost.prefill_alone_seconds(prompt_tokens, decode.chunk, decode.budget, decode.cached)
        return PathChoice("local", "no_prefill_worker", local, alone, None, local, longest)
    alone = cost.prefill_alone_seconds(prompt_tokens, prefill.chunk, prefill.budget, prefill.cached)
    remote, _ = cost.prefill_finish_seconds(
        prompt_tokens,
        prefill.ahead,
        chunk=prefill.chunk,
        budget=prefill.budget,
        short_first=True,
        interrupts=prefill.interrupts,
        cached=prefill.cached,
    )
    quiet = cost.decode_step_seconds(decode.streams, decode.context_per_stream)
    if itl_budget_s is not None:
        budget = itl_budget_s
    else:  # 1.5x its step, and never less than a step with a threshold-sized prompt in it
        tiny = Step(
            local_prefill_threshold, chunk_attention(0, local_prefill_threshold), decode.streams, context
        )
        budget = max(DEFAULT_STALL_FACTOR * quiet, cost.step_seconds(tiny))
    # Predicted steps must fit with room for the model's own error on such steps.
    step_budget = budget
    margin = cost.mixed_step_margin(slo_percentile)
    budget /= margin
    # A local prefill goes in chunks small enough for its steps to fit the budget (the streams on
    # that worker keep their ITL); fewer tokens a step means more steps, which the TTFT below counts.
    # Sized with one stream more than now, so that one arriving meanwhile still fits.
    extra = round(decode.context_per_stream) if decode.streams else 0
    chunk = cost.largest_chunk_within(
        budget, prompt_tokens, decode.streams + 1, context + extra, decode.chunk
    )
    if chunk == 0:  # not even one prompt token fits beside these streams
        return PathChoice("remote", "stall", remote, alone, remote, None, None, stall_margin=margin)
    local, longest = cost.prefill_finish_seconds(
        prompt_tokens,
        decode.ahead,
        chunk=chunk,
        budget=decode.budget,
        short_first=False,
        decode_streams=decode.streams,
        decode_context=context,
        cached=decode.cached,
    )
    # The prompts already prefilling there share its steps: the check is on the whole step. Also
    # on a worker with no stream now: those that arrive while it prefills stall just the same.
    stall_ok = longest <= budget
    # With streams to stall, local must win by a margin; on an idle worker a tie goes local (it
    # saves the KV transfer before the second token).
    faster = local < LOCAL_MARGIN * remote if decode.streams else local <= remote
    path = "local" if faster and stall_ok else "remote"
    reason = "stall" if faster and not stall_ok else "cost_model"
    predicted = local if path == "local" else remote
    if path == "remote":
        return PathChoice(path, reason, predicted, alone, remote, local, longest, 0, margin)
    return PathChoice(path, reason, predicted, alone, remote, local, longest, chunk, margin, step_budget)
