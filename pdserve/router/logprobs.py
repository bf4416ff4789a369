"""Logprobs in the two shapes of OpenAI's API. Pure Python.

Workers send, with each token, `(token id, its logprob, {id: logprob} of the k most likely)`, from
the model's raw distribution. Completions answer in the legacy shape (parallel lists `tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`; a top dict also holds the chosen token, so it may
have k+1 entries, as OpenAI's did); chat answers in the new one (`content`: one object per token
with its text, logprob, UTF-8 bytes and exactly the k most likely, best first).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve.errors import InvalidRequestError

WireLogprob = tuple[int, float, dict[int, float]]
MAX_TOP_LOGPROBS = 20  # as vLLM's default max_logprobs; each one is a top-k over the vocabulary


class TokenPieces(Protocol):
    def token_piece(self, token_id: int) -> tuple[str, bytes]: ...


def engine_logprobs(chat: bool, logprobs: bool | int | None, top_logprobs: int | None) -> int | None:
    """How many alternatives the engine must return per token (None: no logprobs at all), or a
    400 naming the field the request got wrong."""
    if not chat:
        if logprobs is None:
            return None
        if not 0 <= int(logprobs) <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {logprobs}", param="logprobs"
            )
        return int(logprobs)
    if top_logprobs is not None:
        if not logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs set to true", param="top_logprobs")
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequestError(
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}", param="top_logprobs"
            )
        return top_logprobs
    return 0 if logprobs else None


@dataclass
class TokenLogprobs:
    """The logprobs of some consecutive tokens of one answer, and where each token's text starts."""

    entries: list[WireLogprob] = field(default_factory=list)
    text_offsets: list[int] = field(default_factory=list)

    def add(self, entry: WireLogprob, text_offset: int) -> None:
        self.entries.append(entry)
        self.text_offsets.append(text_offset)

    def extend(self, other: TokenLogprobs) -> None:
        self.entries.extend(other.entries)
        self.text_offsets.extend(other.text_offsets)


class LogprobsFormatter:
    def __init__(self, tokenizer: TokenPieces, chat: bool) -> None:
        self._tokenizer = tokenizer
        self._chat = chat

    def render(self, logprobs: TokenLogprobs) -> dict[str, Any]:
        return self._chat_shape(logprobs) if self._chat else self._completion_shape(logprobs)

    def _chat_shape(self, logprobs: TokenLogprobs) -> dict[str, Any]:
        content = []
        for token_id, logprob, top in logprobs.entries:
            entry = self._chat_token(token_id, logprob)
            best = sorted(top.items(), key=lambda item: item[1], reverse=True)
            entry["top_logprobs"] = [self._chat_token(t, lp) for t, lp in best]
            content.append(entry)
        return {"content": content}

    def _chat_token(self, token_id: int, logprob: float) -> dict[str, Any]:
        text, raw = self._tokenizer.token_piece(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(raw)}

    def _completion_shape(self, logprobs: TokenLogprobs) -> dict[str, Any]:
        tokens, token_logprobs, tops = [], [], []
        for token_id, logprob, top in logprobs.entries:
            text = self._tokenizer.token_piece(token_id)[0]
            tokens.append(text)
            token_logprobs.append(logprob)
            best = sorted(top.items(), key=lambda item: item[1], reverse=True)
            alternatives: dict[str, float] = {}
            for alternative, alternative_logprob in best:
                # Tokens that read the same (parts of one character, say) share a key: the best stays.
                alternatives.setdefault(self._tokenizer.token_piece(alternative)[0], alternative_logprob)
            alternatives.setdefault(text, logprob)
            tops.append(alternatives)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": tops,
            "text_offset": list(logprobs.text_offsets),
        }
