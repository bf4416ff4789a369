"""`pdserve serve` on a CUDA GPU (skipped without one; run by `scripts/device_check.sh serve`): both
pools on one GPU with the KV moving over tcp through pinned host buffers, and colocated, each
answering a greedy chat as the offline engine on the same GPU does; streams moved off a draining
decode worker on the GPU without a lost token."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from serving import Server
from test_pools_drain import (
    LONG_STREAM,
    PROMPTS,
    check_moves_lost_nothing,
    offline,
    run_streams,
    scale_up_then_drain_the_first,
)

from pdserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def offline_answer() -> str:
    llm = LLM("smollm2-135m", dtype="float32", device="cuda", num_kv_blocks=128)
    out = llm.chat(QUESTION, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return out[0].outputs[0].text


@pytest.mark.parametrize(
    "layout",
    [
        ("--prefill", "1", "--decode", "1", "--prefill-gpus", "0", "--decode-gpus", "0"),  # tcp, staged
        ("--colocated", "1", "--colocated-gpus", "0"),
    ],
)
def test_serving_on_the_gpu_answers_as_the_offline_engine_does(
    offline_answer: str, layout: tuple[str, ...]
) -> None:
    server = Server("smollm2-135m", *layout, "--device", "cuda", ready_timeout=600)
    try:
        reply = server.client.chat.completions.create(
            model="smollm2-135m",
            messages=QUESTION,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        assert reply.choices[0].message.content == offline_answer
        assert "Paris" in offline_answer
        assert server.metric("pdserve_requests_total", outcome="ok") == 1
    finally:
        assert server.stop() == 0


def test_streams_move_off_a_draining_gpu_decode_worker_without_a_lost_token(tiny_llama_4k: Path) -> None:
    expected = offline(tiny_llama_4k, PROMPTS, LONG_STREAM)  # the offline engine on the GPU too
    server = Server(
        tiny_llama_4k, "--prefill", "1", "--decode", "1", "--decode-max", "2", "--device", "cuda",
        "--num-kv-blocks", "4096",
    )  # fmt: skip
    try:
        got = run_streams(server, PROMPTS, LONG_STREAM, scale_up_then_drain_the_first(server))
        check_moves_lost_nothing(server, got, expected)
    finally:
        assert server.stop() == 0
