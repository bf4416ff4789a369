"""Faults across the disaggregated path, end to end: workers killed with SIGKILL under load, KV
transfers dropped on purpose, an empty pool. Afterwards every live worker holds no KV block and
every request either completed or got a clear error."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import openai
import pytest
from serving import Server

from pdserve import LLM, SamplingParams, wire
from pdserve.cluster.local import LocalCluster
from pdserve.config import EngineConfig, Role, WorkerConfig
from pdserve.router.app import _error_kind
from pdserve.router.channel import ZmqConnector
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher, RequestInvalid, RequestState
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers import WorkerSet
from pdserve.security import DeploymentSecrets

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


def test_requests_on_a_killed_prefill_worker_are_prefilled_again(tiny_llama: Path, offline: LLM) -> None:
    # No replacement: the retries go to the decode worker, which prefills them itself.
    server = Server(tiny_llama, "--prefill", "1", "--decode", "1", "--no-replace-failed")
    try:
        # Freeze the prefill worker so that every request is stuck on it, then kill it.
        os.kill(server.worker_pids["prefill-0"], signal.SIGSTOP)

        async def scenario() -> list[str]:
            requests = asyncio.ensure_future(complete_all(server, 10))
            await asyncio.sleep(1.0)  # all sent and queued on the frozen worker (heartbeat: 3 s)
            assert not requests.done()
            server.kill_worker("prefill-0")
            return await requests

        started = time.monotonic()
        assert asyncio.run(scenario()) == expected_texts(offline, 10)
        assert time.monotonic() - started < 30
        # Each was prefilled again, locally on the decode worker: counted as retries.
        assert server.metric("pdserve_request_retries_total", reason="prefill_worker_down") == len(PROMPTS)
        assert server.metric("pdserve_requests_total", path="local_prefill", outcome="ok") == len(PROMPTS)
        assert server.metric("pdserve_worker_up", worker="prefill-0") == 0
        server.wait_kv_free()
    finally:
        server.stop()


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


def test_a_killed_decode_workers_streams_go_on_on_another_with_the_same_tokens(tiny_llama: Path) -> None:
    # Its KV died with it: each of its streams is prefilled again on the prefill pool from the
    # prompt and the tokens the client has seen (as outputs), and decoded on the other worker.
    max_tokens = 690
    offline = LLM(str(tiny_llama), dtype="float32")
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    expected = [o.outputs[0].text for o in offline.generate(PROMPTS[:6], greedy)]
    server = Server(tiny_llama, "--prefill", "1", "--decode", "2", "--no-replace-failed")
    try:

        async def stream(prompt: str, started: asyncio.Event) -> str:
            chunks = await server.async_client.completions.create(
                model=server.model,
                prompt=prompt,
                max_tokens=max_tokens,
                temperature=0.0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            text = ""
            async for chunk in chunks:
                text += chunk.choices[0].text
                started.set()
            return text

        async def scenario() -> tuple[list[str], float]:
            events = [asyncio.Event() for _ in range(6)]
            tasks = [asyncio.ensure_future(stream(p, e)) for p, e in zip(PROMPTS, events, strict=False)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in events)), 30)
            os.kill(server.worker_pids["decode-0"], signal.SIGSTOP)  # frozen mid-stream, then gone
            server.kill_worker("decode-0")
            killed_at = time.monotonic()
            results = await asyncio.wait_for(asyncio.gather(*tasks), 60)
            return list(results), time.monotonic() - killed_at

        results, seconds = asyncio.run(scenario())
        assert results == expected  # every stream whole, the offline engine's tokens
        resumed = server.metric("pdserve_request_retries_total", reason="decode_worker_down")
        assert 1 <= resumed < len(results)  # decode-0's streams; decode-1's carried on untouched
        assert server.metric("pdserve_requests_total", outcome="ok") == len(results)
        # New requests avoid the dead worker and complete.
        for prompt in PROMPTS[:3]:
            answer = server.client.completions.create(model=server.model, prompt=prompt, max_tokens=5)
            assert answer.choices[0].finish_reason in ("length", "stop")
        assert seconds < 30
        server.wait_kv_free()

        # With the whole decode pool gone, requests get a 503 at once, not a hang.
        server.kill_worker("decode-1")
        server.wait_for(
            lambda: server.metric("pdserve_worker_up", pool="decode") == 0, what="decode pool down"
        )
        with pytest.raises(openai.InternalServerError) as failure:
            server.client.completions.create(model=server.model, prompt="hello", max_tokens=5)
        assert failure.value.status_code == 503 and "decode pool is empty" in failure.value.message
        assert server.http.get("/health").status_code == 503
    finally:
        server.stop()


def test_a_silent_worker_hits_the_token_timeout_and_a_departed_client_aborts(tiny_llama: Path) -> None:
    # Heartbeats would take the frozen worker out after 30 s; the 1.5 s token timeout comes first.
    server = Server(
        tiny_llama, "--prefill", "1", "--decode", "1", "--token-timeout", "1.5", "--heartbeat-timeout", "30"
    )
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
    finally:
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
                await asyncio.sleep(0.5)
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


def test_what_a_frozen_worker_held_is_aborted_when_it_reconnects(tiny_llama_4k: Path) -> None:
    # Frozen past the heartbeat timeout, the worker is taken out and its stream ends with an error
    # (no other decode worker to resume it on);
    # when it thaws it reconnects (the router keeps its identity) and is told to drop that stream,
    # instead of decoding it to the end for nobody.
    server = Server(
        tiny_llama_4k,
        "--prefill",
        "1",
        "--decode",
        "1",
        "--heartbeat-timeout",
        "1",
        "--num-kv-blocks",
        "4096",
    )
    decode = server.worker_pids["decode-0"]
    try:
        stream = server.client.completions.create(
            model=server.model, prompt=PROMPTS[3], max_tokens=3500, temperature=0.0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        next(iter(stream))
        os.kill(decode, signal.SIGSTOP)
        # No other decode worker to go on on: the stream ends, saying why.
        with pytest.raises(
            openai.APIError, match=r"went down mid-stream .* cannot go on: .*decode pool is empty"
        ):
            for _ in stream:
                pass
        os.kill(decode, signal.SIGCONT)
        server.wait_pool("decode", up=1, timeout=20)
        thawed = time.monotonic()
        server.wait_kv_free(timeout=20)
        # Decoding the remaining ~3000 tokens would take far longer than this.
        assert time.monotonic() - thawed < 3.0
    finally:
        os.kill(decode, signal.SIGCONT)
        server.stop()


def test_a_request_a_worker_refuses_as_invalid_fails_at_once_without_retries(tiny_llama: Path) -> None:
    # The router validates every request first, so only a router bug sends a worker a request it
    # refuses (a retry that once asked for min_tokens > max_tokens): that is no transient fault,
    # and trying it max_retries times more only delays the error.
    secrets = DeploymentSecrets.generate()

    async def scenario() -> None:
        cluster = LocalCluster(secrets.for_workers(), pin_cpus=False)
        workers = WorkerSet(ZmqConnector(secrets.router))
        dispatcher = Dispatcher(workers, RouterConfig(max_retries=5), RouterMetrics())
        try:
            for pool, role in (("prefill", Role.PREFILL), ("decode", Role.DECODE)):
                engine = EngineConfig(model=str(tiny_llama), dtype="float32", role=role, num_kv_blocks=64)
                config = WorkerConfig(f"{pool}-0", pool, engine, log_level="WARNING")
                handle = await cluster.start_worker(config, timeout=120)
                workers.add_worker(handle.worker_id, pool, handle.rpc_address, handle.rpc_public_key)
            deadline = time.monotonic() + 30
            while len(workers.up("prefill", "decode")) < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            prompt = list(range(5, 45))  # long enough for the prefill pool
            good = wire.WireSamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
            tokens = [t for e in [e async for e in dispatcher.generate(RequestState("ok"), prompt, good)] for t in e.token_ids]  # fmt: skip
            assert len(tokens) == 3
            bad = wire.WireSamplingParams(max_tokens=3, min_tokens=9)  # what the router never sends
            for path_prompt in (prompt, prompt[:4]):  # remote prefill, then local (decode worker)
                state = RequestState(f"bad-{len(path_prompt)}")
                with pytest.raises(RequestInvalid, match=r"refused the request: .*min_tokens") as refused:
                    async for _ in dispatcher.generate(state, path_prompt, bad):
                        pass
                assert state.retries == 0 and state.outcome == "error"
                assert _error_kind(refused.value) == ("invalid_request_error", 400)  # a 400, not a 500
            exposition = dispatcher.metrics.render().decode()
            assert "pdserve_request_retries_total{" not in exposition  # no retry of any reason
        finally:
            await workers.close()
            await cluster.close()

    asyncio.run(scenario())
