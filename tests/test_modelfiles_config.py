"""ModelConfig.from_hf_dict: real-world config.json shapes (Llama, Mistral, Qwen2, transformers 4
and 5 styles) parse to what Hugging Face would run, and anything we do not implement is refused
with a clear UnsupportedModelError instead of silently giving wrong outputs. Pure Python."""

from __future__ import annotations

import math
from typing import Any

import pytest

from pdserve.errors import ModelLoadError, UnsupportedModelError
from pdserve.modelfiles.config import ModelConfig


def llama(**overrides: Any) -> dict[str, Any]:
    """A Llama-3.2-1B-like config.json (transformers 4 style)."""
    cfg: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 128256,
        "hidden_size": 2048,
        "intermediate_size": 8192,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "hidden_act": "silu",
        "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
        "tie_word_embeddings": True,
        "attention_bias": False,
        "bos_token_id": 128000,
        "eos_token_id": [128001, 128008, 128009],
    }
    cfg.update(overrides)
    return cfg


def mistral(**overrides: Any) -> dict[str, Any]:
    """A Mistral-7B-v0.1-like config.json: no head_dim, a sliding window, an int eos."""
    cfg: dict[str, Any] = {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "vocab_size": 32000,
        "hidden_size": 4096,
        "intermediate_size": 14336,
        "num_hidden_layers": 32,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "sliding_window": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    cfg.update(overrides)
    return cfg


def qwen2(**overrides: Any) -> dict[str, Any]:
    """A Qwen2.5-0.5B-Instruct-like config.json: no attention_bias key (Qwen2 always has q/k/v
    bias), a sliding_window that is not used."""
    cfg: dict[str, Any] = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "vocab_size": 151936,
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 32768,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        "sliding_window": 32768,
        "use_sliding_window": False,
        "max_window_layers": 21,
        "tie_word_embeddings": True,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
    }
    cfg.update(overrides)
    return cfg


def test_llama3_config() -> None:
    c = ModelConfig.from_hf_dict(llama())
    assert (c.model_type, c.vocab_size, c.hidden_size, c.intermediate_size) == ("llama", 128256, 2048, 8192)
    assert (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim) == (16, 32, 8, 64)
    assert c.num_queries_per_kv == 4
    assert c.rope_theta == 500000.0 and c.rms_norm_eps == 1e-5
    assert c.rope_scaling is not None and c.rope_scaling["rope_type"] == "llama3"
    assert c.rope_scaling["factor"] == 32.0
    assert c.tie_word_embeddings and not c.attention_bias and c.sliding_window is None
    assert c.bos_token_id == 128000 and c.eos_token_ids == (128001, 128008, 128009)
    assert c.max_position_embeddings == 131072


def test_mistral_config_keeps_its_sliding_window_and_defaults_head_dim() -> None:
    c = ModelConfig.from_hf_dict(mistral())
    assert c.model_type == "mistral" and c.sliding_window == 4096
    assert c.head_dim == 4096 // 32  # no head_dim key: hidden_size / heads
    assert c.eos_token_ids == (2,) and not c.tie_word_embeddings and not c.attention_bias
    assert c.rope_scaling is None
    assert ModelConfig.from_hf_dict(mistral(sliding_window=None)).sliding_window is None
    assert ModelConfig.from_hf_dict(mistral(head_dim=None)).head_dim == 128  # explicit null: default


def test_qwen2_config_has_qkv_bias_and_ignores_an_unused_sliding_window() -> None:
    c = ModelConfig.from_hf_dict(qwen2())
    assert c.attention_bias  # Qwen2 configs carry no attention_bias key; the bias is always there
    assert c.sliding_window is None  # use_sliding_window is false
    assert c.num_queries_per_kv == 7 and c.head_dim == 64 and c.tie_word_embeddings
    assert c.eos_token_ids == (151645,)
    # Without the flag at all (older configs) the window is unused too.
    assert ModelConfig.from_hf_dict(qwen2(use_sliding_window=None)).sliding_window is None
    assert not ModelConfig.from_hf_dict(qwen2(attention_bias=False)).attention_bias


def test_qwen2_sliding_window_follows_max_window_layers_like_transformers() -> None:
    # transformers slides only the layers >= max_window_layers: all of them with 0 ...
    c = ModelConfig.from_hf_dict(qwen2(use_sliding_window=True, sliding_window=4096, max_window_layers=0))
    assert c.sliding_window == 4096
    # ... none when max_window_layers covers every layer (then the window changes nothing) ...
    c = ModelConfig.from_hf_dict(qwen2(use_sliding_window=True, sliding_window=4096, max_window_layers=24))
    assert c.sliding_window is None
    # ... and some layers only otherwise, which one window for every layer cannot express.
    with pytest.raises(UnsupportedModelError, match="sliding"):
        ModelConfig.from_hf_dict(qwen2(use_sliding_window=True, sliding_window=4096, max_window_layers=21))
    # transformers 5 writes the per-layer choice out as layer_types.
    mixed = ["full_attention"] * 20 + ["sliding_attention"] * 4
    with pytest.raises(UnsupportedModelError, match="sliding"):
        ModelConfig.from_hf_dict(qwen2(use_sliding_window=True, sliding_window=4096, layer_types=mixed))
    all_sliding = ["sliding_attention"] * 24
    c = ModelConfig.from_hf_dict(qwen2(use_sliding_window=True, sliding_window=4096, layer_types=all_sliding))
    assert c.sliding_window == 4096


def test_llama_ignores_a_sliding_window_key() -> None:
    # Hugging Face's Llama has no sliding window whatever the config says.
    assert ModelConfig.from_hf_dict(llama(sliding_window=128)).sliding_window is None


def test_defaults_for_optional_keys() -> None:
    cfg = mistral()
    for key in ("num_key_value_heads", "max_position_embeddings", "rms_norm_eps", "rope_theta"):
        del cfg[key]
    del cfg["tie_word_embeddings"], cfg["eos_token_id"], cfg["architectures"], cfg["hidden_act"]
    c = ModelConfig.from_hf_dict(cfg)
    assert c.num_kv_heads == c.num_heads == 32  # no GQA unless said
    assert c.rope_theta == 10000.0 and c.max_position_embeddings == 2048 and c.rms_norm_eps == 1e-6
    assert not c.tie_word_embeddings and c.eos_token_ids == ()


def test_transformers5_rope_parameters() -> None:
    # transformers >= 5 writes rope_theta (and any scaling) into `rope_parameters`.
    cfg = llama()
    del cfg["rope_theta"], cfg["rope_scaling"]
    cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": 250000.0}
    c = ModelConfig.from_hf_dict(cfg)
    assert c.rope_theta == 250000.0 and c.rope_scaling is None

    cfg["rope_parameters"] = {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    c = ModelConfig.from_hf_dict(cfg)
    assert c.rope_theta == 500000.0
    assert c.rope_scaling is not None and c.rope_scaling["rope_type"] == "llama3"
    assert c.rope_scaling["factor"] == 8.0 and c.rope_scaling["original_max_position_embeddings"] == 8192


def test_old_style_rope_scaling_type_key_and_default_type() -> None:
    c = ModelConfig.from_hf_dict(llama(rope_scaling={"type": "linear", "factor": 4.0}))
    assert c.rope_scaling == {"type": "linear", "factor": 4.0, "rope_type": "linear"}
    assert ModelConfig.from_hf_dict(llama(rope_scaling={"rope_type": "default"})).rope_scaling is None
    assert ModelConfig.from_hf_dict(llama(rope_scaling=None)).rope_scaling is None


def test_config_from_a_real_transformers_object_parses() -> None:
    # What `save_pretrained` writes with the installed transformers, whatever its version.
    from transformers import LlamaConfig, MistralConfig, Qwen2Config

    small: dict[str, Any] = dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, rope_theta=123.0
    )
    for hf_config, attention_bias in (
        (LlamaConfig(num_key_value_heads=2, **small), False),
        (MistralConfig(num_key_value_heads=2, **small), False),
        (Qwen2Config(num_key_value_heads=2, **small), True),
    ):
        c = ModelConfig.from_hf_dict(hf_config.to_dict())
        assert (c.num_heads, c.num_kv_heads, c.head_dim) == (4, 2, 16)
        assert c.attention_bias is attention_bias
        assert math.isclose(c.rope_theta, 123.0) and c.rope_scaling is None


@pytest.mark.parametrize(
    "cfg,message",
    [
        (llama(model_type="gpt2", architectures=["GPT2LMHeadModel"]), "model_type 'gpt2'"),
        (llama(model_type=None), "model_type"),
        (llama(architectures=["LlamaForSequenceClassification"]), "architectures"),
        (llama(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "yarn"),
        (llama(rope_scaling={"type": "dynamic", "factor": 2.0}), "dynamic"),
        (llama(rope_scaling=None, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "yarn"),
        (llama(hidden_act="gelu"), "hidden_act 'gelu'"),
        (llama(num_attention_heads=32, num_key_value_heads=6), "not a multiple"),
        (qwen2(num_attention_heads=14, num_key_value_heads=4), "not a multiple"),
    ],
)
def test_unsupported_models_are_refused_clearly(cfg: dict[str, Any], message: str) -> None:
    with pytest.raises(UnsupportedModelError, match=message):
        ModelConfig.from_hf_dict(cfg)


@pytest.mark.parametrize(
    "key", ["hidden_size", "num_attention_heads", "vocab_size", "intermediate_size", "num_hidden_layers"]
)
def test_a_missing_required_key_is_named(key: str) -> None:
    cfg = llama()
    del cfg[key]
    with pytest.raises(UnsupportedModelError, match=key):
        ModelConfig.from_hf_dict(cfg)


def test_a_bad_value_is_a_model_load_error() -> None:
    with pytest.raises(ModelLoadError):
        ModelConfig.from_hf_dict(llama(hidden_size="big"))
    with pytest.raises(ModelLoadError):
        ModelConfig.from_hf_dict(llama(eos_token_id=["</s>"]))
