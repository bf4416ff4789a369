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
from pdserve.router.workers import WorkerSet, WorkerView
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
    ) -> tuple[policy.PathChoice, WorkerView | None, WorkerView | None]:
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
        return tuple(prompts[:: max(1, self.workers.count_up(pool))])

    def pick_prefill(self) -> WorkerView | None:
        views = {w.worker_id: w for w in self.workers.up("prefill")}
        chosen = policy.choose_prefill(
            [
                policy.PrefillView(
                    w.worker_id, w.queued_prompt_tokens, w.load.queued_prompt_tokens if w.load else 0
                )
                for w in views.values()
            ]
        )
        return views[chosen.worker_id] if chosen else None

    @overload
    def pick_decode(
        self,
        exclude: str | None = ...,
        pools: tuple[str, ...] = ...,
        blocks_needed: int = ...,
        required: Literal[True] = ...,
    ) -> WorkerView: ...

    @overload
    def pick_decode(
        self,
        exclude: str | None = ...,
        pools: tuple[str, ...] = ...,
        blocks_needed: int = ...,
        *,
        required: Literal[False],
    ) -> WorkerView | None: ...

    def pick_decode(
        self,
        exclude: str | None = None,
        pools: tuple[str, ...] = STREAM_POOLS,
        blocks_needed: int = 0,
        required: bool = True,
    ) -> WorkerView | None:
        """The worker to stream from (not the one whose id is `exclude`), preferring one whose last
        report shows room for `blocks_needed` KV blocks; None, or Unavailable if `required`."""
        views = {w.worker_id: w for w in self.workers.up(*pools) if w.worker_id != exclude}
        chosen = policy.choose_decode(
            [
                policy.DecodeView(
                    w.worker_id,
                    w.streams,
                    w.load.kv_blocks_free if w.load else None,
                    (w.load.kv_blocks_free + w.load.kv_blocks_used) if w.load else None,
                )
                for w in views.values()
            ],
            blocks_needed,
        )
        if chosen is None:
            if required:
                raise Unavailable("no decode worker is up: the decode pool is empty")
            return None
        return views[chosen.worker_id]


NEVER_READY = StepCostModel(min_samples=2**62)  # --path-choice threshold: always "cold"


def _prefill_candidate(view: WorkerView, reserved: tuple[int, ...] = ()) -> policy.PrefillCandidate:
    interrupts = bool(view.ready and view.ready.prefill_interrupts)
    return policy.PrefillCandidate(
        view.worker_id, view.prompts_ahead() + reserved, view.chunk_size, view.token_budget, interrupts
    )


def _decode_candidate(view: WorkerView, reserved: tuple[int, ...] = ()) -> policy.DecodeCandidate:
    return policy.DecodeCandidate(
        view.worker_id,
        view.decoding,
        view.context_per_stream(),
        view.prompts_ahead() + reserved,
        view.chunk_size,
        view.token_budget,
    )
