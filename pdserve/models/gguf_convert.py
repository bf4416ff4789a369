"""`pdserve convert`: a llama.cpp GGUF file written out as a Hugging Face model folder
(config.json, safetensors weights, generation_config.json, the tokenizer files) that
transformers and vLLM load. torch is imported only while the weights are written.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from pdserve.modelfiles.gguf_file import checked_config, iter_tensors, open_gguf
from pdserve.modelfiles.gguf_tokenizer import load_gguf_tokenizer

_DTYPES = ("float32", "bfloat16", "float16")
_DEFAULT_MAX_SHARD_BYTES = 4 << 30


def _write_weights(
    pairs: Iterator[tuple[str, np.ndarray]], out: Path, dtype: str, max_shard_bytes: int
) -> None:
    import torch
    from safetensors.torch import save_file

    torch_dtype = getattr(torch, dtype)
    shards: list[tuple[Path, list[str]]] = []
    batch: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal batch, size
        if batch:
            tmp = out / f"model-shard-{len(shards):05d}.tmp"
            save_file(batch, str(tmp), metadata={"format": "pt"})
            shards.append((tmp, list(batch)))
        batch, size = {}, 0

    for name, arr in pairs:
        t = torch.from_numpy(arr).to(torch_dtype).contiguous()
        nbytes = t.numel() * t.element_size()
        if batch and size + nbytes > max_shard_bytes:
            flush()
        batch[name] = t
        size += nbytes
    flush()
    if len(shards) == 1:
        shards[0][0].rename(out / "model.safetensors")
        return
    # Several shards: the names transformers and vLLM look for, plus the index.
    weight_map: dict[str, str] = {}
    for i, (tmp, names) in enumerate(shards, 1):
        final = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tmp.rename(out / final)
        weight_map.update(dict.fromkeys(names, final))
    total = sum((out / f).stat().st_size for f in set(weight_map.values()))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def convert_gguf_to_hf(
    path: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    *,
    dtype: str = "float32",
    overwrite: bool = False,
    max_shard_bytes: int = _DEFAULT_MAX_SHARD_BYTES,
) -> Path:
    """Write a GGUF model as a Hugging Face folder that transformers and vLLM load.

    The folder gets config.json, model.safetensors (sharded with an index above
    max_shard_bytes; no lm_head for tied embeddings), generation_config.json and the tokenizer
    files with the chat template. Raises FileExistsError for a non-empty out_dir unless
    overwrite, in which case earlier weight files there are removed (vLLM loads every
    *.safetensors in a folder, so a stale shard would be loaded too)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, not {dtype!r}")
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FileExistsError(f"{out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise FileExistsError(f"{out} is not empty; pass overwrite=True to replace its model files")

    reader = open_gguf(path)
    cfg = checked_config(reader, path)
    tokenizer = load_gguf_tokenizer(path)  # before the slow part, so a bad tokenizer fails fast

    out.mkdir(parents=True, exist_ok=True)
    for stale in [*out.glob("*.safetensors"), *out.glob("*.safetensors.index.json"), *out.glob("*.tmp")]:
        stale.unlink()
    _write_weights(iter_tensors(reader, cfg, path), out, dtype, max_shard_bytes)

    cfg["torch_dtype"] = dtype
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {k: cfg[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    tokenizer.save_pretrained(str(out))
    _make_tokenizer_config_portable(out / "tokenizer_config.json", tokenizer.chat_template, cfg)
    return out


def _make_tokenizer_config_portable(path: Path, chat_template: Any, cfg: dict[str, Any]) -> None:
    """Make the saved tokenizer_config.json load in transformers 4.x too (vLLM may run one).

    transformers 5 writes the class "TokenizersBackend", unknown to 4.x; "PreTrainedTokenizerFast"
    works in both. 5 saves the chat template only as chat_template.jinja, which older 4.x does not
    read, so it is inlined too (same text either way). Load-time flags echoed into the file
    (is_local, local_files_only) describe this process, not the model: dropped."""
    tok_cfg: dict[str, Any] = json.loads(path.read_text()) if path.is_file() else {}
    tok_cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    if isinstance(chat_template, str) and chat_template:
        tok_cfg["chat_template"] = chat_template
    for key in ("is_local", "local_files_only"):
        tok_cfg.pop(key, None)
    tok_cfg["model_max_length"] = cfg["max_position_embeddings"]
    path.write_text(json.dumps(tok_cfg, indent=2, ensure_ascii=False) + "\n")
