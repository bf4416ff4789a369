"""What the control plane knows of a worker: a snapshot (`WorkerView`), taken by the worker set.

The planner, the pool manager, placement and admission read these views and act through the
worker set's commands (`WorkerSet.drain`, `move_streams`, `forget_kv`); none of them touches a
link, a leg or a socket. A view is immutable: it says what was true when it was taken. No torch,
no sockets.

A worker's life is one state (`WorkerState`):
- `starting`: its backend is starting it; no Ready yet;
- `up`: it takes new requests;
- `draining`: asked to finish what it holds and take nothing new; it stays draining whatever its
  connection does (`down_cause` says when it is unreachable meanwhile);
- `down`: its connection dropped or it went silent (`down_cause`); it may come back up;
- `stopped`: it ended; the link is closed and leaves the set.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from pdserve import wire
from pdserve.router.prefix import CachedPrefixes, PromptKeys

# Before a worker's Ready says them: the engine's defaults.
DEFAULT_CHUNK, DEFAULT_BUDGET, DEFAULT_MAX_SEQS = 512, 2048, 64
DEFAULT_CONTEXT = 256.0  # tokens per stream, before a load report says


class WorkerState(enum.StrEnum):
    STARTING = "starting"
    UP = "up"
    DRAINING = "draining"
    DOWN = "down"
    STOPPED = "stopped"


class DownCause(enum.StrEnum):
    """Why a worker is unreachable: its connection dropped, or it stopped reporting (a stall; it
    may only have been slow, and comes back at its next report)."""

    DROPPED = "dropped"
    STALLED = "stalled"


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    pool: str
    state: WorkerState
    detail: str  # why it is in its state, for people
    down_cause: DownCause | None  # set while it is unreachable (down, or draining and gone quiet)
    connected: bool  # answers for the requests it holds (up or draining, and reachable)
    opened_at: float  # monotonic: when the router first knew of it
    state_since: float
    up_at: float | None  # when it first said Ready
    ready: wire.Ready | None  # its greeting: role, limits, addresses
    load: wire.Load | None  # its last load report (None while unreachable)
    load_at: float  # when that report came (0: never)
    streams: int  # this router's requests open on it
    decoding: int  # of those, the ones past their first token
    staying: int  # of those, the ones not asked to move
    # This router's prompts sent to it that have not produced a token yet, oldest first.
    queued_prompts: tuple[int, ...]
    prefill_tokens_per_s: float | None  # measured: prompt tokens a second of its prompt steps
    longest_recent_step_s: float  # its longest step reported of late (0 if none)
    prefixes: CachedPrefixes | None = None  # the block keys it has cached (the link's own, live)

    def cached_tokens(self, prompt: PromptKeys | None) -> int:
        """Tokens of that prompt it has cached (0 without prefix caching or before it says)."""
        if prompt is None or self.prefixes is None or self.ready is None or self.load is None:
            return 0
        return prompt.cached_tokens(self.prefixes, self.ready.prefix_salt, self.load.block_size)

    @property
    def up(self) -> bool:
        """Takes new requests."""
        return self.state is WorkerState.UP

    @property
    def queued_prompt_tokens(self) -> int:
        return sum(self.queued_prompts)

    @property
    def chunk_size(self) -> int:
        return self.ready.chunk_size if self.ready and self.ready.chunk_size else DEFAULT_CHUNK

    @property
    def token_budget(self) -> int:
        """Tokens it computes in one step at most."""
        ready = self.ready
        return ready.max_num_batched_tokens if ready and ready.max_num_batched_tokens else DEFAULT_BUDGET

    @property
    def max_num_seqs(self) -> int:
        return self.ready.max_num_seqs if self.ready and self.ready.max_num_seqs else DEFAULT_MAX_SEQS

    def context_per_stream(self) -> float:
        """Tokens of KV per running request, from its last load report."""
        load = self.load
        if load is None or not load.num_running or not load.block_size:
            return DEFAULT_CONTEXT
        return load.kv_blocks_used * load.block_size / load.num_running

    def prompts_ahead(self) -> tuple[int, ...]:
        """Prompt tokens still to prefill on it, oldest first: this router's prompts, matched to
        its last report (what it has computed of the oldest; other routers' prompts)."""
        ahead = list(self.queued_prompts)
        reported = self.load.queued_prompt_tokens if self.load else sum(ahead)
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

    def idle_since(self, moment: float) -> bool:
        """A load report after `moment` says it holds nothing: no request, no block."""
        load = self.load
        return (
            load is not None
            and self.load_at > moment
            and load.num_running == load.num_waiting == load.num_held == load.kv_blocks_used == 0
        )
