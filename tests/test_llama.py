"""Our Llama-family model against Hugging Face transformers on the tiny random models: the
log-probabilities the engine reports while generating equal those of transformers' full forward
pass over the same tokens (fp32), RoPE tables match transformers' (llama3 and linear scaling), and
a bfloat16 run agrees with fp32 on the greedy choices."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import load_hf_reference, make_tiny_model

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig
from pdserve.engine.factory import build_engine
from pdserve.modelfiles.config import ModelConfig
from pdserve.models.llama import rope_inv_freq

# fp32 on both sides: differences come from summation order only (fused projections, paged
# attention), far below this.
LOGPROB_TOLERANCE = 1e-4
NUM_TOKENS = 12
TOP = 5


def prompt_ids(length: int = 21, seed: int = 3) -> list[int]:
    return torch.randint(3, 250, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine_logprobs(path: Path, prompt: list[int], **options: Any) -> tuple[list[Any], bool]:
    """Greedy generation through the engine core: each step's TokenLogprob, and whether the engine
    stored the model's matrices in bf16 (the per-machine plan's choice on a CPU without native bf16)."""
    engine, _ = build_engine(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=64, **options))
    engine.add_request(
        "r", prompt, SamplingParams(max_tokens=NUM_TOKENS, temperature=0, logprobs=TOP, ignore_eos=True)
    )
    logprobs = []
    for _ in range(100):
        for out in engine.step():
            assert out.new_logprobs is not None
            logprobs.extend(out.new_logprobs)
        if not engine.has_unfinished:
            break
    assert len(logprobs) == NUM_TOKENS
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    return logprobs, engine.runner.model.weights_in_bf16


def hf_log_softmax(
    path: Path, token_ids: list[int], weights_in_bf16: bool = False
) -> torch.Tensor:  # [len(token_ids), vocab]
    model = load_hf_reference(path, weights_in_bf16)
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def assert_matches_transformers(path: Path, prompt: list[int], **options: Any) -> None:
    ours, weights_in_bf16 = engine_logprobs(path, prompt, **options)
    generated = [lp.token_id for lp in ours]
    reference = hf_log_softmax(path, prompt + generated, weights_in_bf16)
    worst = 0.0
    for i, lp in enumerate(ours):
        ref = reference[len(prompt) - 1 + i]  # the position that predicts generated[i]
        assert lp.token_id == int(ref.argmax()), f"greedy token {i} differs from transformers"
        values, ids = ref.topk(TOP)
        assert list(lp.top) == ids.tolist()
        worst = max(worst, abs(lp.logprob - float(ref[lp.token_id])))
        worst = max(worst, max(abs(a - b) for a, b in zip(lp.top.values(), values.tolist(), strict=True)))
    assert worst < LOGPROB_TOLERANCE, f"max |logprob difference| {worst:.2e}"


@pytest.mark.parametrize("name", ["llama-gqa-untied", "llama-gqa-tied", "qwen2-bias", "llama3-rope"])
def test_logprobs_equal_transformers_fp32(tiny_models: dict[str, Path], name: str) -> None:
    # Block size 4 and chunk size 8: the prompt spans several blocks and prefill chunks, and the
    # decode steps read it back from the paged cache.
    assert_matches_transformers(tiny_models[name], prompt_ids(), block_size=4, chunk_size=8)


@pytest.fixture(scope="module")
def sliding_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("sliding")
    window = {"use_sliding_window": True, "sliding_window": 5, "tie_word_embeddings": False}
    return {
        # transformers slides the layers from max_window_layers on: all of them here ...
        "all-layers": make_tiny_model(root / "all", "qwen2", {**window, "max_window_layers": 0}, seed=1),
        # ... and none of them here: the window must not be applied.
        "no-layer": make_tiny_model(root / "none", "qwen2", {**window, "max_window_layers": 3}, seed=1),
    }


@pytest.mark.parametrize("which", ["all-layers", "no-layer"])
def test_qwen2_sliding_window_equals_transformers(sliding_models: dict[str, Path], which: str) -> None:
    # A prompt of 21 tokens and 12 generated ones, four times the window of 5.
    assert_matches_transformers(sliding_models[which], prompt_ids(), block_size=4, chunk_size=8)


def rope_config(
    scaling: dict[str, Any] | None, theta: float = 500000.0, head_dim: int = 128
) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "vocab_size": 100,
        "hidden_size": head_dim * 4,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "rope_theta": theta,
        "rope_scaling": scaling,
        "max_position_embeddings": 131072,
    }


LLAMA31_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


@pytest.mark.parametrize(
    "scaling,theta,head_dim",
    [
        (LLAMA31_SCALING, 500000.0, 128),  # Llama 3.1 8B
        ({**LLAMA31_SCALING, "factor": 32.0}, 500000.0, 64),  # Llama 3.2 1B
        ({**LLAMA31_SCALING, "original_max_position_embeddings": 64}, 10000.0, 16),  # the tiny model
        ({"rope_type": "linear", "factor": 4.0}, 10000.0, 128),
    ],
)
def test_rope_inv_freq_equals_transformers(scaling: dict[str, Any], theta: float, head_dim: int) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = rope_config(scaling, theta, head_dim)
    ours = rope_inv_freq(ModelConfig.from_hf_dict(cfg))
    hf_inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](LlamaConfig(**cfg), "cpu")
    assert attention_factor == 1.0  # no scaling of attention we would have to copy
    assert ours.dtype == torch.float32 and ours.shape == (head_dim // 2,)
    torch.testing.assert_close(ours, hf_inv_freq.float(), rtol=1e-6, atol=0)


def test_rope_inv_freq_without_scaling_equals_transformers() -> None:
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = rope_config(None, theta=10000.0, head_dim=64)
    hf_inv_freq, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(LlamaConfig(**cfg))
    torch.testing.assert_close(rope_inv_freq(ModelConfig.from_hf_dict(cfg)), hf_inv_freq.float())


def test_bfloat16_agrees_with_float32_on_greedy_tokens(tiny_llama: Path) -> None:
    # Teacher forcing: both dtypes predict the next token after the same prefixes (fp32's own
    # greedy continuation), so one early disagreement does not cascade. bf16 keeps ~3 significant
    # digits: near-ties may flip, most choices must not.
    prompt = prompt_ids(9, seed=5)
    fp32 = LLM(str(tiny_llama), dtype="float32", num_kv_blocks=32)
    continuation = fp32.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    tokens = continuation[0].outputs[0].token_ids
    prefixes = [prompt + tokens[:i] for i in range(len(tokens))]
    one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=0)
    bf16 = LLM(str(tiny_llama), dtype="bfloat16", num_kv_blocks=32)
    assert bf16.engine.runner.dtype == torch.bfloat16
    bf16_out = bf16.generate(prefixes, one)
    bf16_tokens = [o.outputs[0].token_ids[0] for o in bf16_out]
    agree = sum(a == b for a, b in zip(bf16_tokens, tokens, strict=True))
    assert agree >= 8, f"bf16 picked {bf16_tokens}, fp32 {tokens}"
    # And the probabilities stay close: within 0.1 in log space for the tokens both picked.
    fp32_out = fp32.generate(prefixes, one)
    for a, b in zip(bf16_out, fp32_out, strict=True):
        lp_a, lp_b = a.outputs[0].logprobs[0], b.outputs[0].logprobs[0]  # type: ignore[index]
        if lp_a.token_id == lp_b.token_id:
            assert abs(lp_a.logprob - lp_b.logprob) < 0.1
