"""Faults across the disaggregated path. The dispatcher's own logic over scripted workers (fast, in
memory: tests/fakes.py): a dead prefill or decode worker's requests prefilled again and whole, a
silent worker's token timeout, a worker that reconnects told to drop what was given up on, a
refusal that is not retried. End to end with real servers: KV transfers dropped or corrupted on
purpose and retried, a frozen worker's token timeout and an empty decode pool seen over HTTP, a
burst over the in-flight limit. Afterwards every live worker holds no KV block and every request
either completed or got a clear error."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from fakes import control_plane, expected_stream, until
from serving import Server
from test_pools_drain import poll

from pdserve import LLM, SamplingParams, clock, wire
from pdserve.pools.manager import PoolSettings
from pdserve.router.app import _error_kind
from pdserve.router.config import RouterConfig
from pdserve.router.placement import Unavailable
from pdserve.router.request_state import RequestInvalid, RequestState

PROMPTS = [f"Request {i}: " + "the quick brown fox jumps over the lazy dog " * (2 + i) for i in range(8)]


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32")


def expected_texts(llm: LLM, max_tokens: int) -> list[str]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params)]


async def complete_all(server: Server, max_tokens: int) -> list[str]:
    async def one(prompt: str) -> str:
        answer = await server.async_client.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        return answer.choices[0].text

    return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


def test_requests_on_a_dead_prefill_worker_are_prefilled_again_locally() -> None:
    # No replacement: the retries go to the decode worker, which prefills them itself.
    settings = PoolSettings(start_timeout=10.0, replace_failed=False, settle_seconds=0.0)

    async def scenario() -> None:
        async with control_plane({"prefill": 1, "decode": 1}, settings=settings, autostep=None) as cp:
            streams = [asyncio.create_task(cp.stream(f"r{i}", 100 + i, 10)) for i in range(4)]
            await until(lambda: len(cp.worker("prefill-0").requests) == 4, "all queued on prefill-0")
            cp.cluster.crash("prefill-0")
            await cp.step_until(lambda: all(s.done() for s in streams), "every stream ended")
            assert [s.result() for s in streams] == [expected_stream(100 + i, 10) for i in range(4)]
            assert cp.counter(cp.metrics.retries, "prefill_worker_down") == 4  # counted, not silent
            assert cp.counter(cp.metrics.requests, "local_prefill", "ok") == 4
            assert cp.worker("decode-0").requests == {}  # nothing left behind

    clock.run_virtual(scenario)


def test_dropped_kv_transfers_are_counted_and_retried_not_recomputed_silently(
    tiny_llama: Path, offline: LLM
) -> None:
    server = Server(
        tiny_llama, "--prefill", "1", "--decode", "1", "--kv-fault-rate", "0.5", "--max-retries", "20"
    )
    try:
        assert asyncio.run(complete_all(server, 10)) == expected_texts(offline, 10)
        failures = server.metric("pdserve_kv_transfer_failures_total")
        assert failures > 0
        assert server.metric("pdserve_request_retries_total", reason="kv_transfer_failed") == failures
        assert server.metric("pdserve_requests_total", outcome="ok") == len(PROMPTS)
        # A retry after the first token carries it as an output, which min_tokens and max_tokens
        # count: with EOS forced, each answer still runs to max_tokens (min_tokens = max_tokens).
        eos = offline.get_tokenizer().eos_token_id
        for prompt in PROMPTS:
            held = server.client.completions.create(
                model=server.model, prompt=prompt, max_tokens=6, temperature=0.0,
                logit_bias={str(eos): 100}, extra_body={"min_tokens": 6},
            )  # fmt: skip
            assert held.choices[0].finish_reason == "length" and held.usage is not None
            assert held.usage.completion_tokens == 6
        assert server.metric("pdserve_request_retries_total", reason="kv_transfer_failed") > failures
        server.wait_kv_free()
    finally:
        server.stop()


@pytest.mark.parametrize("transport", ["shm", "tcp"])
def test_kv_that_arrives_changed_is_caught_by_its_checksum_counted_and_retried(
    tiny_llama: Path, offline: LLM, transport: str
) -> None:
    # Every other pull lands with one bit flipped: the checksum turns each into a counted failure
    # and a retry, so every answer is still exactly the offline engine's.
    server = Server(
        tiny_llama, "--prefill", "1", "--decode", "1", "--transport", transport,
        "--kv-corrupt-rate", "0.5", "--kv-checksum", "on", "--max-retries", "20",
    )  # fmt: skip
    try:
        assert asyncio.run(complete_all(server, 10)) == expected_texts(offline, 10)
        caught = server.metric("pdserve_kv_checksum_failures_total", transport=transport, kind="prompt")
        assert caught > 0
        assert server.metric("pdserve_kv_transfer_failures_total") == caught  # nothing else failed
        assert server.metric("pdserve_request_retries_total", reason="kv_transfer_failed") == caught
        assert server.metric("pdserve_requests_total", outcome="ok") == len(PROMPTS)
        server.wait_kv_free()
    finally:
        server.stop()


def test_a_dead_decode_workers_streams_go_on_on_another_with_the_same_tokens() -> None:
    # Its KV died with it: each of its streams is prefilled again on the prefill pool from the
    # prompt and the tokens the client has seen (as outputs), and decoded on the other worker.
    settings = PoolSettings(start_timeout=10.0, replace_failed=False, settle_seconds=0.0)

    async def scenario() -> None:
        async with control_plane({"prefill": 1, "decode": 2}, settings=settings, autostep=None) as cp:
            streams = [asyncio.create_task(cp.stream(f"r{i}", 100 + i, 30)) for i in range(6)]
            await cp.step_until(
                lambda: all(len(cp.worker(w).requests) == 3 for w in cp.up("decode")), "running"
            )
            for _ in range(5):
                cp.step_all()
            cp.cluster.crash("decode-0")
            await cp.step_until(lambda: all(s.done() for s in streams), "every stream ended")
            assert [s.result() for s in streams] == [expected_stream(100 + i, 30) for i in range(6)]
            assert (
                cp.counter(cp.metrics.retries, "decode_worker_down") == 3
            )  # decode-0's; decode-1's untouched
            resumed = [m for m in cp.worker("prefill-0").received_of(wire.AddRequest) if m.output_token_ids]
            assert len(resumed) == 3  # prefilled again with the tokens already sent as outputs
            # With the whole decode pool gone, a request is refused at once, not left to hang.
            cp.cluster.crash("decode-1")
            with pytest.raises(Unavailable, match="decode pool is empty"):
                cp.dispatcher.admission.check_available()
            assert (await cp.stream("late", 100, 3)).startswith("error: no decode worker is up")

    clock.run_virtual(scenario)


def test_a_silent_worker_hits_the_token_timeout_and_its_request_is_aborted_there() -> None:
    config = RouterConfig(local_prefill_threshold=8, token_timeout=0.2)

    async def scenario() -> None:
        async with control_plane({"decode": 1}, config=config, autostep=None) as cp:
            stream = asyncio.create_task(cp.stream("r", 4, 50))
            await cp.step_until(lambda: len(cp.worker("decode-0").requests) == 1, "started")
            cp.step_all()  # one token, then silence (a frozen process whose connection stays up)
            await until(stream.done, "the stream ended")
            assert "timed out after 0.2 s waiting for the next token" in stream.result()
            assert cp.worker("decode-0").received_of(wire.Abort) == [wire.Abort("r.0")]
            assert cp.worker("decode-0").requests == {}  # its blocks are free

    clock.run_virtual(scenario)


def test_a_silent_worker_hits_the_token_timeout_and_a_departed_client_aborts(tiny_llama: Path) -> None:
    # The HTTP side of a failure mid-stream (an error event, then [DONE]) and of a client that
    # leaves, with a real frozen worker; the dispatcher's side is tested in memory below.
    # Heartbeats would take the frozen worker out after 30 s; the 1.5 s token timeout comes first.
    server = Server(
        tiny_llama, "--prefill", "1", "--decode", "1", "--token-timeout", "1.5", "--heartbeat-timeout", "30",
        "--no-replace-failed",
    )  # fmt: skip
    decode = server.worker_pids["decode-0"]
    try:
        os.kill(decode, signal.SIGSTOP)
        started = time.monotonic()
        stream = server.client.completions.create(
            model=server.model, prompt=PROMPTS[3], max_tokens=50, temperature=0.0, stream=True
        )
        with pytest.raises(openai.APIError, match=r"timed out after 1\.5 s waiting for the next token"):
            for _ in stream:
                pass
        assert time.monotonic() - started < 10
        assert server.metric("pdserve_requests_total", outcome="error") == 1

        # A non-streaming client that gives up: the router notices and aborts the request.
        with pytest.raises(httpx.ReadTimeout):
            server.http.post(
                "/v1/completions",
                json={"model": server.model, "prompt": PROMPTS[4], "max_tokens": 50},
                timeout=0.5,
            )
        server.wait_for(lambda: server.metric("pdserve_requests_total", outcome="aborted") == 1, what="abort")
        os.kill(decode, signal.SIGCONT)  # it finds the aborts queued and frees what it holds
        server.wait_kv_free()
        answer = server.client.completions.create(
            model=server.model, prompt=PROMPTS[0], max_tokens=5, extra_body={"ignore_eos": True}
        )
        assert answer.choices[0].finish_reason == "length"

        # With the whole decode pool gone, requests get a 503 at once, not a hang.
        server.kill_worker("decode-0")
        server.wait_for(
            lambda: server.metric("pdserve_worker_up", pool="decode") == 0, what="decode pool down"
        )
        with pytest.raises(openai.InternalServerError) as failure:
            server.client.completions.create(model=server.model, prompt="hello", max_tokens=5)
        assert failure.value.status_code == 503 and "decode pool is empty" in failure.value.message
        assert server.http.get("/health").status_code == 503
    finally:
        with contextlib.suppress(ProcessLookupError):  # killed above, if the test got that far
            os.kill(decode, signal.SIGCONT)
        server.stop()


def test_a_burst_over_the_in_flight_limit_gets_429s_never_500s(tiny_llama: Path) -> None:
    server = Server(tiny_llama, "--prefill", "1", "--decode", "1", "--max-in-flight", "2")
    try:

        async def burst() -> list[int]:
            async def one(i: int) -> int:
                response = await server.async_client.completions.with_raw_response.create(
                    model=server.model,
                    prompt=PROMPTS[i % len(PROMPTS)],
                    max_tokens=30,
                    extra_body={"ignore_eos": True},
                )
                return response.status_code

            results = await asyncio.gather(*(one(i) for i in range(8)), return_exceptions=True)
            return [r.status_code if isinstance(r, openai.APIStatusError) else r for r in results]  # type: ignore[misc]

        statuses = asyncio.run(burst())
        assert set(statuses) <= {200, 429} and 429 in statuses and 200 in statuses, statuses
        server.wait_kv_free()

        # A refusal says when to come back.
        async def over_the_limit() -> httpx.Response:
            async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
                long = {"model": server.model, "prompt": PROMPTS[0], "max_tokens": 900, "ignore_eos": True}
                blockers = [
                    asyncio.ensure_future(client.post("/v1/completions", json=long)) for _ in range(2)
                ]
                await poll(lambda: server.metric("pdserve_requests_in_flight") == 2, 60, "both admitted")
                try:
                    return await client.post(
                        "/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 2}
                    )
                finally:
                    assert [r.status_code for r in await asyncio.gather(*blockers)] == [200, 200]

        refused = asyncio.run(over_the_limit())
        assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1, refused.text
    finally:
        server.stop()


def test_what_a_worker_held_when_it_dropped_is_aborted_when_it_reconnects() -> None:
    async def scenario() -> None:
        async with control_plane({"decode": 1}, autostep=None) as cp:
            stream = asyncio.create_task(cp.stream("r", 4, 3500))
            await cp.step_until(lambda: len(cp.worker("decode-0").requests) == 1, "started")
            cp.step_all()
            cp.worker("decode-0").drop()  # frozen past the heartbeat timeout: out of service
            await until(stream.done, "the stream ended")
            # No other decode worker to go on on: the stream ends, saying why.
            assert "went down mid-stream" in stream.result() and "decode pool is empty" in stream.result()
            cp.worker("decode-0").reconnect()  # it thaws: the same process, holding the request
            await until(lambda: cp.up("decode") == ["decode-0"], "back in service")
            assert cp.worker("decode-0").received_of(wire.Abort) == [wire.Abort("r.0")]
            assert cp.worker("decode-0").requests == {}  # not decoded to the end for nobody

    clock.run_virtual(scenario)


def test_a_request_a_worker_refuses_as_invalid_fails_at_once_without_retries() -> None:
    # The router validates every request first, so only a router bug sends a worker a request it
    # refuses: that is no transient fault, and trying it max_retries times more only delays the error.
    config = RouterConfig(local_prefill_threshold=8, max_retries=5)

    async def scenario() -> None:
        async with control_plane({"prefill": 1, "decode": 1}, config=config) as cp:
            assert await cp.stream("ok", 40, 3) == expected_stream(40, 3)
            for worker in ("prefill-0", "decode-0"):
                cp.worker(worker).refuse = "min_tokens must be <= max_tokens"
            bad = wire.WireSamplingParams(max_tokens=3)
            for prompt in (40, 4):  # remote prefill, then local (decode worker)
                state = RequestState(f"bad-{prompt}")
                with pytest.raises(
                    RequestInvalid, match=r"prefill-0: min_tokens must be|decode-0: min_tokens must be"
                ) as refused:
                    async for _ in cp.dispatcher.generate(state, list(range(prompt)), bad):
                        pass
                assert state.retries == 0 and state.outcome == "error"
                assert _error_kind(refused.value) == ("invalid_request_error", 400)  # a 400, not a 500
            assert "pdserve_request_retries_total{" not in cp.metrics.render().decode()  # no retry at all

    clock.run_virtual(scenario)
