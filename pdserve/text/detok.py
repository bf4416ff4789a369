"""Incremental detokenization and stop strings. Pure Python over any tokenizer with `decode`.

Text is produced token by token without re-decoding the whole output each time: only a short
window of tokens (`prefix_offset` .. end) is decoded, the way vLLM and Hugging Face's streamers do
it, so that multi-byte characters split across tokens and SentencePiece's leading spaces come out
right. A character that is not complete yet (decodes to U+FFFD) is held back until it is.
"""

from __future__ import annotations

from typing import Protocol

# How many prompt tokens to decode as context for the first output tokens: SentencePiece drops a
# leading space when a token is decoded alone.
_PROMPT_CONTEXT_TOKENS = 5


class Decoder(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Decoder,
        prompt_token_ids: list[int],
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
        min_tokens: int = 0,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self._tokens: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.stop = list(stop or [])
        self._include_stop = include_stop_str_in_output
        # A stop string can straddle tokens: when streaming, the last `holdback` characters are not
        # released until we know they do not start a stop string.
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.stop_reason: str | None = None
        # As in vLLM: stop strings are looked for once more than min_tokens tokens are out.
        self._min_tokens = min_tokens
        self._num_tokens = 0

    def add_token(self, token_id: int) -> str | None:
        """Append one generated token. Returns the stop string it completed, if any."""
        if self.stop_reason is not None:
            return self.stop_reason
        self._tokens.append(token_id)
        self._num_tokens += 1
        prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._tokens[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return None  # an incomplete character, or a token that prints nothing (yet)
        delta = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        search_from = max(0, len(self.text) - self._holdback)
        self.text += delta
        if self._num_tokens <= self._min_tokens:
            return None
        return self._check_stop(search_from)

    def streamable_text(self, finished: bool) -> str:
        """The text that can be shown now: all of it once finished, else minus the held-back tail."""
        if finished or self.stop_reason is not None or not self._holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self._holdback)]

    def _check_stop(self, search_from: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.text.find(stop, search_from)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.text = self.text[: index + len(stop)] if self._include_stop else self.text[:index]
        self.stop_reason = stop
        return stop

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special)
