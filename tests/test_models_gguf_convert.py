"""Tests of pdserve.models.gguf_convert: a GGUF file written out as a Hugging Face folder.

The slow test converts the real SmolLM2-135M-Instruct Q4_1 GGUF and generates with transformers
from the folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdserve.errors import ModelLoadError
from pdserve.modelfiles.gguf_file import find_builtin_gguf
from pdserve.models.gguf_convert import convert_gguf_to_hf


def test_convert_refuses_non_empty_dir(tmp_path: Path) -> None:
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="overwrite"):
        convert_gguf_to_hf(tmp_path / "any.gguf", tmp_path)
    assert (tmp_path / "keep.txt").read_text() == "mine"


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    try:
        smollm2 = find_builtin_gguf()
    except ModelLoadError as exc:
        pytest.skip(str(exc))
    return convert_gguf_to_hf(smollm2, tmp_path_factory.mktemp("smollm2-hf"))


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
