"""The engine core: a step is schedule -> run -> update. Requests in, tokens out (token ids only).

Text (tokenizing prompts, detokenizing outputs, stop strings) lives outside the core, in the
offline `LLM` or the router, which end a request here with `finish()` when a stop string matches.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from pdserve.config import EngineConfig, Role
from pdserve.costmodel import Step, chunk_attention
from pdserve.engine.kv import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sched import Scheduler
from pdserve.engine.sched_types import Handover, SchedulerConfig, SchedulerOutput, SchedulerStats
from pdserve.errors import InvalidRequestError
from pdserve.modelfiles.config import ModelConfig
from pdserve.outputs import TokenLogprob
from pdserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


@dataclass
class EngineOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None
    finished: bool  # no more tokens will come (PREFILLED counts: the decode side takes over)
    finish_reason: str | None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    queue_seconds: float | None = None  # arrival -> first scheduled on this engine


@dataclass
class StepStats:
    """One step, as the cost model sees it (pdserve.costmodel fits step time to these)."""

    num_batched_tokens: int
    num_decode_tokens: int  # = the decode streams of the step (one token each)
    step_seconds: float
    num_prefill_tokens: int = 0  # prompt tokens of the step (its prompt chunks)
    # Attention work: per prompt chunk, its tokens x the positions they attend to (on average);
    # per decode stream, its context. Prefill attention grows with the square of the prompt.
    prefill_attention: int = 0
    decode_context: int = 0


@dataclass
class RunnerOutput:
    """What a runner's step sampled: a token per request that reached its sampling point."""

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # How long the step took, when the runner says (a modelled runner in a simulation); None: the
    # engine times it.
    seconds: float | None = None


@dataclass(frozen=True)
class EngineLimits:
    """What the engine core checks requests against, and where its steps run."""

    vocab_size: int
    num_layers: int
    max_model_len: int  # the context, never more than the whole KV cache holds
    device_type: str  # "cpu" or "cuda": a CPU prefill engine can run prompts between two layers


class Runner(Protocol):
    """What the engine core asks of the part that runs its steps: the model on a device
    (runner.ModelRunner), or a modelled one in a simulation."""

    def execute(
        self, out: SchedulerOutput, kv: KVCacheManager, between_layers: Callable[[int], None] | None = None
    ) -> RunnerOutput: ...

    def release(self, request_id: str) -> None: ...

    def generator_state(self, request_id: str) -> bytes | None: ...


AnyRunner = TypeVar("AnyRunner", bound=Runner)


class EngineCore(Generic[AnyRunner]):
    def __init__(
        self,
        config: EngineConfig,
        limits: EngineLimits,
        scheduler: Scheduler,
        runner: AnyRunner,
        eos_token_ids: tuple[int, ...],
    ) -> None:
        """The scheduler (with its KV cache's bookkeeping and its clock) around a `runner` that
        runs its steps: the model on a device (engine/factory.py builds one), or a modelled one in
        a simulation. `engine_core` builds the scheduler from the configuration."""
        self.config = config
        self.limits = limits
        self.eos_token_ids = eos_token_ids
        self.max_num_batched_tokens = scheduler.config.max_num_batched_tokens
        self.chunk_size = scheduler.config.chunk_size
        self.max_model_len = limits.max_model_len
        self.kv = scheduler.kv
        self.scheduler = scheduler
        self.runner = runner
        self.last_step: StepStats | None = None
        # Prefill role: the step whose layers are running and the share of them done (while
        # `step` calls its `between_layers`), the time spent in steps run between them, and how
        # many such steps ran (`step_between_layers`).
        self._in_flight: tuple[SchedulerOutput, float] | None = None
        self._nested_seconds = 0.0
        self.steps_between_layers = 0
        self._kv_to_receive: list[tuple[str, list[int]]] = []

    # -- requests -------------------------------------------------------------------------------------
    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequestError for anything this engine cannot serve. Changes nothing."""
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        params.validate()
        if not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty: give at least one token")
        vocab = self.limits.vocab_size
        for token in prompt_token_ids:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
                raise InvalidRequestError(f"token id {token!r} is outside the vocabulary [0, {vocab})")
        outside = [t for t in (*params.stop_token_ids, *params.logit_bias) if t >= vocab]
        if outside:
            raise InvalidRequestError(f"token ids {outside[:4]} are outside the vocabulary [0, {vocab})")
        if len(prompt_token_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_token_ids)} tokens but this engine's context is "
                f"{self.max_model_len} tokens, and at least one must be left to generate"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        output_token_ids: Sequence[int] = (),
        kv_elsewhere: bool = True,
        sampler_state: bytes | None = None,
        max_chunk_tokens: int = 0,
        max_step_seconds: float = 0.0,
        step_percentile: float = 0.9,
        arrived_at: float | None = None,
    ) -> None:
        """Queue a request. `output_token_ids`: tokens it already sampled on another worker (the
        first token from a prefill worker, or all of a stream's tokens so far when it moves here);
        the KV of every token but the last will arrive from that worker (`take_kv_to_receive`),
        or, without `kv_elsewhere`, is computed here again, prompt and outputs together, as after
        a preemption (a stream whose worker died goes on from what its client has seen).
        `sampler_state`: where its sampling generator stood there (`hand_over`).
        `max_chunk_tokens`: at most this many of its prompt tokens in one step (0: the engine's
        chunk size). `max_step_seconds` (decode role; 0: none): each of its prompt chunks sized so
        that the step keeps the streams decoding beside it within that ITL budget, at
        `step_percentile` of this engine's step-time errors. `arrived_at`: when it reached this
        process (time.monotonic; default now), if that was before this call (during a step)."""
        self.validate(prompt_token_ids, params)
        if (
            isinstance(max_chunk_tokens, bool)
            or not isinstance(max_chunk_tokens, int)
            or max_chunk_tokens < 0
        ):
            raise InvalidRequestError(f"max_chunk_tokens must be an int >= 0, got {max_chunk_tokens!r}")
        if isinstance(max_step_seconds, bool) or not (
            isinstance(max_step_seconds, (int, float)) and 0 <= max_step_seconds < math.inf
        ):
            raise InvalidRequestError(f"max_step_seconds must be a number >= 0, got {max_step_seconds!r}")
        if not (isinstance(step_percentile, (int, float)) and 0 < step_percentile < 1):
            raise InvalidRequestError(f"step_percentile must be in (0, 1), got {step_percentile!r}")
        request = Request(request_id, list(prompt_token_ids), params, self.eos_token_ids)
        request.max_chunk_tokens = max_chunk_tokens
        request.max_step_seconds = float(max_step_seconds)
        request.step_percentile = float(step_percentile)
        now = self.scheduler.clock()
        request.arrival_time = request.last_token_time = now if arrived_at is None else min(arrived_at, now)
        if output_token_ids:
            self._validate_outputs(list(output_token_ids), params, len(prompt_token_ids))
            request.output_token_ids.extend(output_token_ids)
            request.remote_kv = kv_elsewhere
            request.sampler_state = sampler_state
        self.scheduler.add_request(request)

    def _validate_outputs(self, outputs: list[int], params: SamplingParams, num_prompt: int) -> None:
        vocab = self.limits.vocab_size
        for token in outputs:
            if not isinstance(token, int) or isinstance(token, bool) or not 0 <= token < vocab:
                raise InvalidRequestError(f"output token id {token!r} is outside the vocabulary [0, {vocab})")
        if len(outputs) >= params.max_tokens:
            raise InvalidRequestError(f"{len(outputs)} tokens already sampled: max_tokens is reached")
        if num_prompt + len(outputs) >= self.max_model_len:
            raise InvalidRequestError(
                f"{num_prompt + len(outputs)} tokens do not leave room in this engine's context "
                f"({self.max_model_len} tokens)"
            )

    def hand_over(self, request_id: str) -> tuple[Handover, Request | None, bytes | None]:
        """Stop a request here so another worker can continue it (`Scheduler.hand_over`).
        Returns what happened, the request (HELD or NO_KV) and its sampling generator's state."""
        request = self.scheduler.get(request_id)
        outcome = self.scheduler.hand_over(request_id)
        if outcome not in (Handover.HELD, Handover.NO_KV):
            return outcome, None, None
        # Not sampled here yet (it moves on before its first step here): the state it came with.
        state = self.runner.generator_state(request_id) or (request.sampler_state if request else None)
        self.runner.release(request_id)
        return outcome, request, state

    def abort(self, request_id: str) -> bool:
        request = self.scheduler.abort(request_id)
        self.runner.release(request_id)
        return request is not None

    def finish(self, request_id: str, stop_reason: str | None = None) -> bool:
        """End a request that matched a stop string (decided outside the core)."""
        request = self.scheduler.finish(request_id, RequestStatus.FINISHED_STOPPED)
        self.runner.release(request_id)
        if request is not None:
            request.stop_reason = stop_reason
        return request is not None

    def release(self, request_id: str) -> bool:
        """Free the blocks of a held request (prefilled, or handed over) once its KV is taken."""
        return self.scheduler.release(request_id)

    def kv_received(self, request_id: str, ok: bool) -> EngineOutput | None:
        """Decode role: the prompt KV of a request arrived (or failed to). A failure ends the
        request with finish_reason 'error'; the caller logs and counts it and the router retries."""
        request = self.scheduler.remote_kv_done(request_id, ok)
        if request is None or ok:
            return None
        self.runner.release(request_id)
        return EngineOutput(request_id, [], None, True, "error")

    def admit_remote_kv(self) -> None:
        """Decode role: blocks for waiting remote-KV requests now, between steps, so their pulls
        can start (`take_kv_to_receive`) before the next step rather than after it."""
        self._kv_to_receive.extend(self.scheduler.admit_remote_kv())

    def take_kv_to_receive(self) -> list[tuple[str, list[int]]]:
        """Decode role: (request id, block ids) whose KV the caller must now bring in, then report
        with `kv_received`."""
        pending, self._kv_to_receive = self._kv_to_receive, []
        return pending

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    def held_tokens(self, request_id: str) -> int:
        """Tokens of a request held here for another engine (prefilled, or handed over)."""
        return self.scheduler.held[request_id].num_tokens

    def held_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        """The block ids that hold a request's first `num_tokens` tokens, in order."""
        return list(self.kv.block_table(request_id)[: self.kv.blocks_for_tokens(num_tokens)])

    def stats(self) -> SchedulerStats:
        return self.scheduler.stats()

    # -- the step ---------------------------------------------------------------------------------
    def step(self, between_layers: Callable[[], None] | None = None) -> list[EngineOutput]:
        """One step. `between_layers` (prefill role on CPU; else ignored): called between two
        layers of the step, where the caller may add requests and call `step_between_layers`."""
        started = time.perf_counter()
        out = self.begin_step()
        if out is None:
            return []
        hook = None
        if between_layers is not None and self.interruptible(out):

            def hook(layers_done: int) -> None:
                self.at_layer(out, layers_done)
                between_layers()

        self._nested_seconds = 0.0
        try:
            result = self.runner.execute(out, self.kv, hook)
        finally:
            self._in_flight = None
        # The steps run between its layers are steps of their own (the cost model sees each).
        return self._finish(out, result, time.perf_counter() - started - self._nested_seconds)

    # `step` in parts, for a caller that runs the step's layers itself, in its own time (the
    # simulator: pdserve/sim/worker.py): begin_step, then at_layer / step_between_layers between
    # two of its layers if `interruptible`, then finish_step with what the runner returned.
    def begin_step(self) -> SchedulerOutput | None:
        """Schedules the next step; None when there is nothing to run."""
        out = self.scheduler.schedule()
        self._kv_to_receive.extend(out.kv_to_receive)
        return None if out.is_empty else out

    def interruptible(self, out: SchedulerOutput) -> bool:
        """Whether short prompts may run between two layers of this step."""
        return self.interrupts_steps and out.num_batched_tokens > 1

    def at_layer(self, out: SchedulerOutput, layers_done: int) -> None:
        """The step `out` has run `layers_done` of its layers (what `step_between_layers` reads)."""
        self._in_flight = (out, layers_done / self.limits.num_layers)

    def finish_step(self, out: SchedulerOutput, result: RunnerOutput, seconds: float) -> list[EngineOutput]:
        self._in_flight = None
        return self._finish(out, result, seconds)

    @property
    def interrupts_steps(self) -> bool:
        """Whether `step(between_layers=...)` calls it: on a prefill engine on CPU. (On a GPU the
        layers are queued ahead of their execution: a call between two launches says nothing of
        where the device is.)"""
        return self.scheduler.config.role is Role.PREFILL and self.limits.device_type == "cpu"

    def step_between_layers(self) -> list[EngineOutput]:
        """From `step`'s `between_layers`: a step of waiting short prompts that are shorter than
        what every prompt of the running step still has left (`Scheduler.schedule_between_layers`),
        run now, between two of its layers; [] when none is. Its outputs are final as any step's."""
        if self._in_flight is None:
            raise RuntimeError("step_between_layers is only for step's between_layers callback")
        running, done = self._in_flight
        left = min(
            c.request.num_tokens_to_compute - c.num_tokens + c.num_tokens * (1.0 - done)
            for c in running.chunks
        )
        out = self.scheduler.schedule_between_layers(left)
        if out.is_empty:
            return []
        started = time.perf_counter()
        result = self.runner.execute(out, self.kv)
        seconds = time.perf_counter() - started
        self._nested_seconds += seconds
        self.steps_between_layers += 1
        return self._finish(out, result, seconds)

    def _finish(self, out: SchedulerOutput, result: RunnerOutput, seconds: float) -> list[EngineOutput]:
        if result.seconds is not None:
            seconds = result.seconds
        updated = self.scheduler.update_from_output(out, result.sampled)
        outputs = []
        for request in updated:
            rid = request.request_id
            status = request.status
            done = status.finished or status is RequestStatus.PREFILLED
            if done:
                self.runner.release(rid)
            logprob = result.logprobs.get(rid)
            outputs.append(
                EngineOutput(
                    request_id=rid,
                    new_token_ids=[request.output_token_ids[-1]],
                    new_logprobs=[logprob] if logprob is not None else None,
                    finished=done,
                    finish_reason=status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_preemptions=request.num_preemptions,
                    queue_seconds=request.queue_seconds,
                )
            )
        features = step_features(out)
        stats = StepStats(
            num_batched_tokens=out.num_batched_tokens,
            num_decode_tokens=features.decode_streams,
            step_seconds=seconds,
            num_prefill_tokens=features.prefill_tokens,
            prefill_attention=features.prefill_attention,
            decode_context=features.decode_context,
        )
        self.last_step = stats
        self.scheduler.observe_step(features, stats.step_seconds)
        return outputs


def step_features(out: SchedulerOutput) -> Step:
    """What a scheduled step computes, as the cost model and a profile's step time count it."""
    decodes = [c for c in out.chunks if c.is_decode]
    prompts = [c for c in out.chunks if not c.is_decode]
    return Step(
        prefill_tokens=sum(c.num_tokens for c in prompts),
        prefill_attention=sum(chunk_attention(c.start, c.num_tokens) for c in prompts),
        decode_streams=len(decodes),
        decode_context=sum(c.start + 1 for c in decodes),
    )


def engine_core(
    config: EngineConfig,
    model_config: ModelConfig,
    runner: AnyRunner,
    eos_token_ids: tuple[int, ...],
    num_blocks: int,
    device_type: str,
    clock: Callable[[], float] = time.monotonic,
    cache_salt: str = "",
) -> EngineCore[AnyRunner]:
    """An engine core as configured, over `num_blocks` KV blocks: its step budget (as configured,
    else the device's: a GPU's steps are far larger), its context (never more than the cache),
    the scheduler and its KV bookkeeping. `clock`: the scheduler's (arrival and token times, the
    ITL budget's wait), monotonic seconds; a simulation gives a virtual one. `cache_salt`: what
    besides the tokens makes two blocks' KV differ (the model, the cache's dtype), in every key of
    the prefix cache."""
    max_num_batched_tokens, chunk_size = config.step_budget(device_type)
    context = config.max_model_len or model_config.max_position_embeddings
    # A request can never need more than the whole cache, or it would preempt itself forever.
    max_model_len = min(context, num_blocks * config.block_size)
    scheduler = Scheduler(
        SchedulerConfig(
            max_model_len=max_model_len,
            role=config.role,
            max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            chunk_size=chunk_size,
        ),
        KVCacheManager(num_blocks, config.block_size, config.prefix_cache, cache_salt.encode()),
        clock,
    )
    limits = EngineLimits(model_config.vocab_size, model_config.num_layers, max_model_len, device_type)
    return EngineCore(config, limits, scheduler, runner, eos_token_ids)
