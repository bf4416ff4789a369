"""Test helper (not a test module): tiny GGUF files written as llama.cpp's converter writes them,
with the Hugging Face weights they encode, so reading them back can be checked exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np

from pdserve.modelfiles import gguf_file as gf


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, HF layout -> GGUF layout."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path: Path,
    arch: str = "llama",
    *,
    hidden: int = 16,
    heads: int = 2,
    kv_heads: int = 1,
    layers: int = 2,
    vocab: int = 11,
    tied: bool = True,
    meta: dict[str, Any] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write a GGUF as llama.cpp's converter would; return the HF weights it encodes."""
    rng = np.random.default_rng(0)
    head_dim, ff = hidden // heads, 2 * hidden
    hf: dict[str, np.ndarray] = {}

    def rand(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    hf["model.embed_tokens.weight"] = rand(vocab, hidden)
    hf["model.norm.weight"] = rand(hidden)
    if not tied:
        hf["lm_head.weight"] = rand(vocab, hidden)
    for i in range(layers):
        pre = f"model.layers.{i}."
        for name, shape in [
            ("self_attn.q_proj.weight", (heads * head_dim, hidden)),
            ("self_attn.k_proj.weight", (kv_heads * head_dim, hidden)),
            ("self_attn.v_proj.weight", (kv_heads * head_dim, hidden)),
            ("self_attn.o_proj.weight", (hidden, heads * head_dim)),
            ("mlp.gate_proj.weight", (ff, hidden)),
            ("mlp.up_proj.weight", (ff, hidden)),
            ("mlp.down_proj.weight", (hidden, ff)),
            ("input_layernorm.weight", (hidden,)),
            ("post_attention_layernorm.weight", (hidden,)),
        ]:
            hf[pre + name] = rand(*shape)
        if arch == "qwen2":
            for p, n in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
                hf[pre + f"self_attn.{p}_proj.bias"] = rand(n * head_dim)

    to_gguf = {v: k for k, v in gf._GLOBAL_NAMES.items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ff)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    for key, value in (meta or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, value)
    from_hf = {v: k for k, v in gf._LAYER_NAMES.items()}
    for name, w in hf.items():
        if name in to_gguf:
            gname = to_gguf[name]
        else:  # model.layers.{i}.{module}.{weight|bias}
            parts = name.split(".")
            gname = f"blk.{parts[2]}.{from_hf['.'.join(parts[3:-1])]}.{parts[-1]}"
        if arch == "llama" and ".q_proj." in name:
            w = llamacpp_permute(w, heads)
        elif arch == "llama" and ".k_proj." in name:
            w = llamacpp_permute(w, kv_heads)
        writer.add_tensor(gname, w)
    for gname, w in (extra_tensors or {}).items():
        writer.add_tensor(gname, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf
