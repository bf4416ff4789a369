"""The load generator: sends a workload to an OpenAI-compatible server and times every chunk. No torch.

Open loop (arrival times given): each request is sent at its time whatever the server is doing,
so a slow server builds a queue, as real traffic would. Closed loop (`concurrency`): a fixed
number of requests in flight. Bounded by the workload's requests, by `duration_s` (no request is
sent after it; those in flight get `drain_timeout_s` to finish, then are cancelled and recorded as
errors), and by Ctrl-C, which stops sending and keeps what was measured (the requests in flight
are cancelled and recorded as errors, as at the drain timeout).

While the load runs, `sample_pools` can poll the pdserve admin route GET /pools (the pools' targets
and workers by state) for the run's timeline; an endpoint without it just goes unsampled.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from pdserve.bench.conversations import History
from pdserve.bench.server_parts import scrape as server_parts_scrape
from pdserve.bench.server_parts import summary_section
from pdserve.bench.summary import RequestRecord
from pdserve.bench.timeline import pool_counts

logger = logging.getLogger("pdserve.bench")

POOLS_TIMEOUT_S = 5.0  # for one GET /pools: an admin answer, the router's event loop permitting
POOLS_FAILURES = 3  # failures in a row (no answer, a 5xx) that stop the sampling


@dataclass(frozen=True)
class Target:
    base_url: str  # e.g. http://127.0.0.1:8000
    model: str
    endpoint: str = "completions"  # or "chat"
    temperature: float = 0.0
    request_timeout_s: float = 600.0
    extra_body: dict[str, Any] | None = None
    api_key: str | None = None  # sent as Authorization: Bearer on the API routes
    admin_key: str | None = None  # the same, on GET /pools (pool sampling)


@dataclass(frozen=True)
class PreparedRequest:
    index: int
    cls: str
    arrival_s: float | None
    prompt: str | list[int]  # a later turn of a conversation: its new part
    prompt_tokens: int
    output_tokens: int
    session: int | None = None  # see RequestSpec (pdserve/bench/conversations.py)
    turn: int = 0
    think_s: float = 0.0


Prompt = str | list[int] | list[dict[str, str]]  # text, token ids, or chat messages


def request_body(target: Target, req: PreparedRequest, prompt: Prompt | None = None) -> dict[str, Any]:
    """The JSON body of `req`; `prompt` (a conversation's turn: all of it so far) replaces its own."""
    prompt = req.prompt if prompt is None else prompt
    body: dict[str, Any] = {
        "model": target.model,
        "max_tokens": req.output_tokens,
        "temperature": target.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Output lengths as asked: the model's EOS must not end a request early.
        "ignore_eos": True,
    }
    if target.endpoint == "chat":
        body["messages"] = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body | (target.extra_body or {})


async def send_one(
    client: httpx.AsyncClient,
    target: Target,
    req: PreparedRequest,
    start: float,
    record: RequestRecord,
    prompt: Prompt | None = None,
    answer: list[str] | None = None,
) -> RequestRecord:
    """Sends `req` (with `prompt` in place of its own, if given) and fills `record` as chunks arrive
    (times after `start`), and `answer` with the text pieces. The caller makes the record: if this
    is cancelled, the record still holds the chunks that came and the error."""
    path = "/v1/chat/completions" if target.endpoint == "chat" else "/v1/completions"
    chunks = 0
    try:
        async with client.stream("POST", path, json=request_body(target, req, prompt)) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:300]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - start
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    record.error = f"not JSON in the stream: {data[:200]!r}"
                    break
                if not isinstance(chunk, dict):
                    record.error = f"unexpected stream event: {data[:200]!r}"
                    break
                if "error" in chunk:
                    error = chunk["error"]
                    message = error.get("message", error) if isinstance(error, dict) else error
                    record.error = f"stream error: {message}"
                    break
                if chunk.get("usage"):
                    record.output_tokens = int(chunk["usage"].get("completion_tokens", 0))
                    record.prompt_tokens = int(chunk["usage"].get("prompt_tokens", record.prompt_tokens))
                for choice in chunk.get("choices") or []:
                    piece = (
                        choice.get("text")
                        if target.endpoint != "chat"
                        else (choice.get("delta") or {}).get("content")
                    )
                    if piece:
                        record.chunk_times_s.append(now)
                        chunks += 1
                        if answer is not None:
                            answer.append(piece)
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    except asyncio.CancelledError:
        record.error = "cancelled: the benchmark ended first"
        raise
    finally:
        if not record.output_tokens:
            record.output_tokens = chunks  # the server sent no usage: one token per chunk
    return record


async def sample_pools(
    client: httpx.AsyncClient,
    interval_s: float,
    start: float,
    samples: list[dict[str, Any]],
    admin_key: str | None = None,
) -> None:
    """GET /pools every interval_s seconds until cancelled, appending {"t_s" (when the answer came,
    after `start`), "pools" (timeline.pool_counts)} to `samples`. Never raises: a 404 or an answer
    that is not the admin route's (another server), or POOLS_FAILURES failures in a row, stop it
    with one log line."""
    failures = 0
    due = 0.0
    while True:
        why = None
        try:
            headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else None
            response = await client.get("/pools", timeout=POOLS_TIMEOUT_S, headers=headers)
            if response.status_code == 404:
                why, failures = "the endpoint has no GET /pools (404)", POOLS_FAILURES
            elif response.status_code != 200:
                why, failures = f"GET /pools answered HTTP {response.status_code}", failures + 1
            else:
                try:
                    pools = pool_counts(response.json())
                except ValueError as exc:  # not JSON, or not the shape of pdserve's answer
                    why, failures = f"GET /pools answered something else: {exc}", POOLS_FAILURES
                else:
                    samples.append({"t_s": time.perf_counter() - start, "pools": pools})
                    failures = 0
        except httpx.HTTPError as exc:
            why, failures = f"GET /pools failed: {type(exc).__name__}: {exc}", failures + 1
        except Exception as exc:  # never the run's end
            why, failures = f"GET /pools: {type(exc).__name__}: {exc}", POOLS_FAILURES
        if failures >= POOLS_FAILURES:
            logger.warning("pool sampling stopped after %d samples: %s", len(samples), why)
            return
        due += interval_s
        await asyncio.sleep(max(0.0, due - (time.perf_counter() - start)))


async def run_load(
    target: Target,
    requests: Sequence[PreparedRequest],
    *,
    concurrency: int | None = None,
    duration_s: float | None = None,
    drain_timeout_s: float = 120.0,
    on_done: Callable[[RequestRecord], None] | None = None,
    on_end: Callable[[float], None] | None = None,
    records: list[RequestRecord] | None = None,
    pool_sample_interval_s: float = 0.0,
    pool_samples: list[dict[str, Any]] | None = None,
    server_parts: dict[str, Any] | None = None,
    encode: Callable[[str], list[int]] | None = None,
) -> tuple[list[RequestRecord], float]:
    """Records of every request sent (in send order) and the run's duration in seconds.

    `records`, if given, is filled as requests finish, and `on_end` is called with the duration
    when the run ends, however it ends: a Ctrl-C cancels this coroutine and asyncio.run raises
    KeyboardInterrupt, losing the return value, so they are how the caller still gets what was
    measured. Every request whose send time came is in `records` exactly once: those still in
    flight when the run ends are recorded as errors ("cancelled: ..."), with the chunks that came.

    `pool_sample_interval_s` > 0: GET /pools that often (see `sample_pools`) from the start until the
    run ends, into `pool_samples` (same clock as the records). `server_parts`, if given, gets the
    server's TTFT parts and path counts for this run ("ttft_parts", "paths": pdserve/bench/server_parts.py).

    A conversation's later turns (`req.turn` > 0) are sent `think_s` after the turn before ended
    (bench/conversations.py), with the conversation so far; never after `duration_s`, never after
    a failed turn. `encode` (text -> token ids) is needed for conversations sent as token ids."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=256)
    timeout = httpx.Timeout(target.request_timeout_s, connect=30.0)
    records = records if records is not None else []
    tasks: list[tuple[PreparedRequest, asyncio.Task[RequestRecord]]] = []
    # Conversations: each one so far, its turns after the first, and the tasks that send them.
    histories: dict[int, History] = {}
    later = {(r.session, r.turn): r for r in requests if r.turn > 0}
    followers: list[asyncio.Task[None]] = []
    slots = asyncio.Semaphore(concurrency) if concurrency else None
    headers = {"Authorization": f"Bearer {target.api_key}"} if target.api_key else {}
    async with httpx.AsyncClient(
        base_url=target.base_url, limits=limits, timeout=timeout, headers=headers
    ) as client:
        parts_before = await server_parts_scrape(client) if server_parts is not None else None
        start = time.perf_counter()
        sampler = None
        if pool_sample_interval_s > 0 and pool_samples is not None:
            sampler = asyncio.create_task(
                sample_pools(client, pool_sample_interval_s, start, pool_samples, target.admin_key)
            )

        async def fire(req: PreparedRequest) -> RequestRecord:
            record = RequestRecord(
                req.index, req.cls, req.arrival_s, time.perf_counter() - start, req.prompt_tokens
            )
            record.session, record.turn = req.session, req.turn
            prompt: Prompt | None = None
            answer: list[str] = []
            history: History | None = None
            try:
                if req.session is not None:
                    history = histories.setdefault(req.session, History())
                    prompt = history.prompt(target.endpoint, req.prompt)
                    if isinstance(prompt, list) and not isinstance(req.prompt, str):
                        record.prompt_tokens = len(prompt)  # ids: exact
                await send_one(client, target, req, start, record, prompt, answer)
                nxt = later.get((req.session, req.turn + 1))
                if nxt is not None and history is not None and record.ok and not stopping:
                    history.answered(prompt, "".join(answer), encode)
                    followers.append(asyncio.create_task(follow(nxt)))
            except Exception as exc:  # not the server's doing: still an error, not a success
                record.error = f"client error: {type(exc).__name__}: {exc}"
            finally:
                # Cancelled too (drain timeout, Ctrl-C): the request was sent, so it is recorded,
                # with the error send_one set. (Recording only on return lost every request in
                # flight at a Ctrl-C: the server had them, records.jsonl did not.)
                if slots is not None:
                    slots.release()
                records.append(record)
                if on_done is not None:
                    on_done(record)
            return record

        async def follow(req: PreparedRequest) -> None:
            """A conversation's next turn, after its think time (not after the run's end)."""
            await asyncio.sleep(req.think_s)
            if not stopping and (duration_s is None or time.perf_counter() - start < duration_s):
                await fire(req)

        stopping = False
        try:
            for req in requests:
                if req.turn > 0:
                    continue  # sent by `follow` when the turn before it has ended
                if duration_s is not None and time.perf_counter() - start >= duration_s:
                    break
                if slots is not None:
                    await slots.acquire()
                elif req.arrival_s is not None:
                    delay = req.arrival_s - (time.perf_counter() - start)
                    if delay > 0:
                        await asyncio.sleep(delay)
                    if duration_s is not None and req.arrival_s >= duration_s:
                        break
                tasks.append((req, asyncio.create_task(fire(req))))
            # Until every request is done, conversations' later turns included (they start while
            # this waits), or the drain timeout after the last planned send.
            deadline = time.perf_counter() + drain_timeout_s
            while True:
                running = [task for _, task in tasks if not task.done()] + [
                    f for f in followers if not f.done()
                ]
                left = deadline - time.perf_counter()
                if not running or left <= 0:
                    break
                await asyncio.wait(running, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        finally:
            # The drain timeout or Ctrl-C (this coroutine cancelled: then what follows runs before
            # the KeyboardInterrupt, which is why it is all in `finally`): what is still running
            # is cancelled, and recorded by `fire`; no conversation goes on.
            stopping = True
            for task in [task for _, task in tasks] + followers:
                if not task.done():
                    task.cancel()
            for task in [task for _, task in tasks] + followers:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            elapsed = time.perf_counter() - start
            if sampler is not None:
                sampler.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await sampler
            # A task cancelled before it first ran never started `fire`, so never sent anything:
            # still recorded, so that the records account for every request whose time came.
            recorded = {r.index for r in records}
            for req, _ in tasks:
                if req.index not in recorded:
                    record = RequestRecord(
                        req.index,
                        req.cls,
                        req.arrival_s,
                        elapsed,
                        req.prompt_tokens,
                        error="cancelled before it was sent: the benchmark ended first",
                        session=req.session,
                        turn=req.turn,
                    )
                    records.append(record)
                    if on_done is not None:
                        on_done(record)
            records.sort(key=lambda r: r.sent_s)
            if server_parts is not None and parts_before is not None:
                with contextlib.suppress(Exception):  # a run's end is never lost to it
                    server_parts.update(summary_section(parts_before, await server_parts_scrape(client)))
            if on_end is not None:
                on_end(elapsed)
    return records, elapsed


class Progress:
    """One self-rewriting line on stderr (no dependency)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self.errors = 0
        self._last = 0.0

    def __call__(self, record: RequestRecord) -> None:
        self.done += 1
        self.errors += record.error is not None
        now = time.monotonic()
        if now - self._last > 0.2 or self.done == self.total:
            self._last = now
            sys.stderr.write(f"\r{self.done}/{self.total} requests done, {self.errors} errors")
            sys.stderr.flush()
            if self.done == self.total:
                sys.stderr.write("\n")

    def close(self) -> None:
        """Writes the final count and ends the line, when the run stopped short of `total` (a
        --duration bound, a Ctrl-C): else the line showed a stale count, and what was printed
        next went on the end of it."""
        if self.done < self.total:
            sys.stderr.write(f"\r{self.done}/{self.total} requests done, {self.errors} errors\n")
            sys.stderr.flush()
