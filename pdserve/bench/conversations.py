"""Multi-turn conversations in a workload: each turn resends the whole conversation. No torch.

A class with `turns=DIST followup=DIST think=DIST` is a class of conversations: its arrival
process starts conversations; each has `turns` turns. The first turn's prompt is `prompt=` tokens
long; every later turn's prompt is the conversation so far (every earlier prompt and answer) and
`followup=` new tokens; every answer is `output=` tokens long. A turn is sent `think=` milliseconds
after the answer before it ended (a person reading and typing), so a conversation's turns depend on
the server's speed, as real ones do: only the first turn has a planned send time.

How the conversation so far is sent: with `--endpoint chat`, as the messages a chat client keeps
(user, assistant, user, ...: the server's chat template renders them again); with completions and
text prompts, as the text so far; with completions and token ids, as the ids so far, the answers
re-encoded from their text by the tokenizer (the ids a client can know; the model's own ids can
differ where the text has several encodings, as a real client's would).

A turn whose predecessor failed is never sent (nor recorded): the conversation ends there. Turns
are drawn in the workload like any request (`RequestSpec.session`, `.turn`, `.think_s`), so a
seed gives the same conversations; `max_requests` counts turns, whole conversations first.
`pdserve sim` sends the same turns with the exact ids streamed as the answers (sim/front.py).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pdserve.bench.distributions import LengthDist, Rng, require


@dataclass(frozen=True)
class Session:
    """How a class's conversations go on after their first turn."""

    turns: LengthDist  # turns per conversation (>= 1)
    followup: LengthDist  # new prompt tokens of each turn after the first
    think_ms: LengthDist  # milliseconds between an answer's end and the next turn

    def describe(self) -> str:
        return (
            f"turns={self.turns.describe()} followup={self.followup.describe()} "
            f"think={self.think_ms.describe()} ms"
        )

    def draw(self, seed: int, name: str, n: int) -> tuple[list[int], Rng, Rng]:
        """Turns of each of `n` conversations, and the streams of the later turns' followup lengths
        and think times: their own, so that adding turns leaves the first turns' draws as they were."""
        seq = np.random.SeedSequence(seed, spawn_key=(zlib.crc32(name.encode()), 1))
        turns_rng, followup_rng, think_rng = (np.random.default_rng(s) for s in seq.spawn(3))
        turns = self.turns.sample(turns_rng, n).tolist() if n else []
        return turns, followup_rng, think_rng


@dataclass
class History:
    """One conversation so far, as the client resends it."""

    messages: list[dict[str, str]] = field(default_factory=list)  # chat
    text: str = ""  # completions with text prompts
    ids: list[int] = field(default_factory=list)  # completions with token ids

    def prompt(self, endpoint: str, new: str | list[int]) -> str | list[int] | list[dict[str, str]]:
        """What a turn whose new part is `new` sends: the conversation so far, then `new`."""
        if endpoint == "chat":
            require(isinstance(new, str), "a chat turn's new part is text")
            return [*self.messages, {"role": "user", "content": str(new)}]
        if isinstance(new, list):
            return self.ids + new
        return self.text + new

    def answered(self, sent: Any, answer: str, encode: Any = None) -> None:
        """The turn that sent `sent` got `answer`: both are the conversation now. `encode`
        (text -> ids) re-encodes the answer for a conversation sent as token ids."""
        if isinstance(sent, list) and sent and isinstance(sent[0], dict):
            self.messages = [*sent, {"role": "assistant", "content": answer}]
        elif isinstance(sent, list):
            self.ids = [*sent, *(encode(answer) if encode is not None and answer else [])]
        else:
            self.text = str(sent) + answer
