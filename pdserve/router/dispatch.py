"""One request's journey across the workers: path, workers, retries, KV release. No torch.

Disaggregated path: the prefill worker answers with the first token and a KV handle; that token
is passed on at once (TTFT); the decode worker pulls the KV, acknowledges (`KVPulled`, and the
router releases the prefill worker's blocks), then streams the rest. Local path: the decode (or
mixed) worker prefills and decodes by itself.

When a prefill worker dies, a KV transfer fails, or a decode worker dies mid-stream, the request
is prefilled again (on another prefill worker, or locally) from what the client has already seen:
the prompt, and the tokens already streamed as its outputs (their KV computed again, as after a
preemption, so penalties, min_tokens and max_tokens still count them). A greedy stream goes on
with the tokens it would have had; a sampled one with a fresh draw (its generator died with the
worker). Each retry is logged with the request id and counted (`pdserve_request_retries_total`).
Every wait has a timeout. Whatever happens, every leg still open on a worker is aborted when the
request ends, so no KV block is left behind.

A stream moves (its worker drains, or the pool rebalances): the worker answers `Migrate` with
`Migrated` and holds the stream's blocks under a lease; the stream continues on another worker,
which pulls those blocks and goes on from the next token, exactly as after a remote prefill. The
client sees one stream. If the move cannot happen (no other worker, a failed pull), the stream is
prefilled again from prompt + tokens so far, as after any failure (counted, logged).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

from pdserve import clock, wire
from pdserve.router import policy
from pdserve.router.admission import Admission
from pdserve.router.config import RouterConfig
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement import Placement, Unavailable
from pdserve.router.prefix import PromptKeys
from pdserve.router.request_state import RequestFailed, RequestInvalid, RequestState, TokenEvent
from pdserve.router.workers import Leg, LegEvent, WorkerDown, WorkerSet, WorkerView
from pdserve.signals import Signals
from pdserve.slo import ms_text

logger = logging.getLogger(__name__)


def _refused(state: RequestState, message: str) -> RequestFailed:
    if state.retries == 0 and state.migrations == 0:
        return RequestInvalid(message)
    return RequestFailed(message)


class _Retry(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class _Attempt:
    """One try at the request, from `start` tokens into it: a retry continues from what the
    client has seen, those tokens its outputs so far (their KV computed again)."""

    leg_id: str
    tokens: list[int]  # the request's prompt
    params: wire.WireSamplingParams
    emitted: list[int]  # every token of the request streamed so far (shared, it grows)
    start: int  # tokens streamed before this attempt

    @property
    def outputs(self) -> list[int]:
        """The request's outputs so far, as its worker knows them."""
        return self.emitted


@dataclass
class _Move:
    """A stream moving to another worker, until its KV is there and its next token out."""

    reason: str  # drain | rebalance
    since: float  # its last token on the old worker
    counted: bool = False


class Dispatcher:
    def __init__(
        self,
        workers: WorkerSet,
        config: RouterConfig,
        metrics: RouterMetrics,
        signals: Signals | None = None,
        *,
        at_bounds: Callable[[], bool] | None = None,
    ) -> None:
        """`at_bounds`: whether every pool is at its bound (or the budget), from whoever manages
        them; none: the pools are as they are, always at their bounds."""
        self.workers = workers
        self.config = config
        self.metrics = metrics
        self.signals = signals or Signals()
        self.placement = Placement(workers, config, self.signals, self._kv_choice)
        self._load_over_cache_logged = 0.0  # when the fallback was last logged (at most every 10 s)
        self._load_over_cache_since = 0
        self.admission = Admission(workers, config, metrics, self.signals, self.placement, at_bounds)

    def _kv_choice(self, pool: str, decision: str) -> None:
        """A worker chosen with the prompt's cached blocks weighed (Placement's `on_kv_choice`):
        counted; the fallback to load over a worker holding more of the prompt is logged too."""
        self.metrics.kv_routing.labels(pool, decision).inc()
        if decision != "load_over_cache":
            return
        self._load_over_cache_since += 1
        now = clock.monotonic()
        if now - self._load_over_cache_logged >= 10.0:
            logger.info(
                "KV-aware routing: %d request(s) sent to a less loaded %s worker than the one with more "
                "of the prompt cached, whose streams were over the slack (pdserve_kv_routing_total "
                "decision=load_over_cache)",
                self._load_over_cache_since,
                pool,
            )
            self._load_over_cache_logged, self._load_over_cache_since = now, 0

    async def generate(
        self, state: RequestState, prompt: list[int], params: wire.WireSamplingParams
    ) -> AsyncGenerator[TokenEvent, None]:
        """Token events of one request, the last with its finish reason. Raises Unavailable,
        Overloaded (before any token) or RequestFailed. Closing the iterator early aborts the
        request everywhere."""
        reservation, state.reservation = state.reservation, None
        self.admission.start(reservation)  # from here its prompt is queued on a worker
        emitted: list[int] = []
        stream_pool = "colocated" if self.workers.count_up("colocated") else "decode"
        self.signals.stream_started(stream_pool)  # decode demand counts from admission
        last_retry: _Retry | None = None
        try:
            while True:
                try:
                    async for event in self._attempt(state, prompt, emitted, params):
                        emitted.extend(event.token_ids)
                        yield event
                    state.outcome = "ok"
                    return
                except Unavailable as exc:
                    if last_retry is None:
                        raise
                    # Say why it needed another worker, not only that there was none.
                    raise Unavailable(f"{last_retry}, and it cannot go on: {exc}") from None
                except _Retry as retry:
                    last_retry = retry
                    for leg in state.legs:  # the failed attempt's blocks go now, not at the end
                        leg.close(abort=True)
                    state.retries += 1
                    self.metrics.retries.labels(retry.reason).inc()
                    if state.retries > self.config.max_retries:
                        raise RequestFailed(
                            f"request failed after {self.config.max_retries} retries: {retry}"
                        ) from None
                    logger.warning("request %s: retry %d (%s)", state.request_id, state.retries, retry)
                    if len(emitted) >= params.max_tokens:
                        yield TokenEvent([], "length")
                        state.outcome = "ok"
                        return
        except (RequestFailed, Unavailable):
            state.outcome = "error"
            raise
        finally:
            for leg in state.legs:
                leg.close(abort=True)  # a no-op for legs the worker is done with
            self.admission.finish()
            self.signals.stream_ended(stream_pool)
            self.signals.request_over(state.request_id)
            self.metrics.requests.labels(state.path, state.outcome).inc()

    # -- one attempt ------------------------------------------------------------------------------
    async def _attempt(
        self, state: RequestState, prompt: list[int], emitted: list[int], params: wire.WireSamplingParams
    ) -> AsyncIterator[TokenEvent]:
        attempt = _Attempt(
            leg_id=state.new_leg_id(), tokens=prompt, params=params, emitted=emitted, start=len(emitted)
        )
        tokens, leg_id = attempt.tokens, attempt.leg_id
        resumed = list(emitted)  # a retry's outputs so far: computed again with the prompt
        to_compute = len(tokens) + len(resumed)
        prompt_keys = PromptKeys([*tokens, *resumed])  # what each worker has cached of it
        choice, prefill, local = self.placement.choose_path(to_compute, prompt=prompt_keys)
        self.metrics.path_choices.labels(choice.path, choice.reason).inc()
        self.metrics.stall_margin.set(choice.stall_margin)
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "request %s: %s prefill of %d tokens (%s): predicted TTFT remote %s, local %s; "
                "stall %s, chunk %d, margin %.2f",
                state.request_id,
                choice.path,
                to_compute,
                choice.reason,
                ms_text(choice.remote_ttft),
                ms_text(choice.local_ttft),
                ms_text(choice.stall_s),
                choice.chunk,
                choice.stall_margin,
            )
        first_attempt = state.choice is None  # demand counts once per request, not per retry
        if first_attempt:
            state.choice = choice
            self.signals.paths[choice.path] += 1
        now = clock.monotonic()
        if prefill is None:
            assert local is not None
            decode = local
            if first_attempt:
                self.signals.prompt_admitted(decode.pool, len(tokens), choice.alone_s, now)
                self.signals.awaiting_first_token(state.request_id, decode.pool, now, choice.alone_s)
                if decode.pool == "decode" and choice.reason == "no_prefill_worker":
                    # A disaggregated server whose prefill pool has nobody up (it may start with
                    # none): its demand still shows there, so the planner can give it a worker.
                    self.signals.prompt_admitted("prefill", len(tokens), choice.alone_s, now)
            state.path = "colocated" if decode.pool == "colocated" else "local_prefill"
            add = wire.AddRequest(
                leg_id,
                tokens,
                params,
                output_token_ids=resumed,
                max_chunk_tokens=choice.chunk,
                max_step_seconds=choice.step_budget_s,
                step_percentile=self.config.slo.percentile,
            )
            leg = self._open(state, decode, to_compute, add)
            async for event in self._stream(state, attempt, leg, kv_pending=False, choice=choice):
                yield event
            return

        if first_attempt:
            self.signals.prompt_admitted("prefill", len(tokens), choice.alone_s, now)
            self.signals.awaiting_first_token(state.request_id, "prefill", now, choice.alone_s)
        state.path = "remote_prefill"
        pleg = self._open(
            state, prefill, to_compute, wire.AddRequest(leg_id, tokens, params, output_token_ids=resumed)
        )
        sent_at = clock.monotonic()
        answer = await self._next(
            pleg, self.config.prefill_timeout, "the first token from the prefill worker"
        )
        if isinstance(answer, WorkerDown):
            raise _Retry("prefill_worker_down", f"prefill worker {answer.worker_id} went down")
        if not isinstance(answer, wire.Tokens) or answer.finish_reason == "error":
            pleg.done = True
            # The worker refused the request itself (its parameters; or, from a router bug, a
            # handle that does not fit): not a fault, which another attempt would not mend.
            if isinstance(answer, wire.Tokens) and answer.invalid:
                raise _refused(state, f"prefill worker {prefill.worker_id}: {answer.error}")
            raise _Retry(
                "prefill_failed", f"prefill worker {prefill.worker_id}: {getattr(answer, 'error', '')}"
            )
        now = clock.monotonic()
        if answer.queue_seconds is not None:
            compute = max(0.0, now - sent_at - answer.queue_seconds)
            self.metrics.queue_time.labels("prefill").observe(answer.queue_seconds)
            self.metrics.prefill_time.observe(compute)
            self.metrics.ttft_breakdown.labels("prefill_queue").observe(answer.queue_seconds)
            self.metrics.ttft_breakdown.labels("prefill_compute").observe(compute)
        if not attempt.emitted:
            self._first_token(state, "prefill", choice, now)
        state.last_token_at = now
        if answer.finish_reason != "prefilled" or answer.kv is None:
            pleg.done = True  # the first token ended it (EOS, max_tokens=1): nothing to decode
            yield TokenEvent(
                answer.token_ids, answer.finish_reason, answer.stop_reason, "prefill", answer.logprobs
            )
            return
        yield TokenEvent(
            answer.token_ids, pool="prefill", logprobs=answer.logprobs
        )  # the first token goes to the client now

        # Where the conversation is cached (its next turn finds it there), load permitting.
        decode = self.placement.pick_decode(blocks_needed=len(answer.kv.block_ids) + 1, prompt=prompt_keys)
        dleg = self._open(
            state,
            decode,
            0,
            wire.AddRequest(
                leg_id, tokens, params, output_token_ids=resumed + answer.token_ids, kv=answer.kv
            ),
        )
        async for event in self._stream(
            state, attempt, dleg, kv_pending=True, source_leg=pleg, transport=answer.kv.transport
        ):
            yield event

    def _first_token(self, state: RequestState, pool: str, choice: policy.PathChoice, now: float) -> None:
        """The request's first token: into the signals, and next to what the cost model predicted."""
        ttft = now - state.created_at
        self.signals.first_token(pool, ttft, choice.alone_s, now, key=state.request_id)
        if choice.predicted_ttft and state.retries == 0:  # a retry's TTFT includes the failed try
            self.metrics.ttft_prediction_ratio.labels(choice.path).observe(ttft / choice.predicted_ttft)
            self.signals.prediction_checked(ttft, choice.predicted_ttft, now)

    async def _stream(
        self,
        state: RequestState,
        attempt: _Attempt,
        leg: Leg,
        *,
        kv_pending: bool,
        source_leg: Leg | None = None,
        transport: str = "",
        choice: policy.PathChoice | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """The tokens of `leg`, and of the legs it moves to. `source_leg`: the leg whose blocks the
        current one pulls (released once they have arrived)."""
        streamed = 0
        kv_failed = False
        move: _Move | None = None
        kv_arrived_at: float | None = None  # a prompt's KV (not a move's): for the TTFT breakdown
        try:
            while True:
                worker = leg.link.worker_id
                # Locally prefilled, the first token waits for the queue and the whole prompt too.
                first_local = streamed == 0 and not kv_pending
                timeout = self.config.prefill_timeout if first_local else self.config.token_timeout
                event = await self._next(leg, timeout, f"the next token from worker {worker}")
                if isinstance(event, wire.KVPulled):
                    self._kv_pulled(state, event, source_leg, transport, "stream" if move else "prompt")
                    kv_failed = not event.ok
                    if move is not None and event.ok:
                        self._settle(move, "ok")
                    elif event.ok and streamed == 0:
                        kv_arrived_at = clock.monotonic()
                        self.metrics.ttft_breakdown.labels("kv_transfer").observe(event.seconds)
                    continue
                if isinstance(event, wire.Migrated):
                    if move is not None:  # moved again before its next token: the first move worked
                        self._settle(move, "ok")
                    move = _Move(leg.move_reason or "rebalance", state.last_token_at or clock.monotonic())
                    source_leg, leg = leg, self._move(state, attempt, leg, event, move.reason)
                    transport = event.kv.transport if event.kv else transport
                    kv_pending, kv_failed, streamed = True, False, 0
                    continue
                if isinstance(event, WorkerDown):
                    # Its KV went with it: prefilled again from the prompt and the tokens so far.
                    when = "before its first token" if streamed == 0 else f"mid-stream ({event.reason})"
                    raise _Retry("decode_worker_down", f"worker {worker} went down {when}")
                if event.finish_reason == "error":
                    leg.done = True
                    if event.invalid:  # on a leg that brought KV: the router's fault, not the client's
                        refusal = f"worker {worker}: {event.error}"
                        raise RequestFailed(refusal) if kv_pending else _refused(state, refusal)
                    if kv_pending and (kv_failed or streamed == 0):
                        raise _Retry("kv_transfer_failed", f"worker {worker}: {event.error}")
                    raise RequestFailed(f"worker {worker} failed the request: {event.error}")
                if streamed == 0 and event.queue_seconds is not None:
                    self.metrics.queue_time.labels(leg.link.pool).observe(event.queue_seconds)
                if event.token_ids:
                    now = clock.monotonic()
                    if move is not None:  # the first token after a move: the gap the move made
                        self._settle(move, "ok")
                        self.metrics.migration_gap.observe(now - move.since)
                        move = None
                    if kv_arrived_at is not None:
                        self.metrics.ttft_breakdown.labels("first_decode").observe(now - kv_arrived_at)
                        kv_arrived_at = None
                    if first_local and not attempt.emitted and choice is not None:
                        self._first_token(state, leg.link.pool, choice, now)
                    state.last_token_at = now
                streamed += len(event.token_ids)
                if event.finish_reason is not None:
                    leg.done = True
                yield TokenEvent(
                    event.token_ids, event.finish_reason, event.stop_reason, leg.link.pool, event.logprobs
                )
                if event.finish_reason is not None:
                    return
        except _Retry:
            if move is not None:  # it could not move, or its pull failed: prefilled again
                self._settle(move, "reprefilled")
            raise
        except RequestFailed:
            if move is not None:
                self._settle(move, "failed")
            raise

    def _settle(self, move: _Move, outcome: str) -> None:
        """Count a move once, by how it ended."""
        if not move.counted:
            move.counted = True
            self.metrics.migrations.labels(move.reason, outcome).inc()

    def _move(
        self, state: RequestState, attempt: _Attempt, leg: Leg, event: wire.Migrated, reason: str
    ) -> Leg:
        """Continue a stream that stopped on `leg`'s worker on another one; returns the new leg.
        Raises _Retry (prefill it again from prompt + tokens so far) when it cannot."""
        source = leg.link.worker_id

        def fall_back(retry_reason: str, why: str) -> _Retry:
            logger.warning(
                "request %s: cannot move it from %s (%s): prefilled again", state.request_id, source, why
            )
            return _Retry(retry_reason, why)

        if event.kv is None:
            leg.done = True  # nothing of it was computed there: the worker forgot it
            raise fall_back("moved_before_start", f"worker {source} had not started it")
        if event.output_token_ids != attempt.outputs:  # cannot happen unless a message was lost
            raise fall_back("move_mismatch", f"worker {source} and the router disagree on its tokens")
        target = self.placement.pick_decode(
            exclude=leg.link.worker_id,
            pools=(leg.link.pool,),
            blocks_needed=len(event.kv.block_ids) + 1,
            required=False,
        )
        if target is None:
            raise fall_back("no_move_target", f"no other {leg.link.pool} worker is up")
        state.migrations += 1
        leg_id = state.new_leg_id()
        logger.info(
            "request %s: moving from %s to %s (%s)", state.request_id, source, target.worker_id, reason
        )
        message = wire.AddRequest(
            leg_id,
            attempt.tokens,
            attempt.params,
            output_token_ids=attempt.outputs,
            kv=event.kv,
            sampler_state=event.sampler_state,
        )
        return self._open(state, target, 0, message)

    def _kv_pulled(
        self, state: RequestState, event: wire.KVPulled, source_leg: Leg | None, transport: str, kind: str
    ) -> None:
        # The puller says which transport it used (a tcp deployment copies over shm on one node).
        transport = event.transport or transport
        # The puller has the KV (or gave up on it): the holder's blocks can go.
        if source_leg is not None and not source_leg.done:
            if source_leg.link.connected:
                source_leg.link.send(wire.Release(source_leg.leg_id))
            source_leg.close(abort=False)
        if event.ok:
            self.metrics.kv_transfer_time.labels(transport, kind).observe(event.seconds)
            self.metrics.kv_transfer_bytes.labels(transport, kind).observe(event.nbytes)
        else:
            self.metrics.kv_transfer_failures.labels(transport, kind).inc()
            if event.checksum_failed:
                self.metrics.kv_checksum_failures.labels(transport, kind).inc()
            logger.error("request %s: KV transfer failed (%s): %s", state.request_id, transport, event.error)

    # -- helpers ------------------------------------------------------------------------------------------
    def _open(
        self, state: RequestState, worker: WorkerView, prompt_tokens: int, message: wire.AddRequest
    ) -> Leg:
        link = self.workers.links.get(worker.worker_id)
        if link is None:  # it left the set since it was chosen
            raise _Retry("worker_unreachable", f"worker {worker.worker_id} is gone")
        leg = link.open_leg(
            message.request_id,
            prompt_tokens,
            receiving=message.kv is not None,
            request_started=state.created_at,
        )
        state.legs.append(leg)
        if not link.send(message):
            leg.close(abort=False)
            raise _Retry("worker_unreachable", f"worker {link.worker_id} is not connected")
        return leg

    @staticmethod
    async def _next(leg: Leg, timeout: float, what: str) -> LegEvent:
        if not leg.events.empty():  # the common case while streaming: no timer, no task
            return leg.events.get_nowait()
        try:
            async with asyncio.timeout(timeout):  # unlike wait_for (3.11), creates no task
                return await leg.events.get()
        except TimeoutError:
            raise RequestFailed(f"timed out after {timeout:g} s waiting for {what}") from None
