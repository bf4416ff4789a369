"""The state of one request inside an engine. Pure Python.

The one rule (as in vLLM v1): a request has `num_computed_tokens`, the number of its tokens whose
KV is in the cache, and each step moves it closer to `num_tokens` (prompt + sampled outputs).
Prefill, chunked prefill, decode, recompute after preemption and KV received from another worker
are all just ways of advancing that counter.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from pdserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, no KV blocks
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"  # decode role: blocks allocated, KV on its way
    RUNNING = "running"
    PREEMPTED = "preempted"  # blocks taken back; will be recomputed from scratch
    PREFILLED = "prefilled"  # prefill role: done, blocks held for a decode worker to pull
    MIGRATED = "migrated"  # stopped here to continue elsewhere: blocks held for that worker to pull
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISHED = {
    RequestStatus.FINISHED_STOPPED,
    RequestStatus.FINISHED_LENGTH,
    RequestStatus.FINISHED_ABORTED,
    RequestStatus.FINISHED_ERROR,
}
_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
    RequestStatus.PREFILLED: "prefilled",
    RequestStatus.MIGRATED: "migrated",
}


@dataclass(eq=False)  # identity, not field equality: requests live in lists and deques
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)
    # When the scheduler first gave it blocks: arrival -> here is its queue time on this engine.
    first_scheduled_time: float | None = None
    # Tokens sampled elsewhere before this engine saw the request (the first token from a prefill
    # worker; every token so far of a stream that moved here). They count as outputs.
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    # The KV of every token but the last comes from another worker instead of being computed here
    # (a prefill worker's prompt, or a stream that moved here from another decode worker).
    remote_kv: bool = False
    # The sampling generator's state where the request stopped on another worker (opaque to this
    # layer): a seeded stream that moves goes on drawing the numbers it would have drawn there.
    sampler_state: bytes | None = None
    num_preemptions: int = 0
    stop_reason: int | str | None = None
    # At most this many of its prompt tokens per step (0: the scheduler's chunk_size). The router
    # sets it for a prompt it prefills on a decode worker, so that worker's steps (and the ITL of
    # the streams it decodes meanwhile) stay within the ITL budget.
    max_chunk_tokens: int = 0
    # A prompt prefilled on a decode worker: the ITL budget (seconds) its steps must keep for the
    # streams decoding there, at `step_percentile` of the worker's own step-time errors (0: none).
    # The scheduler sizes each of its chunks to what is left of it (`Scheduler._within_budget`).
    max_step_seconds: float = 0.0
    step_percentile: float = 0.9
    # When its last token was sampled here (or the request came: a stream whose first token was
    # sampled on a prefill worker has been waiting since about then).
    last_token_time: float = field(default_factory=time.monotonic)

    @property
    def queue_seconds(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens_to_compute(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """Token ids [start, stop) of prompt + outputs, without building the concatenation."""
        n_prompt = len(self.prompt_token_ids)
        if stop <= n_prompt:
            return self.prompt_token_ids[start:stop]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : stop - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: stop - n_prompt]

    @property
    def is_finished(self) -> bool:
        return self.status.finished
