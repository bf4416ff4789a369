"""The serving smoke under an ISA cap, run by scripts/test.sh as `PDSERVE_CPU_ISA=avx2 pytest
tests/smoke_isa_cap.py` after the whole suite (not collected by a plain `pytest`: it is meant for a
capped process). On a better CPU it runs what an AVX2-only machine runs: the plan of the AVX2 level,
the C++ kernels compiled for x86-64-v3, torch's own dispatch capped; on an AVX2 machine it is the
machine's own path. The real SmolLM2, disaggregated over shm and colocated: a greedy chat answer
equal to the offline engine's, and a clean stop (no process, no shared-memory segment left)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from serving import Server

from pdserve import LLM, SamplingParams
from pdserve.ops.cpu import isa as cpu_isa
from pdserve.ops.cpu.plan import cpu_plan

pytestmark = pytest.mark.skipif(
    os.environ.get(cpu_isa.ISA_ENV) != "avx2", reason="run by scripts/test.sh with PDSERVE_CPU_ISA=avx2"
)
QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
MAX_TOKENS = 32


def test_pdserve_info_says_what_the_cap_leaves() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "info"], capture_output=True, text=True, timeout=600, check=True
    ).stdout
    isa = cpu_isa.probe()
    assert f"ISA: {isa.describe()}" in out and "dtype=auto: float32" in out
    assert "bfloat16 prepack: unavailable — oneDNN needs AVX512-BW/VL/DQ or AVX-NE-CONVERT" in out
    if isa.capped:  # a better CPU than AVX2, held to it
        assert "(its own dispatch: AVX2)" in out and "ONEDNN_MAX_CPU_ISA=AVX2" in out
        assert "C++ kernels: avx2 (-march=x86-64-v3)" in out
    assert "Traceback" not in out


@pytest.fixture(scope="module")
def offline_answer() -> str:
    llm = LLM("smollm2-135m", dtype="float32", num_kv_blocks=128)
    # An AVX2 CPU's path: fp32, with the weights stored in bf16 where its plan found the stream faster.
    plan = cpu_plan()
    assert llm.engine.runner.dtype == torch.float32 and plan.isa == "avx2"
    assert llm.engine.runner.model.weights_in_bf16 == (plan.stream_rows.get("float32", 0) > 0)
    out = llm.chat(QUESTION, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    return out[0].outputs[0].text


@pytest.mark.parametrize(
    "layout", [("--prefill", "1", "--decode", "1", "--transport", "shm"), ("--colocated", "1")]
)
def test_serving_answers_as_the_offline_engine_does(offline_answer: str, layout: tuple[str, ...]) -> None:
    server = Server("smollm2-135m", *layout, ready_timeout=600)
    try:
        reply = server.client.chat.completions.create(
            model="smollm2-135m",
            messages=QUESTION,
            max_tokens=MAX_TOKENS,
            temperature=0,  # type: ignore[arg-type]
        )
        assert reply.choices[0].message.content == offline_answer
        assert "Paris" in offline_answer
    finally:
        assert server.stop() == 0
