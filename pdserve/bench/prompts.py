"""Prompts of exact token counts, cut from real English text with the server's tokenizer. No torch.

The text is CPython's own documentation (`pydoc_data.topics`, shipped with every Python), so no
download is needed. Each request gets a window of the tokenized text starting at its own seeded
offset: prompts differ from their first token, so a server's prefix cache cannot make a
benchmark look faster than its traffic would be.

Two forms: token ids (exact by construction; `/v1/completions` accepts them, as vLLM's does) and
text (for chat, or servers that want text): the window is decoded and trimmed until it encodes
back to exactly the wanted count, which nearly always succeeds within a few tokens.
"""

from __future__ import annotations

import random
from typing import Protocol


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def corpus_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key] for key in sorted(topics))


class PromptBuilder:
    def __init__(self, tokenizer: Tokenizer, seed: int = 0, text: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.ids = tokenizer.encode(text or corpus_text(), add_special_tokens=False)
        if len(self.ids) < 1000:
            raise ValueError("the corpus is too short to cut prompts from")
        self._rng = random.Random(seed)

    def _window(self, n: int) -> list[int]:
        # The corpus read cyclically from a seeded offset. Slice only what is needed: copying the
        # whole tokenized corpus (~466k ids) per request made building 5000 prompts take ~24 s.
        start = self._rng.randrange(len(self.ids))
        window = self.ids[start : start + n]
        while len(window) < n:
            window += self.ids[: n - len(window)]
        return window

    def token_ids(self, n: int) -> list[int]:
        """Exactly `n` token ids (no special tokens: the server adds none to a list of ids)."""
        return self._window(n)

    def text(self, n: int) -> tuple[str, int]:
        """Text that encodes (with the tokenizer's special tokens) to `n` tokens, and its actual
        count, which differs from `n` only when no trim of the window hits it exactly."""
        special = len(self.tokenizer.encode("", add_special_tokens=True))
        window = self._window(max(1, n - special) + 8)
        best: tuple[str, int] = ("", 0)
        for cut in range(len(window), 0, -1):
            text = self.tokenizer.decode(window[:cut], skip_special_tokens=True)
            count = len(self.tokenizer.encode(text))
            if count == n:
                return text, count
            if count < n:
                return best if best[1] and abs(best[1] - n) < n - count else (text, count)
            best = (text, count)
        return best
