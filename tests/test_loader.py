"""Finding and loading models: what the user types resolves to the right source, and every broken
model folder fails with a ModelLoadError that says what is wrong (never a raw traceback from
safetensors, json or torch). Loads go through `pdserve.LLM`, the path users take."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from pdserve import LLM, SamplingParams
from pdserve.errors import ModelLoadError, UnsupportedModelError
from pdserve.modelfiles.gguf_file import find_builtin_gguf
from pdserve.models.loader import (
    generation_eos_ids,
    load_config,
    load_tokenizer,
    resolve_model,
)


@pytest.fixture
def model_copy(tiny_llama: Path, tmp_path: Path) -> Path:
    """A private copy of the tiny Llama folder that a test may break."""
    return Path(shutil.copytree(tiny_llama, tmp_path / "model"))


def edit_weights(folder: Path, edit) -> None:  # type: ignore[no-untyped-def]
    file = folder / "model.safetensors"
    tensors = load_file(file)
    edit(tensors)
    save_file(tensors, file, metadata={"format": "pt"})


def edit_config(folder: Path, **changes: object) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_resolve_the_builtin_name() -> None:
    source = resolve_model("smollm2-135m")
    assert source.kind == "gguf" and source.name == "smollm2-135m"
    assert source.path == find_builtin_gguf() and source.path.is_file()


@pytest.mark.slow
def test_the_builtin_model_config_and_tokenizer() -> None:
    source = resolve_model("smollm2-135m")
    config = load_config(source)
    assert config.model_type == "llama"
    assert (config.num_layers, config.hidden_size, config.num_heads, config.num_kv_heads) == (30, 576, 9, 3)
    tokenizer = load_tokenizer(source)
    assert tokenizer.chat_template and tokenizer.eos_token_id in generation_eos_ids(source, config, tokenizer)


def test_resolve_a_gguf_path() -> None:
    path = str(find_builtin_gguf())
    source = resolve_model(path)
    assert source.kind == "gguf" and source.path == Path(path) and source.name == path


def test_resolve_a_hugging_face_folder(tiny_llama: Path) -> None:
    source = resolve_model(str(tiny_llama))
    assert source.kind == "hf" and source.path == tiny_llama and source.name == str(tiny_llama)
    config = load_config(source)
    assert config.model_type == "llama" and config.num_layers == 3 and config.num_kv_heads == 2


def test_resolve_expands_the_home_folder(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tiny_llama.parent))
    assert resolve_model(f"~/{tiny_llama.name}").path == tiny_llama


def test_unknown_name_says_what_is_accepted() -> None:
    with pytest.raises(ModelLoadError, match=r"'llama-7b' not found.*smollm2-135m.*never downloaded"):
        resolve_model("llama-7b")


def test_missing_path(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model(str(tmp_path / "nowhere" / "model.gguf"))


def test_folder_without_config_json(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelLoadError, match=r"without config\.json"):
        resolve_model(str(tmp_path))


def test_a_file_that_is_not_gguf(tmp_path: Path) -> None:
    file = tmp_path / "model.bin"
    file.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError, match=r"not a \.gguf file"):
        resolve_model(str(file))


def test_a_gguf_named_file_that_is_not_gguf(tmp_path: Path) -> None:
    file = tmp_path / "fake.gguf"
    file.write_bytes(b"PK\x03\x04 not a gguf at all")
    assert resolve_model(str(file)).kind == "gguf"  # the name says gguf; loading finds out
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        LLM(str(file))


def test_corrupt_safetensors_file(model_copy: Path) -> None:
    (model_copy / "model.safetensors").write_bytes(b"\x13garbage bytes " * 500)
    with pytest.raises(ModelLoadError, match=r"cannot read .*model\.safetensors"):
        LLM(str(model_copy))


def test_truncated_safetensors_file(model_copy: Path) -> None:
    file = model_copy / "model.safetensors"
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"cannot read .*model\.safetensors"):
        LLM(str(model_copy))


def test_no_safetensors_files(model_copy: Path) -> None:
    (model_copy / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no \*\.safetensors"):
        LLM(str(model_copy))


@pytest.mark.parametrize(
    "tensor",
    [
        "model.layers.1.self_attn.k_proj.weight",  # one part of a fused projection
        "model.layers.2.mlp.up_proj.weight",
        "model.layers.0.self_attn.o_proj.weight",
        "model.norm.weight",
        "lm_head.weight",  # untied model
    ],
)
def test_missing_weight_is_named_as_in_the_checkpoint(model_copy: Path, tensor: str) -> None:
    edit_weights(model_copy, lambda t: t.pop(tensor))
    with pytest.raises(ModelLoadError, match=rf"missing weights: \['{tensor}'\]"):
        LLM(str(model_copy))


def test_weight_with_the_wrong_shape(model_copy: Path) -> None:
    def shrink(t: dict) -> None:  # type: ignore[type-arg]
        t["model.norm.weight"] = t["model.norm.weight"][:10].clone()

    edit_weights(model_copy, shrink)
    with pytest.raises(ModelLoadError, match=r"model\.norm\.weight has shape \(10,\), expected \(64,\)"):
        LLM(str(model_copy))


def test_unexpected_weight(model_copy: Path) -> None:
    def add_bias(t: dict) -> None:  # type: ignore[type-arg]
        t["model.layers.0.self_attn.o_proj.bias"] = t["model.norm.weight"].clone()

    edit_weights(model_copy, add_bias)
    with pytest.raises(ModelLoadError, match=r"does not expect: model\.layers\.0\.self_attn\.o_proj\.bias"):
        LLM(str(model_copy))


def test_unsupported_architecture_in_config_json(model_copy: Path) -> None:
    edit_config(model_copy, model_type="gpt_neox", architectures=["GPTNeoXForCausalLM"])
    with pytest.raises(UnsupportedModelError, match="gpt_neox"):
        LLM(str(model_copy))


def test_unparsable_config_json(model_copy: Path) -> None:
    (model_copy / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"cannot parse .*config\.json"):
        LLM(str(model_copy))
    (model_copy / "config.json").write_text("[1, 2]")
    with pytest.raises(ModelLoadError, match="JSON object"):
        LLM(str(model_copy))


def test_missing_tokenizer(model_copy: Path) -> None:
    for file in model_copy.iterdir():
        if file.name.startswith("tokenizer"):
            file.unlink()
    with pytest.raises(ModelLoadError, match="tokenizer"):
        LLM(str(model_copy))


def test_generation_config_eos_ids_are_merged(model_copy: Path) -> None:
    # Llama 3 Instruct style: config.json has one EOS, generation_config.json a list of them.
    tokenizer = load_tokenizer(resolve_model(str(model_copy)))
    eos = tokenizer.eos_token_id
    edit_config(model_copy, eos_token_id=[eos, 100])
    (model_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 7, 9]}))
    source = resolve_model(str(model_copy))
    assert generation_eos_ids(source, load_config(source), tokenizer) == tuple(sorted({eos, 7, 9, 100}))

    (model_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": 42}))
    assert generation_eos_ids(source, load_config(source), tokenizer) == tuple(sorted({eos, 42, 100}))

    (model_copy / "generation_config.json").unlink()
    edit_config(model_copy, eos_token_id=None)
    assert generation_eos_ids(source, load_config(source), tokenizer) == (eos,)  # the tokenizer's


def test_generation_config_eos_ends_generation(model_copy: Path) -> None:
    # A token listed only in generation_config.json stops generation like EOS.
    llm = LLM(str(model_copy), dtype="float32", num_kv_blocks=16)
    first = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))
    token = first[0].outputs[0].token_ids[0]
    (model_copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [token]}))
    llm = LLM(str(model_copy), dtype="float32", num_kv_blocks=16)
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0))[0]
    assert out.outputs[0].token_ids == [token] and out.outputs[0].finish_reason == "stop"
    assert out.outputs[0].text == ""  # EOS is not text
