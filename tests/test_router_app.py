"""The router's HTTP API end to end: a real `pdserve serve` (router + a prefill and a decode worker
as processes, KV over shared memory), the official `openai` client, real sockets."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from serving import Server

from pdserve import LLM, SamplingParams

# Long enough to take the remote-prefill path (the default local threshold is 16 tokens).
LONG_PROMPTS = ["The quick brown fox jumps over the lazy dog. " * k for k in (1, 3, 6)]
SHORT_PROMPTS = ["Hi", "abc"]  # 3 and 4 tokens with BOS: prefilled on the decode worker


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[Server]:
    srv = Server(tiny_llama, "--prefill", "1", "--decode", "1")
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def offline(tiny_llama: Path) -> LLM:
    return LLM(str(tiny_llama), dtype="float32")


def greedy_text(llm: LLM, prompt: str, max_tokens: int) -> str:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return llm.generate(prompt, params)[0].outputs[0].text


def test_greedy_output_matches_the_offline_engine_on_both_paths(server: Server, offline: LLM) -> None:
    remote_before = server.metric("pdserve_requests_total", path="remote_prefill", outcome="ok")
    local_before = server.metric("pdserve_requests_total", path="local_prefill", outcome="ok")
    for prompt in LONG_PROMPTS + SHORT_PROMPTS:
        answer = server.client.completions.create(
            model=server.model, prompt=prompt, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}
        )
        assert answer.choices[0].text == greedy_text(offline, prompt, 12), prompt
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage is not None and answer.usage.completion_tokens == 12
    assert server.metric("pdserve_requests_total", path="remote_prefill", outcome="ok") - remote_before == 3
    assert server.metric("pdserve_requests_total", path="local_prefill", outcome="ok") - local_before == 2
    # The KV crossed from the prefill worker to the decode worker, and every block came back.
    assert server.metric("pdserve_kv_transfer_bytes_sum") > 0
    server.wait_kv_free()


def test_streamed_chat_and_completion_with_usage(server: Server, offline: LLM) -> None:
    stream = server.client.chat.completions.create(
        model=server.model,
        messages=[{"role": "user", "content": "Tell me about the sea, at length please."}],
        max_tokens=10,
        temperature=0.0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    # The role comes with the first token, not ahead of it: a client timing its first chunk
    # measures the time to the first token.
    first = chunks[0].choices[0]
    assert first.delta.role == "assistant" and (first.delta.content or first.finish_reason)
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-2].choices[0].finish_reason == "length"
    usage = chunks[-1].usage
    assert usage is not None and not chunks[-1].choices
    assert usage.completion_tokens == 10 and usage.prompt_tokens > 16
    chat_prompt = offline.get_tokenizer().apply_chat_template(
        [{"role": "user", "content": "Tell me about the sea, at length please."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    expected = (
        offline.generate(
            offline.get_tokenizer().encode(chat_prompt, add_special_tokens=False),
            SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        )[0]
        .outputs[0]
        .text
    )
    assert text == expected

    pieces = [
        c.choices[0].text
        for c in server.client.completions.create(
            model=server.model, prompt=LONG_PROMPTS[1], max_tokens=8, temperature=0.0, stream=True
        )
    ]
    assert len(pieces) > 1 and "".join(pieces)


def test_stop_string_ends_the_text_and_the_request(server: Server, offline: LLM) -> None:
    full = greedy_text(offline, LONG_PROMPTS[0], 16)
    stop = full[4:6]
    answer = server.client.completions.create(
        model=server.model, prompt=LONG_PROMPTS[0], max_tokens=16, temperature=0.0, stop=[stop]
    )
    assert answer.choices[0].text == full[: full.index(stop)]
    assert answer.choices[0].finish_reason == "stop"
    server.wait_kv_free()


def test_sampling_with_a_seed_is_repeatable(server: Server) -> None:
    def sample() -> str:
        answer = server.client.completions.create(
            model=server.model, prompt=LONG_PROMPTS[0], max_tokens=10, temperature=1.0, top_p=0.9, seed=7
        )
        return answer.choices[0].text

    assert sample() == sample()


def test_thirty_two_concurrent_requests_of_mixed_lengths_all_complete(server: Server) -> None:
    async def one(i: int) -> int:
        prompt = "word " * (1 + (i * 7) % 60)
        answer = await server.async_client.completions.create(
            model=server.model,
            prompt=prompt,
            max_tokens=4 + i % 9,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert answer.usage is not None
        return answer.usage.completion_tokens

    async def all_of_them() -> list[int]:
        return await asyncio.gather(*(one(i) for i in range(32)))

    assert asyncio.run(all_of_them()) == [4 + i % 9 for i in range(32)]
    server.wait_kv_free()


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (b"{not json", "not valid JSON"),
        (b"", "empty"),
        (b'{"model": "smollm2", "prompt": "hi"}', "is not served here"),
        (b'{"model": "M", "prompt": "hi", "max_tokens": 0}', "max_tokens"),
        (b'{"model": "M", "prompt": "hi", "max_tokens": "ten"}', "$.max_tokens"),
        (b'{"model": "M", "prompt": "hi", "temperature": -1}', "temperature"),
        (b'{"model": "M", "prompt": "hi", "n": 2}', "n=1"),
        (b'{"model": "M", "prompt": "' + b"x" * 2000 + b'"}', "context"),
        (b'{"model": "M", "prompt": [1, 99999]}', "token ids"),
        (
            b'{"model": "M", "prompt": [' + b"5," * 3000 + b"5]}",
            "context",
        ),  # a long id list: the context error
        (b'{"model": "M"}', "prompt"),
        (b'{"model": "M", "prompt": "hi", "seed": 100000000000000000000000}', "$.seed"),
        (b'{"model": "M", "prompt": "hi", "temperature": 1e400}', "$.temperature"),
        (b'{"model": "M", "prompt": "hi", "logit_bias": {"five": 10}}', "logit_bias keys must be token ids"),
        (
            '{"model": "M", "prompt": "hi", "logit_bias": {"\u00b2": 1}}'.encode(),
            "logit_bias keys must be token ids",
        ),
        (b'{"model": "M", "prompt": "hi", "logit_bias": {"5": 101}}', "biases in [-100, 100]"),
        (b'{"model": "M", "prompt": "hi", "logit_bias": {"999999": 1}}', "outside the vocabulary"),
        (b'{"model": "M", "prompt": "hi", "logit_bias": {"5": 1, "05": -1}}', "names token 5 twice"),
        (b'{"model": "M", "prompt": "hi", "guided_json": {}}', "guided_json is not supported"),
        (
            b'{"model": "M", "prompt": "hi", "kv_transfer_params": {"remote_host": "x"}}',
            "decided by the server",
        ),
        (b'{"model": "M", "prompt": "hi", "request_id": "mine"}', "request_id is decided by the server"),
        (b'{"model": "M", "prompt": "hi", "stop_token_ids": [5, 1000000]}', "outside the vocabulary"),
        (b'{"model": "M", "prompt": "hi", "stop": [' + b'"a",' * 64 + b'"b"]}', "at most 64 strings"),
    ],
)
def test_bad_requests_get_a_400_with_an_openai_error_body(server: Server, body: bytes, fragment: str) -> None:
    body = body.replace(b'"M"', f'"{server.model}"'.encode())
    response = server.http.post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert fragment in error["message"] and error["type"] == "invalid_request_error"


def test_logit_bias_bans_and_forces_tokens_on_both_paths(server: Server, offline: LLM) -> None:
    for prompt in (LONG_PROMPTS[1], SHORT_PROMPTS[0]):  # remote and local prefill
        ids = offline.get_tokenizer().encode(prompt)
        plain = offline.generate([ids], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
        first = plain.outputs[0].token_ids[0]
        banned = server.client.completions.create(
            model=server.model, prompt=prompt, max_tokens=4, temperature=0.0,
            logit_bias={str(first): -100}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        expected = offline.generate(
            [ids], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logit_bias={first: -100.0})
        )[0]
        assert banned.choices[0].text == expected.outputs[0].text != plain.outputs[0].text
        forced = server.client.completions.create(
            model=server.model, prompt=prompt, max_tokens=3, temperature=0.7, seed=1,
            logit_bias={"65": 100}, extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert forced.choices[0].text == offline.get_tokenizer().decode([65, 65, 65])


def test_logprobs_on_both_endpoints_and_both_paths_are_the_offline_engines(
    server: Server, offline: LLM
) -> None:
    for prompt in (LONG_PROMPTS[1], SHORT_PROMPTS[0]):  # remote and local prefill
        ids = offline.get_tokenizer().encode(prompt)
        params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logprobs=3)
        expected = offline.generate([ids], params)[0].outputs[0]
        assert expected.logprobs is not None
        answer = server.client.completions.create(
            model=server.model, prompt=prompt, max_tokens=5, temperature=0.0, logprobs=3,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        lp = answer.choices[0].logprobs
        assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
        assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
        assert lp.text_offset is not None and lp.text_offset[0] == 0 and len(lp.text_offset) == 5
        assert lp.text_offset == sorted(lp.text_offset)
        decode = offline.get_tokenizer().decode
        for top, exp in zip(lp.top_logprobs, expected.logprobs, strict=True):
            # The legacy shape is keyed by text: tokens that read the same share a key, the best stays.
            keyed: dict[str, float] = {}
            for token_id, value in sorted(exp.top.items(), key=lambda item: -item[1]):
                keyed.setdefault(decode([token_id], skip_special_tokens=False), value)
            keyed.setdefault(decode([exp.token_id], skip_special_tokens=False), exp.logprob)
            assert top == pytest.approx(keyed, abs=1e-4)

    # Chat, streamed: each chunk carries its tokens' entries; greedy picks the best of the top ones.
    stream = server.client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": LONG_PROMPTS[1]}], max_tokens=6,
        temperature=0.0, logprobs=True, top_logprobs=2, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = []
    completion_tokens = None
    for chunk in stream:
        if chunk.usage is not None:
            completion_tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.logprobs is not None and choice.logprobs.content:
                content.extend(choice.logprobs.content)
    assert completion_tokens == 6 and len(content) == 6
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-6)
        assert entry.bytes is not None
    # Not asked for: none sent.
    plain = server.client.chat.completions.create(
        model=server.model, messages=[{"role": "user", "content": "hi"}], max_tokens=2
    )
    assert plain.choices[0].logprobs is None
    for body, param in (
        ({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 2}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 21},
            "top_logprobs",
        ),
    ):
        response = server.http.post("/v1/chat/completions", json={"model": server.model, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param
    response = server.http.post(
        "/v1/completions", json={"model": server.model, "prompt": "hi", "logprobs": 21}
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "logprobs"
    server.wait_kv_free()


def test_min_tokens_holds_off_eos_on_both_paths(server: Server, offline: LLM) -> None:
    eos = offline.get_tokenizer().eos_token_id
    assert eos is not None
    for prompt in (LONG_PROMPTS[1], SHORT_PROMPTS[0]):
        # EOS forced: the answer ends at its first token, unless min_tokens holds it off.
        quick = server.client.completions.create(
            model=server.model, prompt=prompt, max_tokens=10, temperature=0.0, logit_bias={str(eos): 100}
        )
        assert quick.choices[0].finish_reason == "stop" and quick.usage is not None
        assert quick.usage.completion_tokens == 1
        held = server.client.completions.create(
            model=server.model, prompt=prompt, max_tokens=10, temperature=0.0, logit_bias={str(eos): 100},
            extra_body={"min_tokens": 4},
        )  # fmt: skip
        assert held.choices[0].finish_reason == "stop" and held.usage is not None
        assert held.usage.completion_tokens == 5  # four held off, then the EOS
        ids = offline.get_tokenizer().encode(prompt)
        expected = offline.generate(
            [ids], SamplingParams(max_tokens=10, temperature=0.0, logit_bias={eos: 100.0}, min_tokens=4)
        )[0]
        assert held.choices[0].text == expected.outputs[0].text
    response = server.http.post(
        "/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 3, "min_tokens": 4}
    )
    assert response.status_code == 400 and "min_tokens" in response.json()["error"]["message"]
    server.wait_kv_free()


def test_chats_with_a_role_or_a_template_the_server_does_not_take_are_refused(server: Server) -> None:
    for body, param in (
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 7*7 }}"}, "chat_template"),
        (
            {"messages": [{"role": "user", "content": "hi"}], "chat_template_kwargs": {"x": 1}},
            "chat_template_kwargs",
        ),
    ):
        response = server.http.post("/v1/chat/completions", json={"model": server.model, **body})
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


def test_a_body_over_the_limit_is_a_413_declared_or_not(server: Server) -> None:
    big = b'{"model": "M", "prompt": "' + b"x" * (9 << 20) + b'"}'
    declared = server.http.post("/v1/completions", content=big, headers={"content-type": "application/json"})
    assert declared.status_code == 413 and "limit of 8388608 bytes" in declared.json()["error"]["message"]

    def chunked() -> Iterator[bytes]:  # no Content-Length: the router counts as it reads
        for i in range(0, len(big), 1 << 20):
            yield big[i : i + (1 << 20)]

    streamed = server.http.post(
        "/v1/completions", content=chunked(), headers={"content-type": "application/json"}
    )
    assert streamed.status_code == 413
    assert server.http.get("/health").status_code == 200


def test_a_request_head_over_the_limit_is_a_431_and_the_server_serves_on(server: Server) -> None:
    response = httpx.post(
        f"{server.url}/v1/completions", headers={"x-padding": "v" * 70_000}, json={}, timeout=10
    )
    assert response.status_code == 431
    assert server.http.get("/health").status_code == 200


def test_the_openai_client_raises_bad_request_for_a_bad_chat(server: Server) -> None:
    with pytest.raises(openai.BadRequestError, match="messages"):
        server.client.chat.completions.create(model=server.model, messages=[])


def test_models_health_and_metrics(server: Server) -> None:
    assert [m.id for m in server.client.models.list().data] == [server.model]
    health = server.http.get("/health").json()
    assert health["status"] == "ok" and set(health["workers"]) == {"prefill-0", "decode-0"}
    metrics = server.metrics()
    for name in (
        "pdserve_time_to_first_token_seconds",
        "pdserve_inter_token_latency_seconds",
        "pdserve_worker_up",
    ):
        assert name in metrics
    assert server.metric("pdserve_worker_up", pool="prefill") == 1


def test_a_client_that_disconnects_mid_stream_aborts_its_request(server: Server) -> None:
    aborted_before = server.metric("pdserve_requests_total", outcome="aborted")
    body = {
        "model": server.model,
        "prompt": LONG_PROMPTS[2],
        "max_tokens": 500,
        "stream": True,
        "ignore_eos": True,
    }
    with (
        httpx.Client(base_url=server.url, timeout=30) as http,
        http.stream("POST", "/v1/completions", json=body) as r,
    ):
        lines = r.iter_lines()
        assert next(line for line in lines if line.startswith("data:"))
    # The connection is closed: the router aborts the request on its worker and frees its blocks.
    server.wait_for(
        lambda: server.metric("pdserve_requests_total", outcome="aborted") > aborted_before,
        what="abort counted",
    )
    server.wait_kv_free()


def nixl_available() -> bool:
    import importlib.util

    return importlib.util.find_spec("nixl") is not None


@pytest.mark.parametrize(
    "transport",
    [
        "tcp",
        pytest.param("nixl", marks=pytest.mark.skipif(not nixl_available(), reason="nixl is not installed")),
    ],
)
def test_greedy_output_is_identical_over_the_other_transports(
    tiny_llama: Path, offline: LLM, transport: str
) -> None:
    srv = Server(tiny_llama, "--prefill", "1", "--decode", "1", "--transport", transport)
    try:
        for prompt in LONG_PROMPTS:
            answer = srv.client.completions.create(
                model=srv.model,
                prompt=prompt,
                max_tokens=12,
                temperature=0.0,
                extra_body={"ignore_eos": True},
            )
            assert answer.choices[0].text == greedy_text(offline, prompt, 12), prompt
        assert srv.metric("pdserve_kv_transfer_bytes_count", transport=transport) == len(LONG_PROMPTS)
        assert srv.metric("pdserve_kv_transfer_bytes_sum", transport=transport) > 0
        srv.wait_kv_free()
    finally:
        srv.stop()
