"""Find a model by name or path and load its config, weights and tokenizer (torch).

Sources: a built-in name (`smollm2-135m`), a GGUF file, or a Hugging Face folder (config.json,
*.safetensors, tokenizer files, chat template). GGUF weights are dequantized at load.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from pdserve.errors import ModelLoadError
from pdserve.modelfiles.config import ModelConfig
from pdserve.modelfiles.source import BUILTIN_MODELS, ModelSource, generation_eos_ids, resolve_model

__all__ = ["BUILTIN_MODELS", "ModelSource", "generation_eos_ids", "resolve_model"]

logger = logging.getLogger(__name__)


def load_config(source: ModelSource) -> ModelConfig:
    return ModelConfig.from_hf_dict(source.hf_config)


def iter_weights(source: ModelSource) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) for every weight of the checkpoint."""
    if source.kind == "gguf":
        from pdserve.modelfiles.gguf_file import iter_gguf_tensors

        for name, array in iter_gguf_tensors(source.path):
            yield name, torch.from_numpy(array)
        return
    from safetensors import SafetensorError, safe_open

    files = sorted(source.path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{source.path} has no *.safetensors files (pytorch_model.bin is not supported)")
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, handle.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise ModelLoadError(f"cannot read {file}: {exc}") from exc


def load_tokenizer(source: ModelSource) -> Any:
    """A transformers fast tokenizer with the model's chat template."""
    if source.kind == "gguf":
        from pdserve.modelfiles.gguf_tokenizer import load_gguf_tokenizer

        return load_gguf_tokenizer(source.path)
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(source.path), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"cannot load the tokenizer from {source.path}: {exc}") from exc
