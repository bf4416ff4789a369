"""The tokenizer of a llama.cpp GGUF file, as a transformers fast tokenizer with its chat template.

transformers builds it from the file's token list and merges (slow: every token in Python), so it
is built once and cached on disk; the router reads the cached folder without transformers.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
from pathlib import Path
from typing import TYPE_CHECKING

from pdserve.errors import ModelLoadError
from pdserve.modelfiles.gguf_file import get_value, open_gguf

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast


def tokenizer_cache_dir(path: Path) -> Path | None:
    """Where the tokenizer built from GGUF file `path` is cached (None if there is no such file).

    Keyed by the file's path, size, modification time and the transformers version that built it.
    The folder holds tokenizer.json, tokenizer_config.json and chat_template.jinja, which the
    router reads without transformers (and so without torch)."""
    if not path.is_file():
        return None
    stat = path.stat()
    version = importlib.metadata.version("transformers")
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{version}"
    cache_root = Path(os.environ.get("PDSERVE_CACHE_DIR", Path.home() / ".cache" / "pdserve")) / "tokenizers"
    return cache_root / hashlib.sha256(key.encode()).hexdigest()[:24]


def load_gguf_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerFast:
    """The tokenizer stored in a GGUF file, with its chat template, built offline by transformers.

    Building it means parsing every token and merge of the file in Python (~15 s for SmolLM2), so
    the result is saved once under the cache folder ($PDSERVE_CACHE_DIR, default
    ~/.cache/pdserve) keyed by the file's path, size, modification time and the transformers
    version, and loaded from there afterwards (well under a second)."""
    import shutil
    import tempfile

    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    p = Path(path)
    cached = tokenizer_cache_dir(p)
    if cached is not None and (cached / "tokenizer.json").is_file():
        try:
            loaded = AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
            if isinstance(loaded, PreTrainedTokenizerFast) and loaded.chat_template:
                return loaded
        except Exception:  # a damaged cache entry: rebuilt below
            pass
        shutil.rmtree(cached, ignore_errors=True)
    tok = _build_gguf_tokenizer(p)
    if cached is not None:
        staging: Path | None = None
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(dir=cached.parent))
            tok.save_pretrained(str(staging))
            staging.rename(cached)  # atomic: a concurrent reader sees all of it or nothing
        except OSError:  # another process won the race, or no room: the cache is only a cache
            if staging is not None:
                shutil.rmtree(staging, ignore_errors=True)
    return tok


def _build_gguf_tokenizer(p: Path) -> PreTrainedTokenizerFast:
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if not p.is_file():
        open_gguf(p)  # raises the same ModelLoadError as the other entry points
    try:
        # A local folder plus local_files_only: transformers never asks the Hub. Resolved first,
        # so a symlink's target name is the one looked up in the target's folder.
        real = p.resolve()
        tok = AutoTokenizer.from_pretrained(str(real.parent), gguf_file=real.name, local_files_only=True)
    except Exception as exc:
        open_gguf(p)  # a damaged file gets the clearer message
        raise ModelLoadError(f"transformers could not build the tokenizer of {p}: {exc}") from exc
    if not isinstance(tok, PreTrainedTokenizerFast):
        raise ModelLoadError(f"expected a fast tokenizer from {p}, got {type(tok).__name__}")
    if not tok.chat_template:
        # transformers copies tokenizer.chat_template today; older versions did not.
        template = get_value(open_gguf(p), "tokenizer.chat_template")
        if template:
            tok.chat_template = template
    return tok
