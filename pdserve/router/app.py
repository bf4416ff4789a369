"""The router's HTTP API (Starlette): OpenAI-compatible completions and chat, models, health, metrics.

No torch: text goes through `RouterTokenizer`, tokens through the `Dispatcher`. Bad input is a 400
with OpenAI's error body before anything is queued; an empty decode pool is a 503, too many
requests in flight a 429 with Retry-After. A stream that fails after it started ends with an error
event and `[DONE]`. A client that goes away (streaming or not) aborts its request on every worker.

Admission is bounded before it is costly: a body over `max_body_bytes` is a 413 (by its
Content-Length, or as soon as it grows past the limit), a body slower than `body_timeout` a 408;
a text whose length alone proves it longer than the context is a 400 before it is tokenized; the
availability and in-flight checks come before tokenization; and the chat template and the
tokenizer run on a thread pool (the tokenizer releases the GIL), so a huge prompt never stalls
the event loop that carries every other stream and every worker's heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from pdserve import clock, wire
from pdserve.errors import InvalidRequestError
from pdserve.router import openai_types as oa
from pdserve.router.admin import PoolControl, admin_routes
from pdserve.router.admission import Overloaded
from pdserve.router.answer import Answer, Delta, checked_logprobs
from pdserve.router.auth import AccessKeys, AuthMiddleware
from pdserve.router.body import BodyError, read_body
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.logprobs import LogprobsFormatter, TokenLogprobs
from pdserve.router.metrics import CONTENT_TYPE, RouterMetrics
from pdserve.router.openapi import build_openapi
from pdserve.router.placement import Unavailable
from pdserve.router.recorder import WorkerRecorder
from pdserve.router.request_state import RequestFailed, RequestInvalid, RequestState
from pdserve.router.workers import WorkerSet
from pdserve.signals import Signals
from pdserve.text.detok import IncrementalDetokenizer
from pdserve.text.tokenizer import RouterTokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RouterSettings:
    model_name: str
    config: RouterConfig = field(default_factory=RouterConfig)
    keys: AccessKeys = field(default_factory=AccessKeys)  # none: every route open (pdserve.router.auth)
    # A completion or chat body above this is refused (413) before it is read whole. 8 MiB holds
    # a 128k-token prompt as text or as token ids several times over.
    max_body_bytes: int = 8 << 20
    body_timeout: float = 30.0  # seconds for a client to send its whole body (408 after)
    tokenizer_threads: int = 2  # chat templates and tokenization, off the event loop
    step_trace: Path | None = None  # every worker's steps, as JSON lines (router.recorder)


def _json(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def _sse(body: Any) -> bytes:
    return b"data: " + msgspec.json.encode(body) + b"\n\n"


@dataclass(frozen=True)
class RouterParts:
    """What the router serves through, built by whoever runs it (pdserve.serve): the worker set,
    the dispatcher over it (placement and admission inside), the signals the planner reads, the
    metrics, and the pools behind the admin API (none: the admin API answers 503)."""

    workers: WorkerSet
    dispatcher: Dispatcher
    signals: Signals
    metrics: RouterMetrics
    pools: PoolControl | None = None


class Router:
    def __init__(
        self,
        settings: RouterSettings,
        tokenizer: RouterTokenizer,
        eos_token_ids: Sequence[int],
        parts: RouterParts,
    ) -> None:
        """The router owns its parts from here: it closes the pools (which stop their workers),
        then the worker set, when it stops serving."""
        self.settings = settings
        self.pools = parts.pools
        self.tokenizer = tokenizer
        self.eos_token_ids = frozenset(eos_token_ids)
        self._openapi = build_openapi(settings.model_name, settings.keys)
        _ = tokenizer.max_token_chars  # a scan of the vocabulary: at start, not in the first request
        self._tokenize_pool = ThreadPoolExecutor(settings.tokenizer_threads, thread_name_prefix="tokenize")
        self.metrics = parts.metrics
        self.workers = parts.workers
        self.recorder = WorkerRecorder(self.workers, self.metrics, parts.signals, settings.step_trace)
        self.signals = parts.signals
        self.dispatcher = parts.dispatcher
        slo = settings.config.slo
        self.metrics.slo_percentile.set(slo.percentile)
        for metric, value in (("ttft", slo.ttft_s), ("itl", slo.itl_s)):
            if value is not None:
                self.metrics.slo_seconds.labels(metric).set(value)
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/metrics", self.metrics_endpoint, methods=["GET"]),
                Route("/openapi.json", self.openapi, methods=["GET"]),
                *admin_routes(lambda: self.pools, settings.body_timeout),
            ],
            lifespan=self._lifespan,
            middleware=[
                Middleware(
                    AuthMiddleware,
                    keys=settings.keys,
                    on_refused=lambda kind: self.metrics.auth_failures.labels(kind).inc(),
                )
            ],
        )

    @asynccontextmanager
    async def _lifespan(self, _app: Starlette) -> AsyncIterator[None]:
        try:
            logger.info("router ready: %d workers", len(self.workers.views()))
            yield
        finally:
            if self.pools is not None:  # first: nothing may start a worker once the links go
                await self.pools.close()
            await self.workers.close()
            self.recorder.close()
            self._tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # -- endpoints ----------------------------------------------------------------------------------------
    async def completions(self, request: Request) -> Response:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, chat=True)

    async def models(self, _request: Request) -> Response:
        card = {"id": self.settings.model_name, "object": "model", "created": 0, "owned_by": "pdserve"}
        if (context := self._max_model_len()) is not None:
            card["max_model_len"] = context
        return _json({"object": "list", "data": [card]})

    async def health(self, _request: Request) -> Response:
        workers = {
            w.worker_id: {
                "pool": w.pool,
                "state": w.state.value,
                **({"detail": w.detail} if w.detail else {}),
            }
            for w in self.workers.views()
        }
        try:
            self.dispatcher.admission.check_available()
        except (Unavailable, Overloaded) as exc:
            return _json({"status": "unavailable", "reason": str(exc), "workers": workers}, 503)
        return _json({"status": "ok", "workers": workers})

    async def openapi(self, _request: Request) -> Response:
        return _json(self._openapi)

    async def metrics_endpoint(self, _request: Request) -> Response:
        return Response(self.metrics.render(), media_type=CONTENT_TYPE)

    # -- a request ----------------------------------------------------------------------------------------
    async def _serve(self, request: Request, chat: bool) -> Response:
        arrived = clock.monotonic()
        try:
            body = await read_body(request, self.settings.max_body_bytes, self.settings.body_timeout)
            run = await self._admit(body, chat, arrived)
        except BodyError as exc:
            return self._reject(str(exc), "invalid_request_error", exc.status)
        except InvalidRequestError as exc:
            return self._reject(str(exc), "invalid_request_error", 400, exc.param)
        except Unavailable as exc:
            return self._reject(str(exc), "service_unavailable", 503)
        except Overloaded as exc:
            response = self._reject(str(exc), "rate_limit_exceeded", 429)
            if exc.retry_after is not None:
                response.headers["Retry-After"] = str(max(1, round(exc.retry_after)))
            return response
        if run.stream:
            return _ReleasingStream(self._stream(run), self._release(run), media_type="text/event-stream")
        return await self._whole(request, run)

    def _release(self, run: Answer) -> Callable[[], None]:
        """What gives an admitted request's place back if its stream never starts (the client left
        before the response began: Starlette then never iterates it). A no-op once it started."""

        def release() -> None:
            if run.state.reservation is not None:
                self.dispatcher.admission.release(run.state.reservation)
                run.state.reservation = None

        return release

    def _reject(self, message: str, kind: str, status: int, param: str | None = None) -> Response:
        self.metrics.requests.labels("none", "rejected").inc()
        return _json(oa.error_body(message, kind, status, param), status)

    async def _admit(self, body: bytes, chat: bool, arrived: float) -> Answer:
        req: oa.CompletionRequest | oa.ChatCompletionRequest
        messages: list[dict[str, Any]] = []
        prompt: str | list[int] = ""
        if chat:
            chat_req: oa.ChatCompletionRequest = oa.decode_body(body, oa.ChatCompletionRequest)
            messages = oa.check_chat(chat_req)
            req = chat_req
        else:
            completion_req: oa.CompletionRequest = oa.decode_body(body, oa.CompletionRequest)
            oa.check_completion(completion_req)
            prompt = oa.prompt_of(completion_req)
            req = completion_req
        if req.model != self.settings.model_name:
            raise InvalidRequestError(
                f"model {req.model!r} is not served here; this server serves {self.settings.model_name!r}"
            )
        oa.check_token_ids(req, self.tokenizer.vocab_size)
        # 503 / 429 before the costly part: an overloaded server refuses fast.
        self.dispatcher.admission.check_available()
        context = self._max_model_len()
        if context is None:
            raise Unavailable("no worker is ready")
        with self.dispatcher.admission.admitting_one():  # its place against the limit while tokenized
            prompt_ids = await self._prompt_ids(chat, req, messages, prompt, context)
            # The pools may have changed meanwhile.
            self.dispatcher.admission.check_available(admitting_self=True)
        max_tokens = oa.requested_max_tokens(req)
        if len(prompt_ids) >= context:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens but the model's context is {context} tokens, "
                "and at least one must be left to generate"
            )
        if max_tokens is None:
            max_tokens = context - len(prompt_ids)
        elif max_tokens >= 1 and len(prompt_ids) + max_tokens > context:
            raise InvalidRequestError(
                f"this model's context is {context} tokens, but {len(prompt_ids) + max_tokens} were asked for "
                f"({len(prompt_ids)} in the prompt, {max_tokens} to generate): lower max_tokens"
            )
        params = oa.sampling_params(req, max_tokens)  # raises InvalidRequestError (max_tokens < 1, ...)
        prefix = "chatcmpl" if chat else "cmpl"
        request_id = f"{prefix}-{uuid.uuid4().hex}"
        answer = Answer(
            state=RequestState(request_id, created_at=arrived),  # one TTFT clock (docs/metrics.md)
            prompt_ids=prompt_ids,
            params=wire.WireSamplingParams.from_params(params),
            detok=IncrementalDetokenizer(
                self.tokenizer,
                prompt_ids,
                params.stop,
                params.include_stop_str_in_output,
                params.skip_special_tokens,
                params.min_tokens,
            ),
            builder=oa.ResponseBuilder(request_id, self.settings.model_name, chat),
            stream=req.stream,
            include_usage=bool(req.stream_options and req.stream_options.include_usage),
            ignore_eos=params.ignore_eos,
            arrived=arrived,
            logprobs=LogprobsFormatter(self.tokenizer, chat) if params.logprobs is not None else None,
        )
        # Raises Overloaded (the pool's queue is full; --reject-on-slo-miss). From here the request
        # holds its place (in-flight count, queue) until the dispatcher starts it.
        answer.state.reservation = self.dispatcher.admission.admit(len(prompt_ids))
        self.metrics.prompt_tokens.inc(len(prompt_ids))
        return answer

    async def _prompt_ids(
        self,
        chat: bool,
        req: oa.CompletionRequest | oa.ChatCompletionRequest,
        messages: list[dict[str, Any]],
        prompt: str | list[int],
        context: int,
    ) -> list[int]:
        """The prompt's token ids. Text is rendered and tokenized on the thread pool, after a check
        that its length alone does not prove it too long for the context."""
        loop = asyncio.get_running_loop()
        if chat:
            self._check_text_length(sum(len(m["content"]) for m in messages), context)
            add_generation_prompt = isinstance(req, oa.ChatCompletionRequest) and req.add_generation_prompt
            text = await loop.run_in_executor(
                self._tokenize_pool, self.tokenizer.apply_chat_template, messages, add_generation_prompt
            )
            # The template already holds any BOS the model wants.
            return await loop.run_in_executor(self._tokenize_pool, self.tokenizer.encode, text, False)
        if isinstance(prompt, str):
            self._check_text_length(len(prompt), context)
            return await loop.run_in_executor(self._tokenize_pool, self.tokenizer.encode, prompt)
        if len(prompt) >= context:  # before the scan of every id
            raise InvalidRequestError(
                f"the prompt has {len(prompt)} tokens but the model's context is {context} tokens, "
                "and at least one must be left to generate"
            )
        vocab = self.tokenizer.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        return prompt

    def _check_text_length(self, chars: int, context: int) -> None:
        """No token is longer than `max_token_chars`, so a text of N characters has at least
        N / max_token_chars tokens: past the context that many, it is refused untokenized."""
        at_least = -(-chars // self.tokenizer.max_token_chars)
        if at_least >= context:
            raise InvalidRequestError(
                f"the prompt has {chars} characters, so at least {at_least} tokens, but the model's "
                f"context is {context} tokens"
            )

    async def _deltas(self, run: Answer) -> AsyncIterator[Delta]:
        """The new text (and logprobs) as tokens arrive; records the latency metrics."""
        events = self.dispatcher.generate(run.state, run.prompt_ids, run.params)
        sent = 0
        try:
            async for event in events:
                run.token_arrived(clock.monotonic(), event, self.metrics, self.signals)
                finish: str | None = event.finish_reason
                stop_reason: int | str | None = event.stop_reason
                logprobs = checked_logprobs(run, event)
                new_logprobs = TokenLogprobs()
                for i, token in enumerate(event.token_ids):
                    run.output_ids.append(token)
                    if logprobs is not None:
                        new_logprobs.add(logprobs[i], len(run.detok.text))
                    if token in self.eos_token_ids and not run.ignore_eos:
                        continue  # EOS ends the text; it counts as a token, it prints nothing
                    if run.detok.add_token(token) is not None:
                        finish, stop_reason = "stop", run.detok.stop_reason
                        break
                text = run.detok.streamable_text(finished=finish is not None)
                delta, sent = text[sent:], len(text)
                yield Delta(delta, finish, stop_reason, new_logprobs if logprobs is not None else None)
                if finish is not None:
                    run.state.outcome = "ok"  # also when a stop string ended it before the engine did
                    run.finished(clock.monotonic(), self.metrics)
                    return
        finally:
            await events.aclose()  # closing early (stop string, client gone) aborts the request

    async def _stream(self, run: Answer) -> AsyncIterator[bytes]:
        b = run.builder
        role_sent = not b.chat
        try:
            async for d in self._deltas(run):
                if d.text or d.finish is not None or (d.logprobs is not None and d.logprobs.entries):
                    # The role goes with the first token, as vLLM's server sends it: a client that
                    # times its first chunk (vllm bench serve, aiperf, ...) then measures the TTFT.
                    logprobs = run.render_logprobs(d.logprobs)
                    yield _sse(
                        b.chunk(d.text, d.finish, d.stop_reason, role=not role_sent, logprobs=logprobs)
                    )
                    role_sent = True
            if run.include_usage:
                yield _sse(b.usage_chunk(oa.usage(len(run.prompt_ids), len(run.output_ids))))
        except (RequestFailed, Unavailable, Overloaded) as exc:
            _log_failure(run.state.request_id, exc, "mid-stream")
            yield _sse(oa.error_body(str(exc), *_error_kind(exc)))
        yield b"data: [DONE]\n\n"

    async def _whole(self, request: Request, run: Answer) -> Response:
        async def collect() -> Response:
            text = ""
            ending: tuple[str | None, int | str | None] = (None, None)
            logprobs = TokenLogprobs()
            async for d in self._deltas(run):
                text += d.text
                ending = (d.finish, d.stop_reason)
                if d.logprobs is not None:
                    logprobs.extend(d.logprobs)
            use = oa.usage(len(run.prompt_ids), len(run.output_ids))
            return _json(run.builder.whole(text, *ending, use, run.render_logprobs(logprobs)))

        work = asyncio.create_task(collect())
        gone = asyncio.create_task(_client_gone(request))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (work, gone):
                if not task.done():
                    task.cancel()  # the client left: cancelling `work` aborts the request
                    with contextlib.suppress(asyncio.CancelledError):
                        await task
        if work.cancelled():
            return Response(status_code=499)  # nobody reads this: the client is gone
        try:
            return work.result()
        except (RequestFailed, Unavailable, Overloaded) as exc:
            _log_failure(run.state.request_id, exc)
            kind, status = _error_kind(exc)
            response = _json(oa.error_body(str(exc), kind, status), status)
            if isinstance(exc, Overloaded) and exc.retry_after is not None:
                response.headers["Retry-After"] = str(max(1, round(exc.retry_after)))
            return response

    def describe_signals(self) -> dict[str, Any]:
        """The "signals" section of GET /pools: latency percentiles, demand and KV use per pool."""
        kv: dict[str, list[tuple[int, int]]] = {}
        for w in self.workers.views():
            if w.connected and w.load is not None:
                kv.setdefault(w.pool, []).append(
                    (w.load.kv_blocks_used, w.load.kv_blocks_used + w.load.kv_blocks_free)
                )
        kv_used = {pool: sum(u for u, _ in v) / max(1, sum(t for _, t in v)) for pool, v in kv.items()}
        return self.signals.describe(clock.monotonic(), dict(kv_used))

    # -- worker state into metrics --------------------------------------------------------------------------
    def _max_model_len(self) -> int | None:
        lengths = [w.ready.max_model_len for w in self.workers.views() if w.connected and w.ready]
        return min(lengths) if lengths else None


def _log_failure(request_id: str, exc: Exception, where: str = "") -> None:
    """A failure after admission is an error; a 429 there (a burst that overtook the in-flight
    limit while it was tokenized) is load, not a fault."""
    level = logging.INFO if isinstance(exc, Overloaded) else logging.ERROR
    logger.log(level, "request %s %s%s: %s", request_id, "refused" if level == logging.INFO else "failed",
               f" {where}" if where else "", exc)  # fmt: skip


def _error_kind(exc: Exception) -> tuple[str, int]:
    """OpenAI error type and HTTP status of a failure after admission."""
    if isinstance(exc, Unavailable):
        return "service_unavailable", 503
    if isinstance(exc, Overloaded):  # admitted in a burst that overtook the in-flight limit
        return "rate_limit_exceeded", 429
    if isinstance(exc, RequestInvalid):  # a worker refused what the client sent
        return "invalid_request_error", 400
    return "server_error", 500


class _ReleasingStream(StreamingResponse):
    """A streamed answer that runs `on_close` once it is over, however it ended: sent, failed,
    or never begun because the client had already gone."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None], media_type: str) -> None:
        super().__init__(content, media_type=media_type)
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
