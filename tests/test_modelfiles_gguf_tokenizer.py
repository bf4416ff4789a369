"""Tests of pdserve.modelfiles.gguf_tokenizer: a missing or damaged GGUF file is a clear error.

The real tokenizer is checked against transformers by test_models_gguf_convert (the converted
folder's tokenizer files are load_gguf_tokenizer's output), test_router_tokenizer and test_detok."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_gguf import write_tiny_gguf

from pdserve.errors import ModelLoadError
from pdserve.modelfiles.gguf_tokenizer import load_gguf_tokenizer


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_gguf_tokenizer(tmp_path / "nope.gguf")


def test_truncated_tiny_file(tmp_path: Path) -> None:
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path)
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 100])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_gguf_tokenizer(tmp_path / "cut.gguf")
