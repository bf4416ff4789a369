"""Where a request runs: its path (remote prefill or local), the prefill worker and the decode
worker, from what the router knows of each worker and the cost model. Pure logic over the
router's worker links (no sockets are touched, no torch).

The rules themselves are plain functions in `policy.py` (the simulator reuses them); this module
turns the router's live links into the views those rules take.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Literal, overload

from pdserve.costmodel import StepCostModel
from pdserve.errors import PdserveError
from pdserve.router import policy
from pdserve.router.config import RouterConfig
from pdserve.router.workers import WorkerLink, WorkerSet
from pdserve.signals import Signals

# The pools whose workers stream tokens to clients (the decode pool, or colocated workers).
STREAM_POOLS = ("decode", "colocated")


class Unavailable(PdserveError):
    """No worker can take the request now (HTTP 503)."""


class Placement:
    def __init__(self, workers: WorkerSet, config: RouterConfig, signals: Signals) -> None:
        self.workers = workers
        self.config = config
        self.signals = signals

    def choose_path(
        self,
        prompt_tokens: int,
        cost: StepCostModel | None = None,
        reserved: Mapping[str, Sequence[int]] | None = None,
    ) -> tuple[policy.PathChoice, WorkerLink | None, WorkerLink | None]:
        """(the choice, the prefill worker for a remote prefill, the decode worker for a local one).
        `reserved`: pool -> prompts admitted there and not sent to a worker yet; each worker of
        the pool is taken to get its share of them, ahead of this one. Raises Unavailable when no
        decode worker is up."""
        decode = self.pick_decode()
        prefill = self.pick_prefill()
        reserved = reserved or {}
        choice = policy.choose_path_by_cost(
            cost or (self.signals.cost if self.config.path_choice == "cost" else NEVER_READY),
            prompt_tokens,
            _prefill_candidate(prefill, self._share(reserved, "prefill")) if prefill is not None else None,
            _decode_candidate(decode, self._share(reserved, decode.pool)),
            self.config.slo.itl_s,
            self.config.local_prefill_threshold,
            self.config.slo.percentile,
        )
        if choice.path == "local":
            return choice, None, decode
        return choice, prefill, None

    def _share(self, reserved: Mapping[str, Sequence[int]], pool: str) -> tuple[int, ...]:
        """One worker's share of the prompts reserved for `pool` (every n-th, of n workers up)."""
        prompts = reserved.get(pool, ())
        return tuple(prompts[:: max(1, len(self.workers.up(pool)))])

    def pick_prefill(self) -> WorkerLink | None:
        links = {w.worker_id: w for w in self.workers.up("prefill")}
        views = [
            policy.PrefillView(
                w.worker_id, w.queued_prompt_tokens, w.load.queued_prompt_tokens if w.load else 0
            )
            for w in links.values()
        ]
        chosen = policy.choose_prefill(views)
        return links[chosen.worker_id] if chosen else None

    @overload
    def pick_decode(
        self,
        exclude: WorkerLink | None = ...,
        pools: tuple[str, ...] = ...,
        blocks_needed: int = ...,
        required: Literal[True] = ...,
    ) -> WorkerLink: ...

    @overload
    def pick_decode(
        self,
        exclude: WorkerLink | None = ...,
        pools: tuple[str, ...] = ...,
        blocks_needed: int = ...,
        *,
        required: Literal[False],
    ) -> WorkerLink | None: ...

    def pick_decode(
        self,
        exclude: WorkerLink | None = None,
        pools: tuple[str, ...] = STREAM_POOLS,
        blocks_needed: int = 0,
        required: bool = True,
    ) -> WorkerLink | None:
        """The worker to stream from (not `exclude`), preferring one whose last report shows room
        for `blocks_needed` KV blocks; None, or Unavailable if `required`."""
        links = {w.worker_id: w for w in self.workers.up(*pools) if w is not exclude}
        views = [
            policy.DecodeView(
                w.worker_id,
                len(w.legs),
                w.load.kv_blocks_free if w.load else None,
                (w.load.kv_blocks_free + w.load.kv_blocks_used) if w.load else None,
            )
            for w in links.values()
        ]
        chosen = policy.choose_decode(views, blocks_needed)
        if chosen is None:
            if required:
                raise Unavailable("no decode worker is up: the decode pool is empty")
            return None
        return links[chosen.worker_id]


NEVER_READY = StepCostModel(min_samples=2**62)  # --path-choice threshold: always "cold"

# Before a worker's Ready says them: the engine's defaults.
_DEFAULT_CHUNK, _DEFAULT_BUDGET = 512, 2048
_DEFAULT_CONTEXT = 256.0  # tokens per stream, before a load report says


def _ahead(link: WorkerLink) -> tuple[int, ...]:
    """Prompt tokens still to prefill on a worker, oldest first: the router's own legs, matched to
    the worker's last report (what it has computed of the oldest; other routers' prompts)."""
    ahead = [leg.prompt_tokens for leg in link.legs.values() if leg.prompt_tokens > 0]
    reported = link.load.queued_prompt_tokens if link.load else sum(ahead)
    extra = reported - sum(ahead)
    if extra > 0:
        ahead.append(extra)
    else:
        for i in range(len(ahead)):  # the oldest are the ones being computed
            take = min(ahead[i], -extra)
            ahead[i] -= take
            extra += take
            if extra >= 0:
                break
    return tuple(t for t in ahead if t > 0)


def _limits(link: WorkerLink) -> tuple[int, int]:
    ready = link.ready
    chunk = ready.chunk_size if ready and ready.chunk_size else _DEFAULT_CHUNK
    budget = ready.max_num_batched_tokens if ready and ready.max_num_batched_tokens else _DEFAULT_BUDGET
    return chunk, budget


def _prefill_candidate(link: WorkerLink, reserved: tuple[int, ...] = ()) -> policy.PrefillCandidate:
    chunk, budget = _limits(link)
    interrupts = bool(link.ready and link.ready.prefill_interrupts)
    return policy.PrefillCandidate(link.worker_id, _ahead(link) + reserved, chunk, budget, interrupts)


def context_per_stream(link: WorkerLink) -> float:
    """Tokens of KV per running request on the worker, from its last load report."""
    load = link.load
    if load is None or not load.num_running or not load.block_size:
        return _DEFAULT_CONTEXT
    return load.kv_blocks_used * load.block_size / load.num_running


def _decode_candidate(link: WorkerLink, reserved: tuple[int, ...] = ()) -> policy.DecodeCandidate:
    chunk, budget = _limits(link)
    streams = sum(1 for leg in link.legs.values() if not leg.done and leg.prompt_tokens == 0)
    return policy.DecodeCandidate(
        link.worker_id, streams, context_per_stream(link), _ahead(link) + reserved, chunk, budget
    )
