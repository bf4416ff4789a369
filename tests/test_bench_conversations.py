"""A conversation so far, as the bench client resends it (chat messages, text, or token ids)."""

from __future__ import annotations

import pytest

from pdserve.bench.conversations import History
from pdserve.bench.distributions import WorkloadError


def test_chat_turns_resend_every_message_so_far() -> None:
    history = History()
    first = history.prompt("chat", "What is KV?")
    assert first == [{"role": "user", "content": "What is KV?"}]
    history.answered(first, "Keys and values.")
    second = history.prompt("chat", "And prefill?")
    assert second == [
        {"role": "user", "content": "What is KV?"},
        {"role": "assistant", "content": "Keys and values."},
        {"role": "user", "content": "And prefill?"},
    ]
    with pytest.raises(WorkloadError, match="text"):
        history.prompt("chat", [1, 2])


def test_text_and_id_turns_grow_by_the_answer_and_the_new_part() -> None:
    text = History()
    sent = text.prompt("completions", "Q1.")
    text.answered(sent, " A1.")
    assert text.prompt("completions", " Q2.") == "Q1. A1. Q2."
    ids = History()
    sent_ids = ids.prompt("completions", [5, 6, 7])
    ids.answered(sent_ids, "ab", encode=lambda s: [ord(c) for c in s])  # the answer re-encoded
    assert ids.prompt("completions", [8]) == [5, 6, 7, 97, 98, 8]
    ids.answered(ids.prompt("completions", [8]), "", encode=lambda s: [ord(c) for c in s])
    assert ids.prompt("completions", [9]) == [5, 6, 7, 97, 98, 8, 9]  # an empty answer adds nothing
