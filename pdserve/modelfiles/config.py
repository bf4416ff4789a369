"""The model description the engine needs, read from a Hugging Face `config.json` dict.

GGUF files are first translated into the same dict (see `gguf_file.py`), so there is one
validation path for both formats. No torch here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pdserve.errors import UnsupportedModelError

# Hugging Face `architectures` / `model_type` values we implement, and what differs between them.
SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2"}
SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
SUPPORTED_ROPE_TYPES = {"default", "llama3", "linear"}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool  # q/k/v projections carry a bias (Qwen2)
    sliding_window: int | None  # attend to at most this many previous tokens (Mistral); None = full
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    raw: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = cfg.get("model_type")
        archs = cfg.get("architectures") or []
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {model_type!r} (architectures {archs}); "
                f"pdserve implements {sorted(SUPPORTED_MODEL_TYPES)}"
            )
        if archs and not set(archs) & SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"unsupported architectures {archs}; pdserve implements {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        try:
            hidden = int(cfg["hidden_size"])
            num_heads = int(cfg["num_attention_heads"])
            num_kv_heads = int(cfg.get("num_key_value_heads") or num_heads)
            head_dim = int(cfg.get("head_dim") or hidden // num_heads)
            rope_scaling = cfg.get("rope_scaling")
            rope_theta = float(cfg.get("rope_theta", 10000.0))
            # transformers >= 5 folds rope_theta into `rope_parameters`.
            rope_params = cfg.get("rope_parameters")
            if isinstance(rope_params, dict):
                rope_theta = float(rope_params.get("rope_theta", rope_theta))
                if rope_params.get("rope_type", "default") != "default":
                    rope_scaling = rope_params
            if rope_scaling is not None:
                rope_type = rope_scaling.get("rope_type") or rope_scaling.get("type") or "default"
                if rope_type not in SUPPORTED_ROPE_TYPES:
                    raise UnsupportedModelError(
                        f"unsupported rope_scaling type {rope_type!r}; supported: {sorted(SUPPORTED_ROPE_TYPES)}"
                    )
                rope_scaling = dict(rope_scaling, rope_type=rope_type)
                if rope_type == "default":
                    rope_scaling = None
            eos = cfg.get("eos_token_id")
            eos_ids = (
                tuple(int(e) for e in eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
            )
            num_layers = int(cfg["num_hidden_layers"])
            sliding = cfg.get("sliding_window") if model_type != "llama" else None  # HF Llama has none
            if model_type == "qwen2":
                sliding = _qwen2_sliding_window(cfg, sliding, num_layers)
            config = cls(
                model_type=str(model_type),
                vocab_size=int(cfg["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(cfg["intermediate_size"]),
                num_layers=num_layers,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
                rope_theta=rope_theta,
                rope_scaling=rope_scaling,
                tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
                attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
                sliding_window=int(sliding) if sliding else None,
                bos_token_id=cfg.get("bos_token_id"),
                eos_token_ids=eos_ids,
                raw=dict(cfg),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise UnsupportedModelError(f"config.json is missing or has a bad value for {exc}") from exc
        if config.num_heads % config.num_kv_heads:
            raise UnsupportedModelError(
                f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"unsupported hidden_act {cfg.get('hidden_act')!r}; only silu")
        return config


def _qwen2_sliding_window(cfg: dict[str, Any], window: Any, num_layers: int) -> Any:
    """The window every layer uses, as transformers runs Qwen2: none unless `use_sliding_window`,
    and then only on the layers from `max_window_layers` on (or as `layer_types` lists them)."""
    if not cfg.get("use_sliding_window", False) or not window:
        return None
    first = int(cfg.get("max_window_layers", 28))
    layer_types = cfg.get("layer_types") or ["sliding" if i >= first else "full" for i in range(num_layers)]
    num_sliding = sum("sliding" in str(kind) for kind in layer_types)
    if num_sliding == 0:
        return None
    if num_sliding < len(layer_types):
        raise UnsupportedModelError(
            "Qwen2 with a sliding window on some layers only (max_window_layers / layer_types) is not supported"
        )
    return window
