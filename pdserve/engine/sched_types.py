"""The scheduler's vocabulary (pure Python): its settings, what one step runs (`SchedulerOutput`
of `ScheduledChunk`s), what handing a request over did, and its counters. The scheduler itself is
in `pdserve.engine.sched`; the runner, the worker core and the simulation read these."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pdserve.config import Role
from pdserve.engine.request import Request


@dataclass(frozen=True)
class SchedulerConfig:
    max_model_len: int
    role: Role = Role.MIXED
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    # At most this many prompt tokens of one request per step: a long prompt is split into chunks
    # so that it never holds the batch for long.
    chunk_size: int = 512
    # Decode role: how many of its latest steps the engine's own step-time model is fitted to.
    # A refit (at most once a second, on the engine thread) costs ~2 ms of pure Python at 500.
    step_cost_window: int = 500

    def __post_init__(self) -> None:
        names = ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "chunk_size", "step_cost_window")
        for name in names:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass
class ScheduledChunk:
    """`num_tokens` tokens of `request`, starting at position `start`, run in this step."""

    request: Request
    start: int
    num_tokens: int
    sample: bool  # the chunk reaches the request's last known token: sample the next one

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == 1 and self.start > 0


@dataclass
class SchedulerOutput:
    # Decode chunks first, then prompt chunks: the runner relies on that order.
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    # Decode role: (request id, block ids) to fill with KV from another worker.
    kv_to_receive: list[tuple[str, list[int]]] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


class Handover(enum.Enum):
    """What `Scheduler.hand_over` did with a request."""

    HELD = "held"  # stopped; its blocks are held (KV of every token but the last) until release
    NO_KV = "no_kv"  # it had no KV here yet (waiting, or preempted): removed, start it elsewhere
    NOT_YET = "not_yet"  # mid-prompt, or its KV is still arriving: ask again after a step
    UNKNOWN = "unknown"  # not here, finished, or already held


@dataclass(frozen=True)
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_receiving_kv: int
    num_held: int  # requests whose blocks are held for another worker (prefilled or migrated)
    queued_prompt_tokens: int
    kv_blocks_used: int
    kv_blocks_free: int
    num_preemptions: int
    # Since start, in tokens: looked up in the prefix cache when requests were admitted, and found.
    prefix_queries: int = 0
    prefix_hits: int = 0
    cached_blocks: int = 0  # keyed blocks, findable by a new prompt
