"""The scheduler: which tokens of which requests run in the next step. Pure Python.

One step at a time under a token budget. Three roles:
- `mixed`: colocated serving with chunked prefill. Requests ready to decode go first (one token
  each), then prompt chunks fill what is left of the budget (Sarathi-Serve / vLLM style).
- `prefill`: prompts only, long prompts chunked; a prompt that fits in one chunk goes before the
  next chunk of a longer one (see `_schedule_short_prompts`). A request ends after its first
  sampled token and keeps its KV blocks (status PREFILLED) until `release()` says the decode side
  has them.
- `decode`: decodes the running batch. A request whose KV comes from another worker gets
  blocks first (`SchedulerOutput.kv_to_receive`: only for what its prefix cache lacks); once the
  caller reports the KV arrived, those tokens simply count as computed. Short prompts may still
  be prefilled locally.

A request that is decoding can be handed over to another engine (`hand_over`): it stops being
scheduled here and keeps its blocks (status MIGRATED) until `release()`, exactly as a prefilled
request does; the other engine takes it with its outputs so far and pulls those blocks. `decode`
and `mixed` engines both take such requests.

When blocks run out, the latest-arrived request not yet scheduled this step is preempted: its
blocks are freed and it is recomputed from scratch later (prompt + tokens generated so far).

A decode worker's local prefill can carry a step-time budget (`Request.max_step_seconds`): each
of its chunks is then sized, step by step, to what the streams decoding beside it have left of
their ITL budget, by a cost model fitted to this engine's own steps (`observe_step`). A stream that
has already waited (one whose first token came from a prefill worker while a long step ran here)
leaves less, down to a step of decodes alone.

Nothing here knows about torch, processes or sockets.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from pdserve.config import Role
from pdserve.costmodel import Step, StepCostModel, chunk_attention
from pdserve.engine.kv import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sched_types import (
    Handover,
    ScheduledChunk,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
)

# A local prefill with a step budget takes at least this many tokens a step when the streams beside
# it waited less than FRESH_WAIT_FRACTION of the budget (so it always progresses, even when this
# engine's model says nothing fits); after streams that waited longer, it may sit a step out.
MIN_TIMED_CHUNK = 16
FRESH_WAIT_FRACTION = 0.5


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, kv: KVCacheManager, clock: Callable[[], float] = time.monotonic
    ) -> None:
        """`clock`: seconds, monotonic; the engine's wall clock, or a simulation's virtual one."""
        self.config = config
        self.kv = kv
        self.clock = clock
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.receiving: dict[str, Request] = {}  # decode role: blocks allocated, KV in flight
        # Done here, blocks held until `release()`: prefilled prompts, streams handed over.
        self.held: dict[str, Request] = {}
        self._requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Decode role: this engine's step times, to size local prefills' chunks to an ITL budget.
        self.step_cost: StepCostModel | None = (
            StepCostModel(window=config.step_cost_window) if config.role is Role.DECODE else None
        )

    # -- the narrow interface -----------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self._requests:
            raise ValueError(f"request id {request.request_id!r} is already in this scheduler")
        if request.remote_kv and self.config.role is Role.PREFILL:
            raise ValueError("a prefill-role scheduler does not take requests whose KV arrives from outside")
        if request.remote_kv and not request.output_token_ids:
            raise ValueError("a request with remote KV must carry the tokens sampled before it came here")
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self.waiting.append(request)

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.receiving)

    def abort(self, request_id: str) -> Request | None:
        """Stop the request wherever it is and free its blocks. Returns it, or None if unknown."""
        return self.finish(request_id, RequestStatus.FINISHED_ABORTED)

    def finish(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request from outside (a stop string matched, a client left, a transfer failed)."""
        if not status.finished:
            raise ValueError(f"{status} is not a finished status")
        request = self._requests.pop(request_id, None)
        if request is None:
            return None
        if request in self.running:
            self.running.remove(request)
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(request)
        self.receiving.pop(request_id, None)
        self.held.pop(request_id, None)
        request.status = status
        self.kv.free(request_id)
        return request

    def release(self, request_id: str) -> bool:
        """A held request's KV has been taken by another worker (or its lease expired): free it."""
        request = self.held.pop(request_id, None)
        if request is None:
            return False
        self._requests.pop(request_id, None)
        self.kv.free(request_id)
        return True

    def hand_over(self, request_id: str) -> Handover:
        """Stop a request here so that another engine can continue it (see the module doc).

        Only between steps: a request is HELD once it is decoding (its KV covers every token but
        the last sampled one, which the next engine computes first)."""
        request = self._requests.get(request_id)
        if request is None or request.status in (RequestStatus.PREFILLED, RequestStatus.MIGRATED):
            return Handover.UNKNOWN
        if request.status is RequestStatus.RUNNING:
            if request.num_tokens_to_compute != 1 or not request.output_token_ids:
                return Handover.NOT_YET  # still in its prompt
            self.running.remove(request)
            request.status = RequestStatus.MIGRATED
            self.held[request_id] = request
            return Handover.HELD
        if request.status is RequestStatus.WAITING_FOR_REMOTE_KV or request.remote_kv:
            return Handover.NOT_YET  # its KV is on its way: move it once it has arrived
        # Waiting or preempted: nothing of it is computed here.
        self.waiting.remove(request)
        del self._requests[request_id]
        self.kv.free(request_id)
        request.status = RequestStatus.MIGRATED
        return Handover.NO_KV

    def remote_kv_done(self, request_id: str, ok: bool) -> Request | None:
        """Decode role: the KV for `request_id` has arrived (ok) or failed to (not ok).

        On failure the request ends with FINISHED_ERROR and its blocks are freed; the caller says
        so loudly and the router retries. Returns the request, or None if it is no longer here."""
        request = self.receiving.pop(request_id, None)
        if request is None:
            return None
        if not ok:
            self._requests.pop(request_id, None)
            self.kv.free(request_id)
            request.status = RequestStatus.FINISHED_ERROR
            return request
        request.num_computed_tokens = request.num_tokens - 1  # all but the last sampled token
        # What arrived is this engine's cache now: the conversation's next turn finds it here.
        self.kv.commit(request_id, request.num_computed_tokens, request.token_ids_slice)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return request

    def admit_remote_kv(self) -> list[tuple[str, list[int]]]:
        """Decode role: give blocks now to the waiting requests at the head of the queue whose KV
        comes from another worker; returns (request id, block ids) to pull into.

        `schedule()` does the same, but only when a step starts, and the pull can only begin
        after that step: a newcomer then waits a step for its blocks, another for its KV to be
        noticed, and a third to decode. Called between steps, the pull overlaps nothing and the
        request can join the very next step."""
        admitted: list[tuple[str, list[int]]] = []
        while self.waiting and len(self.running) + len(self.receiving) < self.config.max_num_seqs:
            request = self.waiting[0]
            if not (request.remote_kv and request.num_computed_tokens == 0):
                break  # arrival order: a local prompt ahead of it is scheduled first
            if not self._start_receiving(request, admitted):
                break
        return admitted

    def _start_receiving(self, request: Request, kv_to_receive: list[tuple[str, list[int]]]) -> bool:
        """Blocks for a remote-KV request at the head of the queue; False if there are none free.

        Its first blocks that this engine has cached (the conversation it decoded last turn, say)
        are shared, not pulled: only the blocks after them are to receive (a delta), and the
        caller pulls the handle's last blocks into them."""
        request_id, have = request.request_id, request.num_tokens - 1  # KV of all but the last token
        hit = 0
        if not self.kv.has_blocks(request_id):
            hit = self.kv.match_prefix(request_id, request.token_ids_slice(0, request.num_tokens), have)
        new_blocks = self.kv.allocate(request_id, have)
        if new_blocks is None:
            if hit:
                self.kv.free(request_id)
            return False
        self.kv.count_lookup(have, hit)
        self.waiting.popleft()
        request.first_scheduled_time = request.first_scheduled_time or self.clock()
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.receiving[request.request_id] = request
        kv_to_receive.append((request_id, new_blocks))
        return True

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        if self.config.role is Role.PREFILL and self._short_prompt_waiting():
            self._schedule_short_prompts(out)
            if out.chunks:
                return out
            # None could start (no blocks, or max_num_seqs): the running prompts go on instead.
        budget = self.config.max_num_batched_tokens
        scheduled: set[str] = set()
        decodes: list[ScheduledChunk] = []
        prompts: list[ScheduledChunk] = []

        # 1. Running requests, those ready to decode before those still in their prompt.
        ordered = sorted(self.running, key=lambda r: r.num_tokens_to_compute > 1)
        for request in ordered:
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            num_new = min(request.num_tokens_to_compute, budget, self._chunk_limit(request))
            if request.num_tokens_to_compute > 1:  # a prompt chunk
                num_new = self._within_step_budget(request, num_new, decodes, prompts)
                if num_new == 0:
                    continue
            if not self._allocate_or_preempt(request, num_new, scheduled, out):
                continue  # the request itself was preempted
            chunk = self._chunk(request, num_new)
            (decodes if chunk.is_decode else prompts).append(chunk)
            scheduled.add(request.request_id)
            budget -= num_new

        # 2. Waiting requests, in arrival order (preempted ones were put back at the front).
        while self.waiting and budget > 0:
            if len(self.running) + len(self.receiving) >= self.config.max_num_seqs:
                break
            request = self.waiting[0]
            if request.remote_kv and request.num_computed_tokens == 0:
                if not self._start_receiving(request, out.kv_to_receive):
                    break
                continue
            hit = self._reuse_cached_prefix(request)
            num_new = min(request.num_tokens_to_compute, budget, self._chunk_limit(request))
            num_new = self._within_step_budget(request, num_new, decodes, prompts)
            if num_new == 0:
                self._unreuse(request, hit)
                break  # its turn comes in a step with room for it (arrival order kept)
            if self.kv.allocate(request.request_id, request.num_computed_tokens + num_new) is None:
                self._unreuse(request, hit)
                break  # no room: wait for blocks to free up rather than preempt running work
            self._admitted(request, hit)
            self.waiting.popleft()
            request.first_scheduled_time = request.first_scheduled_time or self.clock()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            chunk = self._chunk(request, num_new)
            (decodes if chunk.is_decode else prompts).append(chunk)
            scheduled.add(request.request_id)
            budget -= num_new

        out.chunks = decodes + prompts
        return out

    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance the scheduled requests. Returns those that got a token (finished ones included)."""
        updated: list[Request] = []
        now = self.clock()
        for chunk in out.chunks:
            request = chunk.request
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens += chunk.num_tokens
            self.kv.commit(request.request_id, request.num_computed_tokens, request.token_ids_slice)
            if not chunk.sample:
                continue
            token = sampled[request.request_id]
            request.output_token_ids.append(token)
            request.last_token_time = now
            updated.append(request)
            status = self._stop_status(request, token)
            if status is not None:
                self.finish(request.request_id, status)
                request.status = status
            elif self.config.role is Role.PREFILL:
                self.running.remove(request)
                request.status = RequestStatus.PREFILLED
                self.held[request.request_id] = request
        return updated

    def stats(self) -> SchedulerStats:
        queued = sum(r.num_tokens_to_compute for r in self.waiting if not r.remote_kv)
        queued += sum(r.num_tokens_to_compute for r in self.running if r.num_tokens_to_compute > 1)
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_receiving_kv=len(self.receiving),
            num_held=len(self.held),
            queued_prompt_tokens=queued,
            kv_blocks_used=self.kv.num_used_blocks,
            kv_blocks_free=self.kv.num_free_blocks,
            num_preemptions=self.num_preemptions,
            prefix_queries=self.kv.prefix_queries,
            prefix_hits=self.kv.prefix_hits,
            cached_blocks=self.kv.num_cached_blocks,
        )

    # -- internals ----------------------------------------------------------------------------------
    def _short_prompt_waiting(self) -> bool:
        return any(r.num_tokens_to_compute <= self.config.chunk_size for r in self.waiting)

    def schedule_between_layers(self, below_tokens: float) -> SchedulerOutput:
        """Prefill role, between two layers of a step that is running: a step of the waiting
        prompts of at most one chunk (oldest first) whose tokens together are fewer than
        `below_tokens`, the least that any prompt of the running step still has to compute
        (shortest remaining first: a prompt shorter than what is left of every prompt in that
        step finishes sooner this way, and the step's prompts finish later by as much, which
        their longer remainder makes the smaller share). Empty when none qualifies. Only takes
        waiting requests: those of the running step are untouched until it ends."""
        out = SchedulerOutput()
        if self.config.role is not Role.PREFILL or below_tokens <= 1:
            return out
        return self._schedule_short_prompts(out, math.ceil(below_tokens) - 1)

    def _schedule_short_prompts(self, out: SchedulerOutput, budget: int | None = None) -> SchedulerOutput:
        """Prefill role: a step of waiting prompts that fit in one chunk, and nothing else.

        A short prompt that arrives while a long one is being prefilled would otherwise ride in
        the same step as the long prompt's next chunk and wait for all of it: its TTFT would be
        the long chunk's time. Here it goes first, in a step of its own size; the long prompt
        continues in the next step without short prompts waiting (shortest-first between
        chunks; under a steady stream of short prompts the long one still gets every step in
        which none is waiting). `budget`: at most this many tokens (default the step's budget)."""
        budget = min(self.config.max_num_batched_tokens, budget or self.config.max_num_batched_tokens)
        for request in [r for r in self.waiting if r.num_tokens_to_compute <= self.config.chunk_size]:
            if len(self.running) + len(self.receiving) >= self.config.max_num_seqs:
                break
            hit = self._reuse_cached_prefix(request)
            num_new = request.num_tokens_to_compute
            if num_new > budget:
                self._unreuse(request, hit)
                break
            if self.kv.allocate(request.request_id, request.num_computed_tokens + num_new) is None:
                self._unreuse(request, hit)
                break  # no room: wait for blocks to free up rather than preempt running work
            self._admitted(request, hit)
            self.waiting.remove(request)
            request.first_scheduled_time = request.first_scheduled_time or self.clock()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new
        return out

    def _reuse_cached_prefix(self, request: Request) -> int:
        """A request about to start here with nothing computed: the cached blocks of its longest
        cached prefix become its own (shared), and their tokens count as computed. Returns how
        many tokens they hold. At least its last token is left to compute (for the logits)."""
        if request.num_computed_tokens or request.remote_kv or self.kv.has_blocks(request.request_id):
            return 0
        tokens = request.token_ids_slice(0, request.num_tokens)
        hit = self.kv.match_prefix(request.request_id, tokens, request.num_tokens - 1)
        request.num_computed_tokens = hit
        return hit

    def _unreuse(self, request: Request, hit: int) -> None:
        """The request could not start after all: it lets go of the cached blocks it was given."""
        if hit:
            self.kv.free(request.request_id)
            request.num_computed_tokens = 0

    def _admitted(self, request: Request, hit: int) -> None:
        if not request.remote_kv:
            self.kv.count_lookup(request.num_tokens, hit)

    def _chunk_limit(self, request: Request) -> int:
        if request.num_tokens_to_compute == 1:
            return 1
        if request.max_chunk_tokens:
            return min(request.max_chunk_tokens, self.config.chunk_size)
        return self.config.chunk_size

    def _within_step_budget(
        self, request: Request, limit: int, decodes: list[ScheduledChunk], prompts: list[ScheduledChunk]
    ) -> int:
        """How many of `limit` prompt tokens of `request` (`limit` is at most the router's chunk,
        sized for the streams it saw and one more) fit this step: all of them unless it has a step
        budget and streams decode beside it. Then it is what this engine's cost model says fits
        in the budget (divided by the model's under-prediction of such steps at the request's
        percentile) less what the longest-waiting of those streams already waited: 0 (a step of
        decodes alone) when that is nothing, and never less than MIN_TIMED_CHUNK when the
        streams are fresh, so that the prompt always gets on."""
        cost = self.step_cost
        if not request.max_step_seconds:
            return limit
        if not decodes or cost is None or not cost.ready:
            return limit  # no stream to stall now, or no model yet: the router's chunk
        now = self.clock()
        waited = max(0.0, max(now - c.request.last_token_time for c in decodes))
        step_s = request.max_step_seconds / cost.mixed_step_margin(request.step_percentile) - waited
        base = Step(
            sum(c.num_tokens for c in prompts),
            sum(chunk_attention(c.start, c.num_tokens) for c in prompts),
            len(decodes),
            sum(c.start + 1 for c in decodes),
        )
        fits = cost.chunk_within(step_s, base, request.num_computed_tokens, limit)
        if fits == 0 and waited < FRESH_WAIT_FRACTION * request.max_step_seconds:
            fits = min(limit, MIN_TIMED_CHUNK)
        return fits

    def observe_step(self, step: Step, seconds: float) -> None:
        """What the last step computed and how long it took (feeds the decode role's step model)."""
        if self.step_cost is not None:
            self.step_cost.add(step, seconds)

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(request, start, num_new, sample=start + num_new == request.num_tokens)

    def _allocate_or_preempt(
        self, request: Request, num_new: int, scheduled: set[str], out: SchedulerOutput
    ) -> bool:
        """Make room for `num_new` more tokens of a running request, preempting if needed.

        Returns False if the request itself had to be preempted."""
        total = request.num_computed_tokens + num_new
        while self.kv.allocate(request.request_id, total) is None:
            victims = [r for r in self.running if r.request_id not in scheduled and r is not request]
            victim = max(victims, key=lambda r: r.arrival_time) if victims else request
            self._preempt(victim)
            out.preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.remote_kv = False  # whatever KV came from outside is gone: recompute it here
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    def _stop_status(self, request: Request, token: int) -> RequestStatus | None:
        params = request.sampling_params
        # Below min_tokens the sampler cannot pick these; a token that came another way (a
        # forced logit_bias over a ban, say) does not end the request early either.
        may_stop = request.num_output_tokens > params.min_tokens
        if may_stop and not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if may_stop and token in params.stop_token_ids:
            request.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= params.max_tokens or request.num_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
