"""A roofline profile: the numbers it derives for a known model on known hardware, and what it
cannot model said plainly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.costmodel import Step
from pdserve.errors import PdserveError
from pdserve.sim.roofline import MODEL_SHAPES, Assumptions, derive, parameters


def test_llama_8b_on_an_h200_costs_what_its_bytes_and_flops_say() -> None:
    profile = derive("h200", "llama-3.1-8b")
    model = profile.model_config()
    assert parameters(model) == pytest.approx(8.03e9, rel=0.005)  # Llama 3.1 8B
    step = profile.steps["decode"]
    a = Assumptions()
    weights = parameters(model) * 2
    kv_token = 32 * 2 * 8 * 128 * 2  # layers x K/V x KV heads x head_dim x bf16 = 128 KiB
    # One stream at 1000 tokens reads the weights and its KV at 80% of 4.8 TB/s.
    expected = a.step_overhead_s + (weights + kv_token * 1000) / (4.8e12 * 0.8)
    assert step.seconds(Step(0, 0, 1, 1000)) == pytest.approx(expected)
    # An 8k-token prompt is compute-bound: 2 FLOPs a parameter a token, at 60% of 989 TFLOP/s.
    attention = 4 * 32 * 32 * 128 * (8192 * 8193 // 2)
    prompt = a.step_overhead_s + (2 * parameters(model) * 8192 + attention) / (989e12 * 0.6)
    assert step.seconds(Step(8192, 8192 * 8193 // 2, 0, 0)) == pytest.approx(prompt)
    blocks = int((141e9 * 0.9 - weights) // (kv_token * 16))
    assert profile.kv_blocks["decode"] == blocks
    assert profile.meta["device"] == "cuda"
    said = "\n".join(profile.assumptions)
    for fact in (
        "989 TFLOP/s",
        "4.80 TB/s",
        "60% of peak",
        "80% of peak",
        "no tensor parallelism",
        "InfiniBand",
    ):
        assert fact in said


def test_a_model_too_large_for_one_gpu_is_refused_and_a_config_file_is_read(tmp_path: Path) -> None:
    with pytest.raises(PdserveError, match="tensor parallelism is not modelled"):
        derive("h100", "llama-3.1-70b")
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(MODEL_SHAPES["llama-3.2-3b"]))
    profile = derive("l40s", str(folder))
    assert profile.model == "my-model"
    with pytest.raises(PdserveError, match="neither a built-in shape"):
        derive("h200", str(tmp_path / "nothing"))
    with pytest.raises(PdserveError, match="--hardware must be one of"):
        derive("tpu", "llama-3.1-8b")
