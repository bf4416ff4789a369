"""Sampling parameters, shaped like vLLM's so its users feel at home. Pure Python."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from pdserve.errors import InvalidRequestError

# Below this a temperature is treated as greedy: dividing logits by ~0 only amplifies noise.
GREEDY_TEMPERATURE = 1e-5
MAX_LOGIT_BIAS = 1024  # entries: each one is a write into the step's logits


@dataclass
class SamplingParams:
    """How to pick the tokens of one request.

    temperature 0 means greedy. `seed` makes a sampled request reproducible whatever else runs in
    the same batch. `stop` strings are matched on the detokenized text and are not included in
    the output; `stop_token_ids` end the request after that token (also not included in text).
    `logprobs=k` returns the log-probability of each chosen token and of the k most likely ones
    (k=0: the chosen token only), from the model's raw distribution, before penalties and
    temperature. `min_tokens` holds EOS, `stop_token_ids` and stop strings off until that many
    tokens have been generated (as in vLLM). `logit_bias` ({token id: bias in [-100, 100]}, as in OpenAI's API) is added to
    the logits before penalties and sampling: -100 bans a token, +100 all but forces it.
    """

    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: list[str] = field(default_factory=list)  # None or a single string are accepted too
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # As in vLLM and OpenAI's API: None means none, and one string means a list of one.
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        self.validate()

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def validate(self) -> None:
        def bad(msg: str) -> InvalidRequestError:
            return InvalidRequestError(msg)

        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if (
            not isinstance(self.min_tokens, int)
            or isinstance(self.min_tokens, bool)
            or not 0 <= self.min_tokens <= self.max_tokens
        ):
            raise bad(
                f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}"
            )
        if not _is_number(self.temperature) or self.temperature < 0:
            raise bad(f"temperature must be a number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise bad(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < -1:
            raise bad(f"top_k must be an integer >= 1, or 0 / -1 to disable, got {self.top_k!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise bad(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise bad(f"seed must be an integer, got {self.seed!r}")
        if not _is_number(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -2.0 <= value <= 2.0:
                raise bad(f"{name} must be in [-2, 2], got {value!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            raise bad(f"stop must be a non-empty string or a list of non-empty strings, got {self.stop!r}")
        if not isinstance(self.stop_token_ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise bad(f"stop_token_ids must be a list of token ids >= 0, got {self.stop_token_ids!r}")
        if (
            not isinstance(self.logit_bias, dict)
            or len(self.logit_bias) > MAX_LOGIT_BIAS
            or not all(
                isinstance(t, int)
                and not isinstance(t, bool)
                and t >= 0
                and _is_number(b)
                and -100 <= b <= 100
                for t, b in self.logit_bias.items()
            )
        ):
            raise bad(
                f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids >= 0 to biases in [-100, 100], "
                f"got {self.logit_bias!r}"[:300]
            )
        if self.logprobs is not None and (
            not isinstance(self.logprobs, int)
            or isinstance(self.logprobs, bool)
            or not 0 <= self.logprobs <= 20
        ):
            raise bad(f"logprobs must be an integer in [0, 20], got {self.logprobs!r}")

    @property
    def effective_top_k(self) -> int:
        return 0 if self.top_k in (0, -1) else self.top_k


def _is_number(value: object) -> bool:
    # Not NaN, not an infinity: either would poison every logit it touches.
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
