"""Drain loses nothing. With the router's real control and data planes over scripted workers (fast,
in memory: tests/fakes.py): a decode or colocated worker's streams move mid-stream and every stream
is whole; a drain with replace serves on until the replacement is up; a prefill worker stops only
after the KV it holds has been pulled; past the drain timeout what is left ends with an error.
With real servers, real workers and every KV transport (the wiring): streams move off a draining
decode worker with exactly the tokens the offline engine produces."""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import openai
import pytest
from fakes import control_plane, expected_stream, until
from serving import Server

from pdserve import LLM, SamplingParams, clock, wire
from pdserve.pools.manager import PoolError, PoolSettings
from pdserve.transfer import nixl_backend

TRANSPORTS = [
    "shm",
    "tcp",
    pytest.param(
        "nixl",
        marks=pytest.mark.skipif(
            nixl_backend.unavailable_reason() is not None, reason=str(nixl_backend.unavailable_reason())
        ),
    ),
]
PROMPTS = [list(range(20 + i, 50 + 3 * i)) for i in range(16)]
# The tiny model streams 1500 tokens in about the five seconds a new worker takes to start on two
# cores, so streams that must still be running when it is up are as long as its 4096-token context
# allows (the longest prompt is 60 tokens).
LONG_STREAM = 4000


async def stream(server: Server, prompt: list[int], max_tokens: int, started: asyncio.Event) -> str:
    """One streamed completion: its text, or `error: ...` if the stream ended with an error."""
    chunks = await server.async_client.completions.create(
        model=server.model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    text = ""
    try:
        async for chunk in chunks:
            text += chunk.choices[0].text
            started.set()
    except openai.APIError as exc:
        return f"error: {exc.message}"
    return text


def run_streams(
    server: Server,
    prompts: list[list[int]],
    max_tokens: int,
    during: Callable[[], Awaitable[None]],
    *,
    when: str = "streaming",
) -> list[str]:
    """Stream every prompt at once; run `during` once every stream has its first token (`when`
    "streaming") or as soon as the requests are out ("sent"); return what each stream got."""

    async def scenario() -> list[str]:
        events = [asyncio.Event() for _ in prompts]
        tasks = [
            asyncio.ensure_future(stream(server, p, max_tokens, e))
            for p, e in zip(prompts, events, strict=True)
        ]
        if when == "streaming":
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 60)
        else:
            await poll(
                lambda: server.metric("pdserve_requests_in_flight") == len(prompts), 30, "requests sent"
            )
        await during()
        return list(await asyncio.wait_for(asyncio.gather(*tasks), 300))

    return asyncio.run(scenario())


def offline(model: Path | str, prompts: list[list[int]], max_tokens: int) -> list[str]:
    return list(_offline(str(model), tuple(map(tuple, prompts)), max_tokens))


@functools.cache  # several tests check the same long streams against the same offline answer
def _offline(model: str, prompts: tuple[tuple[int, ...], ...], max_tokens: int) -> tuple[str, ...]:
    # Blocks for every stream at once (none preempted), and no more: a cache sized for the tiny
    # model's 4k contexts would be GiBs of zeros for SmolLM2.
    blocks = sum(-(-(len(p) + max_tokens) // 64) + 1 for p in prompts)
    llm = LLM(model, dtype="float32", num_kv_blocks=blocks)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return tuple(o.outputs[0].text for o in llm.generate([list(p) for p in prompts], params))


async def poll(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached within {timeout} s")
        await asyncio.sleep(0.1)


def scale_up_then_drain_the_first(server: Server) -> Callable[[], Awaitable[None]]:
    """Decode 1 -> 2 (the new worker takes half the streams), then drain decode-0."""

    async def during() -> None:
        assert server.scale("decode", 2).status_code == 200
        await poll(lambda: len(server.workers("decode", "up")) == 2, 60, "two decode workers up")
        # Said apart from a missing rebalance: streams that end before the worker is up leave none.
        assert server.metric("pdserve_requests_in_flight") > 1, "the streams ended before decode-1 was up"
        await poll(
            lambda: server.metric("pdserve_request_migrations_total", reason="rebalance") > 0,
            10,
            "a rebalance",
        )
        answer = server.drain("decode-0")
        assert answer.status_code == 200 and answer.json()["state"] == "draining"

    return during


def check_moves_lost_nothing(server: Server, got: list[str], expected: list[str]) -> None:
    """After a rebalance onto decode-1 and decode-0's drain: as `check_drain_lost_nothing`, and
    the rebalance moved streams too."""
    assert server.metric("pdserve_request_migrations_total", reason="rebalance", outcome="ok") > 0
    assert server.metric("pdserve_requests_total", outcome="ok") == len(got)
    check_drain_lost_nothing(server, got, expected)


def check_drain_lost_nothing(server: Server, got: list[str], expected: list[str]) -> None:
    """decode-0 drained mid-stream: every stream whole and greedy-identical to the offline engine,
    moved (not prefilled again), decode-0 gone, no block left."""
    assert [g[:8] for g in got if g.startswith("error")] == []
    assert got == expected
    assert server.metric("pdserve_request_migrations_total", reason="drain", outcome="ok") > 0
    assert server.metric("pdserve_request_migrations_total", outcome="reprefilled") == 0
    assert server.metric("pdserve_request_retries_total") == 0
    moved = server.metric("pdserve_request_migrations_total")
    assert server.metric("pdserve_migration_stream_gap_seconds_count") == moved
    server.wait_pool("decode", up=1, draining=0)
    assert [w["id"] for w in server.workers("decode")] == ["decode-1"]
    assert server.metric("pdserve_worker_drains_total", pool="decode", outcome="ok") == 1
    server.wait_kv_free()


def drain_one_of_two_mid_stream(
    server: Server, prompts: list[list[int]], max_tokens: int, expected: list[str]
) -> None:
    """Stream every prompt over two decode workers, drain decode-0 once each stream has its first
    token: every stream whole and greedy-identical to the offline engine, decode-0 gone, nothing
    prefilled again, no block left."""

    async def during() -> None:
        answer = server.drain("decode-0")
        assert answer.status_code == 200 and answer.json()["state"] == "draining"
        assert answer.json()["streams"] > 0, "decode-0 held no stream when its drain began"

    check_drain_lost_nothing(server, run_streams(server, prompts, max_tokens, during), expected)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_streams_move_off_a_draining_decode_worker_without_a_lost_token(
    tiny_llama_4k: Path, transport: str
) -> None:
    # Two decode workers from the start: the streams need only outlast the drain's first look,
    # not a worker's start (the rebalance onto a new worker is tested in memory, and on Ray).
    expected = offline(tiny_llama_4k, PROMPTS[:8], 1000)
    server = Server(
        tiny_llama_4k, "--prefill", "1", "--decode", "2", "--decode-min", "1", "--transport", transport,
        "--num-kv-blocks", "4096",
    )  # fmt: skip
    try:
        drain_one_of_two_mid_stream(server, PROMPTS[:8], 1000, expected)
    finally:
        assert server.stop() == 0  # and no worker process, no segment left


@pytest.mark.parametrize("pool", ["decode", "colocated"])
def test_a_draining_workers_streams_move_and_it_stops_once_it_holds_nothing(pool: str) -> None:
    async def scenario() -> None:
        async with control_plane({pool: 2}, autostep=None) as cp:
            streams = [asyncio.create_task(cp.stream(f"r{i}", 4, 40)) for i in range(6)]
            await cp.step_until(lambda: all(len(cp.worker(w).requests) == 3 for w in cp.up(pool)), "3 each")
            for _ in range(3):
                cp.step_all()  # some tokens out: KV to move
            answer = cp.pools.drain(f"{pool}-0")
            assert answer["state"] == "draining" and answer["streams"] == 3
            await cp.step_until(lambda: f"{pool}-0" not in cp.states(pool), f"{pool}-0 stopped")
            assert cp.cluster.stopped == [(f"{pool}-0", True)] and cp.cluster.held_at_stop == {f"{pool}-0": 0}
            await cp.step_until(lambda: all(s.done() for s in streams), "every stream ended")
            assert [s.result() for s in streams] == [expected_stream(4, 40)] * 6  # whole, none repeated
            assert cp.counter(cp.metrics.migrations, "drain", "ok") == 3
            assert cp.counter(cp.metrics.worker_drains, pool, "ok") == 1
            assert cp.counter(cp.metrics.retries, "moved_before_start") == 0
            assert cp.pools.targets()[pool][0] == 1 and cp.up(pool) == [f"{pool}-1"]

    clock.run_virtual(scenario)


def test_a_drain_with_replace_serves_on_until_the_replacement_is_up_then_moves_its_streams() -> None:
    async def scenario() -> None:
        async with control_plane({"decode": 1}, autostep=None) as cp:
            streams = [asyncio.create_task(cp.stream(f"r{i}", 4, 30)) for i in range(4)]
            await cp.step_until(lambda: len(cp.worker("decode-0").requests) == 4, "four streams")
            cp.step_all()
            cp.cluster.hold_starts = True  # the replacement's start takes a while
            answer = cp.pools.drain("decode-0", replace=True)  # the only worker: no force needed
            assert answer["state"] == "up" and cp.pools.targets()["decode"][0] == 1
            await until(lambda: "decode-1" in cp.states("decode"), "the replacement starting")
            # Meanwhile decode-0 takes new requests: the pool is never below its target.
            late = asyncio.create_task(cp.stream("late", 4, 3))
            await cp.step_until(late.done, "a request served while the replacement starts")
            assert late.result() == expected_stream(4, 3)
            cp.cluster.release_starts()
            await cp.step_until(lambda: "decode-0" not in cp.states("decode"), "decode-0 drained and stopped")
            await cp.step_until(lambda: all(s.done() for s in streams), "every stream ended")
            assert [s.result() for s in streams] == [expected_stream(4, 30)] * 4
            assert cp.counter(cp.metrics.migrations, "drain", "ok") == 4
            assert cp.up("decode") == ["decode-1"] and cp.pools.targets()["decode"][0] == 1

    clock.run_virtual(scenario)


def test_a_draining_prefill_worker_stops_only_after_its_kv_was_pulled_and_released() -> None:
    async def scenario() -> None:
        async with control_plane({"prefill": 2, "decode": 1}, autostep=None) as cp:
            streams = [asyncio.create_task(cp.stream(f"r{i}", 100 + i, 5)) for i in range(6)]
            await until(lambda: len(cp.worker("prefill-0").requests) == 3, "three prompts on prefill-0")
            assert cp.pools.drain("prefill-0")["streams"] == 3  # drained with its prompts queued
            await cp.step_until(lambda: all(s.done() for s in streams), "every stream ended")
            await cp.step_until(lambda: "prefill-0" not in cp.states("prefill"), "prefill-0 stopped")
            assert [s.result() for s in streams] == [expected_stream(100 + i, 5) for i in range(6)]
            assert cp.cluster.held_at_stop["prefill-0"] == 0  # every lease released before it stopped
            assert len(cp.worker("prefill-0").received_of(wire.Release)) == 3
            assert cp.counter(cp.metrics.worker_drains, "prefill", "ok") == 1
            assert not any(
                m.request_id.endswith(".1") for m in cp.worker("prefill-1").received_of(wire.AddRequest)
            )

    clock.run_virtual(scenario)


def test_past_the_drain_timeout_streams_that_cannot_move_end_with_an_error() -> None:
    settings = PoolSettings(start_timeout=10.0, drain_timeout=0.2, settle_seconds=0.0)

    async def scenario() -> None:
        async with control_plane({"decode": 1}, autostep=None, settings=settings) as cp:
            streams = [asyncio.create_task(cp.stream(f"r{i}", 4, 10**6)) for i in range(2)]
            await cp.step_until(lambda: len(cp.worker("decode-0").requests) == 2, "two streams")
            with pytest.raises(PoolError, match="force"):
                cp.pools.drain("decode-0")  # the last worker up: refused unless asked for
            cp.pools.drain("decode-0", force=True)
            await cp.step_until(lambda: all(s.done() for s in streams), "the streams ended")
            assert all(isinstance(s.result(), str) and "drain-timeout" in s.result() for s in streams)
            assert cp.counter(cp.metrics.worker_drains, "decode", "timeout") == 1
            assert cp.states("decode") == {}

    clock.run_virtual(scenario)
