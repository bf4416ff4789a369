"""The router's tokenizer: Hugging Face `tokenizers` plus the model's Jinja chat template. No torch.

transformers' AutoTokenizer imports torch, which the router must never load, so the router reads
the same files itself: tokenizer.json (encoding and decoding, done by the `tokenizers` library),
tokenizer_config.json (special tokens, the chat template) and chat_template.jinja. The template is
rendered the way transformers renders it (sandboxed Jinja, trim_blocks, lstrip_blocks,
loopcontrols, `raise_exception`, `strftime_now`, a `tojson` without ASCII escaping), so a prompt
tokenizes here to exactly the ids the offline engine would see (a test checks).

A GGUF model's tokenizer is built once by transformers (in a child process, so torch stays out of
this one) and cached; see `pdserve.modelfiles.gguf_tokenizer.tokenizer_cache_dir`.
"""

from __future__ import annotations

import functools
import json
import subprocess
import sys
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.sandbox
from tokenizers import Tokenizer

from pdserve.errors import InvalidRequestError, ModelLoadError
from pdserve.modelfiles.source import ModelSource, resolve_model

# Building a GGUF tokenizer parses every token and merge in Python: ~15 s for SmolLM2, once.
TOKENIZER_BUILD_TIMEOUT_S = 600.0


class RouterTokenizer:
    def __init__(self, folder: Path) -> None:
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(f"{folder} has no tokenizer.json (the router needs a fast tokenizer)")
        try:
            self._tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the library raises a bare Exception for a bad file
            raise ModelLoadError(f"cannot read {tokenizer_file}: {exc}") from exc
        config = _read_optional_json(folder / "tokenizer_config.json")
        self.special_tokens = {
            name: _token_text(config.get(name))
            for name in ("bos_token", "eos_token", "pad_token", "unk_token")
            if _token_text(config.get(name)) is not None
        }
        self.eos_token_id = self._token_id(self.special_tokens.get("eos_token"))
        self.bos_token_id = self._token_id(self.special_tokens.get("bos_token"))
        # Older tokenizer.json files leave BOS to the Python tokenizer class (add_bos_token).
        self._prepend_bos = bool(config.get("add_bos_token")) and self.bos_token_id is not None
        if self._prepend_bos and self._tokenizer.encode("", add_special_tokens=True).ids[:1] == [
            self.bos_token_id
        ]:
            self._prepend_bos = False  # the post-processor already adds it
        self.chat_template = _chat_template(folder, config)
        self._template: jinja2.Template | None = None
        self._pieces: dict[int, tuple[str, bytes]] = {}  # token_piece's answers: a vocabulary's worth at most

    # -- encoding and decoding ------------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL while it works (encode holds it): a long text tokenized on
        # another thread then leaves the event loop free.
        ids: list[int] = self._tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self._prepend_bos and ids[:1] != [self.bos_token_id]:
            assert self.bos_token_id is not None
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        text: str = self._tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return text

    def token_piece(self, token_id: int) -> tuple[str, bytes]:
        """One token's text (as it decodes alone) and its exact bytes, for logprobs. A token
        holding part of a UTF-8 character decodes to U+FFFD; its bytes are still the real ones."""
        piece = self._pieces.get(token_id)
        if piece is None:
            text = self.decode([token_id], skip_special_tokens=False)
            spelled = self._tokenizer.id_to_token(token_id) or ""
            if spelled.startswith("\u2581") and text == spelled.replace("\u2581", " ").lstrip(" "):
                # SentencePiece: decoded alone, a token loses the space its ▁ stands for.
                text = spelled.replace("\u2581", " ")
            raw = _token_bytes(spelled, self._byte_level) if "\ufffd" in text else None
            piece = (text, raw if raw is not None else text.encode("utf-8"))
            self._pieces[token_id] = piece
        return piece

    @functools.cached_property
    def _byte_level(self) -> bool:
        """Whether the decoder is byte-level BPE's, alone or inside a Sequence."""
        decoder = json.loads(self._tokenizer.to_str()).get("decoder") or {}
        pending = [decoder]
        while pending:
            part = pending.pop()
            if part.get("type") == "ByteLevel":
                return True
            pending.extend(p for p in part.get("decoders", []) if isinstance(p, dict))
        return False

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters in the longest token (as the vocabulary spells it, which is never shorter
        than its text): a text of N characters has at least N / this many tokens."""
        return max(1, max(len(t) for t in self._tokenizer.get_vocab(with_added_tokens=True)))

    @property
    def vocab_size(self) -> int:
        size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)
        return size

    # -- chat -------------------------------------------------------------------------------------------
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        if self.chat_template is None:
            raise InvalidRequestError(
                "this model has no chat template: use /v1/completions with a plain prompt instead"
            )
        if self._template is None:
            self._template = _jinja_environment().from_string(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=None,
                documents=None,
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            # The template itself rejects the conversation (raise_exception), e.g. roles that do
            # not alternate: that is the request's fault, so it is a 400 with the template's words.
            raise InvalidRequestError(f"the chat template rejected these messages: {exc}") from exc

    def _token_id(self, text: str | None) -> int | None:
        if text is None:
            return None
        token_id = self._tokenizer.token_to_id(text)
        return int(token_id) if token_id is not None else None


def load_router_tokenizer(model: str | ModelSource) -> RouterTokenizer:
    """The tokenizer of a model name or path, without importing torch in this process."""
    source = resolve_model(model) if isinstance(model, str) else model
    return RouterTokenizer(tokenizer_folder(source))


def tokenizer_folder(source: ModelSource) -> Path:
    if source.kind == "hf":
        return source.path
    from pdserve.modelfiles.gguf_tokenizer import tokenizer_cache_dir

    folder = tokenizer_cache_dir(source.path)
    if folder is None:
        raise ModelLoadError(f"GGUF file not found: {source.path}")
    if not (folder / "tokenizer.json").is_file():
        _build_gguf_tokenizer_in_child(source.path)
    if not (folder / "tokenizer.json").is_file():
        raise ModelLoadError(f"building the tokenizer of {source.path} left nothing in {folder}")
    return folder


def _build_gguf_tokenizer_in_child(path: Path) -> None:
    code = "import sys; from pdserve.modelfiles.gguf_tokenizer import load_gguf_tokenizer; load_gguf_tokenizer(sys.argv[1])"
    try:
        done = subprocess.run(
            [sys.executable, "-c", code, str(path)],
            capture_output=True,
            text=True,
            timeout=TOKENIZER_BUILD_TIMEOUT_S,
        )
    except subprocess.TimeoutExpired as exc:
        raise ModelLoadError(
            f"building the tokenizer of {path} took over {TOKENIZER_BUILD_TIMEOUT_S:.0f} s"
        ) from exc
    if done.returncode != 0:
        raise ModelLoadError(f"cannot build the tokenizer of {path}: {done.stderr.strip()[-2000:]}")


def _jinja_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    def raise_exception(message: str) -> None:
        raise jinja2.TemplateError(message)

    def tojson(
        value: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        return json.dumps(
            value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _chat_template(folder: Path, config: dict[str, Any]) -> str | None:
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the default one is for chat
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None:
        legacy = folder / "chat_template.json"  # transformers 4.4x wrote it here
        template = _read_optional_json(legacy).get("chat_template") if legacy.is_file() else None
    return template if isinstance(template, str) else None


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", "lstrip": false, ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE spells each byte as one printable character: that map, inverted."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    spelled = {b: b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in spelled:
            spelled[b] = 256 + shifted
            shifted += 1
    return {chr(c): b for b, c in spelled.items()}


def _token_bytes(spelled: str, byte_level: bool) -> bytes | None:
    """The bytes behind a token as the vocabulary spells it, where the spelling says them:
    byte-level BPE, or SentencePiece's byte fallback `<0xNN>`."""
    if byte_level:
        alphabet = _byte_level_alphabet()
        if all(c in alphabet for c in spelled):
            return bytes(alphabet[c] for c in spelled)
        return None
    if len(spelled) == 6 and spelled.startswith("<0x") and spelled.endswith(">"):
        try:
            return bytes([int(spelled[3:5], 16)])
        except ValueError:
            return None
    return None


def _read_optional_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot parse {path}: {exc}") from exc
    return data if isinstance(data, dict) else {}
