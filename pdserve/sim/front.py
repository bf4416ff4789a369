"""The simulation's front: what `pdserve bench` and the router's HTTP layer do for one request,
without HTTP or a tokenizer, on the router's real admission and dispatcher. No torch.

For each request of the workload, at its arrival time (or when a closed loop's slot frees): the
router's per-request overhead (the profile's: HTTP, tokenization, admission, as measured), the
same checks and admission as `Router._admit` (a 503 with no worker up, a 429 when the queue or
the in-flight limit is full, a 400 when the prompt and its tokens exceed the context), then the
dispatcher's token events, timed as the bench times chunks, each also recorded as the router
records it (TTFT and ITL metrics, the planner's gap signals). The records are the bench's
`RequestRecord`s, so `pdserve sim` writes what `pdserve bench` writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import Callable, Sequence

from pdserve import clock, wire
from pdserve.bench.summary import RequestRecord
from pdserve.bench.workload import RequestSpec
from pdserve.router.admission import Overloaded
from pdserve.router.answer import Latency
from pdserve.router.dispatch import Dispatcher
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement import Unavailable
from pdserve.router.request_state import RequestFailed, RequestInvalid, RequestState
from pdserve.signals import Signals
from pdserve.sim.host import HostLoad


def error_text(exc: Exception) -> str:
    """As the bench would record the router's answer to it."""
    if isinstance(exc, Unavailable):
        return f"HTTP 503: {exc}"
    if isinstance(exc, Overloaded):
        return f"HTTP 429: {exc}"
    if isinstance(exc, RequestInvalid):
        return f"HTTP 400: {exc}"
    return f"stream error: {exc}"


class Front:
    def __init__(
        self,
        dispatcher: Dispatcher,
        metrics: RouterMetrics,
        signals: Signals,
        *,
        request_overhead_s: float,
        vocab_size: int,
        max_model_len: Callable[[], int | None],
        host: HostLoad | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.host = host  # charged the router's (and client's) CPU per request and per token
        self.metrics = metrics
        self.signals = signals
        self.request_overhead_s = request_overhead_s
        self.max_model_len = max_model_len
        # Token ids the workers accept (a modelled engine ignores their values).
        self._ids = [1 + i % (vocab_size - 1) for i in range(4096)]
        self._vocab_size = vocab_size
        self._serial = itertools.count()
        self._prompts = itertools.count()

    def prompt(self, tokens: int) -> list[int]:
        """Ids that differ from every other prompt's in their first two (as the bench's prompts
        differ from their first token): the workers' prefix caches find nothing in common."""
        ids = self._ids
        while len(ids) < tokens + 2:
            ids = ids + ids
        self._ids = ids
        n = next(self._prompts)
        head = [n // self._vocab_size % self._vocab_size, n % self._vocab_size]
        return (head + ids)[:tokens]

    async def serve(
        self,
        spec: RequestSpec,
        start: float,
        record: RequestRecord,
        prompt: list[int] | None = None,
        answer: list[int] | None = None,
    ) -> None:
        """One request, as the router serves it; fills `record` (times after `start`) and `answer`
        with the tokens it streamed. `prompt`: its ids (a conversation's turn: all of it so far),
        else new ids of `spec.prompt_tokens`."""
        ids = prompt if prompt is not None else self.prompt(spec.prompt_tokens)
        arrived = clock.monotonic()
        if self.host is not None:
            self.host.request()
        try:
            if self.request_overhead_s > 0:
                await asyncio.sleep(self.request_overhead_s)
            admission = self.dispatcher.admission
            admission.check_available()
            context = self.max_model_len()
            if context is None:
                raise Unavailable("no worker is ready")
            if len(ids) + spec.output_tokens > context:
                raise RequestInvalid(
                    f"this model's context is {context} tokens, but "
                    f"{len(ids) + spec.output_tokens} were asked for"
                )
            state = RequestState(f"sim-{next(self._serial)}", created_at=arrived)
            state.reservation = admission.admit(len(ids))
        except (Unavailable, Overloaded, RequestInvalid) as exc:
            record.error = error_text(exc)
            return
        params = wire.WireSamplingParams(max_tokens=spec.output_tokens, temperature=0.0, ignore_eos=True)
        latency = Latency(arrived)
        events = self.dispatcher.generate(state, ids, params)
        try:
            async for event in events:
                now = clock.monotonic()
                latency.token_arrived(now, event, self.metrics, self.signals)
                if event.token_ids:
                    if self.host is not None:
                        self.host.tokens(len(event.token_ids))
                    record.chunk_times_s.append(now - start)
                    record.output_tokens += len(event.token_ids)
                    if answer is not None:
                        answer.extend(event.token_ids)
                if event.finish_reason is not None:
                    latency.finished(now, record.output_tokens, self.metrics)
        except (RequestFailed, Unavailable, Overloaded) as exc:
            record.error = error_text(exc)
        finally:
            with contextlib.suppress(Exception):
                await events.aclose()
            if state.reservation is not None:  # never started (cancelled while admitted)
                self.dispatcher.admission.release(state.reservation)


async def drive(
    front: Front,
    requests: Sequence[RequestSpec],
    *,
    concurrency: int | None,
    duration_s: float | None,
    finish_timeout_s: float,
    records: list[RequestRecord],
) -> float:
    """Sends the workload as `pdserve bench`'s `run_load` does (open loop at the arrival times, or a
    closed loop of `concurrency`; a conversation's later turns `think_s` after the turn before,
    with the conversation so far as token ids: its prompts and the tokens streamed), bounded the
    same way; returns the run's duration. Every request whose time came is in `records` once (one
    still running at the end as an error)."""
    start = clock.monotonic()
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    tasks: list[asyncio.Task[None]] = []
    later = {(r.session, r.turn): r for r in requests if r.turn > 0}
    histories: dict[int, list[int]] = {}
    stopping = False

    async def fire(spec: RequestSpec) -> None:
        record = RequestRecord(
            spec.index, spec.cls, spec.arrival_s, clock.monotonic() - start, spec.prompt_tokens
        )
        record.session, record.turn = spec.session, spec.turn
        prompt = None
        answer: list[int] = []
        if spec.session is not None:
            prompt = histories.get(spec.session, []) + front.prompt(spec.prompt_tokens)
            record.prompt_tokens = len(prompt)
        try:
            await front.serve(spec, start, record, prompt, answer)
            nxt = later.get((spec.session, spec.turn + 1))
            if nxt is not None and prompt is not None and record.ok and not stopping:
                histories[nxt.session] = prompt + answer  # type: ignore[index]
                tasks.append(asyncio.create_task(follow(nxt)))
        except asyncio.CancelledError:
            record.error = f"cancelled: still running {finish_timeout_s:g} s after the last request was sent"
            raise
        finally:
            if slots is not None:
                slots.release()
            records.append(record)

    async def follow(spec: RequestSpec) -> None:
        await asyncio.sleep(spec.think_s)
        if not stopping and (duration_s is None or clock.monotonic() - start < duration_s):
            await fire(spec)

    for spec in requests:
        if spec.turn > 0:
            continue  # sent by `follow` once the turn before it has ended
        if duration_s is not None and clock.monotonic() - start >= duration_s:
            break
        if slots is not None:
            await slots.acquire()
        elif spec.arrival_s is not None:
            if duration_s is not None and spec.arrival_s >= duration_s:
                break
            delay = spec.arrival_s - (clock.monotonic() - start)
            if delay > 0:
                await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(fire(spec)))
    deadline = clock.monotonic() + finish_timeout_s
    while True:  # conversations' later turns start meanwhile
        running = [task for task in tasks if not task.done()]
        left = deadline - clock.monotonic()
        if not running or left <= 0:
            break
        await asyncio.wait(running, timeout=left, return_when=asyncio.FIRST_COMPLETED)
    stopping = True
    pending = [task for task in tasks if not task.done()]
    for task in pending:
        task.cancel()
    for task in pending:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    records.sort(key=lambda r: r.sent_s)
    return clock.monotonic() - start
