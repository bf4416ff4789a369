"""Where a request runs: its path (remote prefill or local), the prefill worker and the decode
worker, from what the router knows of each worker and the cost model. Pure logic over the
router's worker links (no sockets are touched, no torch).

The rules themselves are plain functions in `policy.py` (the simulator reuses them); this module
turns the router's live links into the views those rules take.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Literal, overload

from pdserve.costmodel import StepCostModel
from pdserve.errors import PdserveError
from pdserve.router import policy
from pdserve.router.config import RouterConfig
from pdserve.router.prefix import PromptKeys
from pdserve.router.workers import WorkerSet, WorkerView
from pdserve.signals import Signals

# The pools whose workers stream tokens to clients (the decode pool, or colocated workers).
STREAM_POOLS = ("decode", "colocated")


class Unavailable(PdserveError):
    """No worker can take the request now (HTTP 503)."""


class Placement:
    def __init__(
        self,
        workers: WorkerSet,
        config: RouterConfig,
        signals: Signals,
        on_kv_choice: Callable[[str, str], None] | None = None,
    ) -> None:
        """`on_kv_choice(pool, decision)`: each worker chosen with a prompt's tokens known, where
        decision is "cache" (it has the most of the prompt cached), "no_cache" (no worker of the
        pool has any of it) or "load_over_cache" (another had more of it cached but too many
        streams: the fallback to load, counted and logged)."""
        self.workers = workers
        self.config = config
        self.signals = signals
        self.on_kv_choice = on_kv_choice
        self._decision: str | None = None  # the last pick's KV-aware decision

    def choose_path(
        self,
        prompt_tokens: int,
        cost: StepCostModel | None = None,
        reserved: Mapping[str, Sequence[int]] | None = None,
        prompt: PromptKeys | None = None,
    ) -> tuple[policy.PathChoice, WorkerView | None, WorkerView | None]:
        """(the choice, the prefill worker for a remote prefill, the decode worker for a local one).
        `reserved`: pool -> prompts admitted there and not sent to a worker yet; each worker of
        the pool is taken to get its share of them, ahead of this one. `prompt`: its tokens (with
        any outputs to compute again), to weigh what each worker has cached of it. Raises
        Unavailable when no decode worker is up."""
        # Both candidates weigh the prompt's cached blocks; only the chosen path's worker counts.
        decode = self.pick_decode(prompt=prompt, report=False)
        decode_decision = self._decision
        prefill = self.pick_prefill(prompt, report=False)
        prefill_decision = self._decision
        reserved = reserved or {}
        choice = policy.choose_path_by_cost(
            cost or (self.signals.cost if self.config.path_choice == "cost" else NEVER_READY),
            prompt_tokens,
            _prefill_candidate(prefill, self._share(reserved, "prefill"), prefill.cached_tokens(prompt))
            if prefill is not None
            else None,
            _decode_candidate(decode, self._share(reserved, decode.pool), decode.cached_tokens(prompt)),
            self.config.slo.itl_s,
            self.config.local_prefill_threshold,
            self.config.slo.percentile,
        )
        if choice.path == "local":
            self._report(decode.pool, decode_decision)
            return choice, None, decode
        self._report("prefill", prefill_decision)
        return choice, prefill, None

    def _report(self, pool: str, decision: str | None) -> None:
        if decision is not None and self.on_kv_choice is not None:
            self.on_kv_choice(pool, decision)

    def _share(self, reserved: Mapping[str, Sequence[int]], pool: str) -> tuple[int, ...]:
        """One worker's share of the prompts reserved for `pool` (every n-th, of n workers up)."""
        prompts = reserved.get(pool, ())
        return tuple(prompts[:: max(1, self.workers.count_up(pool))])

    def pick_prefill(self, prompt: PromptKeys | None = None, report: bool = True) -> WorkerView | None:
        """The prefill worker for `prompt` (policy.choose_prefill); with `report`, its KV-aware
        decision goes to `on_kv_choice` (else it is kept in `_decision` for the caller)."""
        views = {w.worker_id: w for w in self.workers.up("prefill")}
        candidates = [
            policy.PrefillView(
                w.worker_id,
                w.queued_prompt_tokens,
                w.load.queued_prompt_tokens if w.load else 0,
                w.cached_tokens(prompt),
            )
            for w in views.values()
        ]
        chosen = policy.choose_prefill(candidates)
        self._decision = _kv_decision(chosen, candidates) if prompt is not None else None
        if report:
            self._report("prefill", self._decision)
        return views[chosen.worker_id] if chosen else None

    @overload
    def pick_decode(
        self,
        exclude: str | None = ...,
        pools: tuple[str, ...] = ...,
        blocks_needed: int = ...,
        required: Literal[True] = ...,
        prompt: PromptKeys | None = ...,
        report: bool = ...,
    ) -> WorkerView: ...

    @overload
    def pick_decode(
        self,
        exclude: str | None = ...,
        pools: tuple[str, ...] = ...,
        blocks_needed: int = ...,
        *,
        required: Literal[False],
        prompt: PromptKeys | None = ...,
        report: bool = ...,
    ) -> WorkerView | None: ...

    def pick_decode(
        self,
        exclude: str | None = None,
        pools: tuple[str, ...] = STREAM_POOLS,
        blocks_needed: int = 0,
        required: bool = True,
        prompt: PromptKeys | None = None,
        report: bool = True,
    ) -> WorkerView | None:
        """The worker to stream from (not the one whose id is `exclude`), preferring one whose last
        report shows room for `blocks_needed` KV blocks, and one with `prompt` cached
        (policy.choose_decode; the decision reported as `pick_prefill` does); None, or
        Unavailable if `required`."""
        views = {w.worker_id: w for w in self.workers.up(*pools) if w.worker_id != exclude}
        candidates = [
            policy.DecodeView(
                w.worker_id,
                w.streams,
                w.load.kv_blocks_free if w.load else None,
                (w.load.kv_blocks_free + w.load.kv_blocks_used) if w.load else None,
                w.cached_tokens(prompt),
            )
            for w in views.values()
        ]
        chosen = policy.choose_decode(candidates, blocks_needed)
        self._decision = _kv_decision(chosen, candidates) if prompt is not None else None
        if report and chosen is not None:
            self._report(views[chosen.worker_id].pool, self._decision)
        if chosen is None:
            if required:
                raise Unavailable("no decode worker is up: the decode pool is empty")
            return None
        return views[chosen.worker_id]


NEVER_READY = StepCostModel(min_samples=2**62)  # --path-choice threshold: always "cold"


def _kv_decision(
    chosen: policy.PrefillView | policy.DecodeView | None,
    candidates: Sequence[policy.PrefillView | policy.DecodeView],
) -> str | None:
    """cache (the chosen one has the most of the prompt cached), no_cache (none has any of it),
    load_over_cache (another had more: the fallback to load)."""
    if chosen is None:
        return None
    most = max(c.cached for c in candidates)
    if most == 0:
        return "no_cache"
    return "load_over_cache" if chosen.cached < most else "cache"


def _prefill_candidate(
    view: WorkerView, reserved: tuple[int, ...] = (), cached: int = 0
) -> policy.PrefillCandidate:
    interrupts = bool(view.ready and view.ready.prefill_interrupts)
    return policy.PrefillCandidate(
        view.worker_id,
        view.prompts_ahead() + reserved,
        view.chunk_size,
        view.token_budget,
        interrupts,
        cached,
    )


def _decode_candidate(
    view: WorkerView, reserved: tuple[int, ...] = (), cached: int = 0
) -> policy.DecodeCandidate:
    return policy.DecodeCandidate(
        view.worker_id,
        view.decoding,
        view.context_per_stream(),
        view.prompts_ahead() + reserved,
        view.chunk_size,
        view.token_budget,
        cached,
    )
