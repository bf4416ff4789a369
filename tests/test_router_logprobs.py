"""Logprobs in OpenAI's two shapes, from what workers send, with the real SmolLM2 tokenizer (whose
byte-level tokens may hold part of a UTF-8 character), and the request fields that ask for them."""

from __future__ import annotations

import math

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.router.logprobs import LogprobsFormatter, TokenLogprobs, engine_logprobs
from pdserve.text.tokenizer import RouterTokenizer, load_router_tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> RouterTokenizer:
    return load_router_tokenizer("smollm2-135m")


def test_chat_shape_has_exact_bytes_even_for_a_split_character(tokenizer: RouterTokenizer) -> None:
    ids = tokenizer.encode("Ok 😀", add_special_tokens=False)
    entries = [(t, -0.5 - i, {t: -0.5 - i, 5: -3.0, 9: -2.0}) for i, t in enumerate(ids)]
    logprobs = TokenLogprobs()
    for entry in entries:
        logprobs.add(entry, 0)
    content = LogprobsFormatter(tokenizer, chat=True).render(logprobs)["content"]
    assert [c["logprob"] for c in content] == [e[1] for e in entries]
    # The emoji is split over tokens: each alone decodes to U+FFFD, yet the bytes join up.
    assert any("\ufffd" in c["token"] for c in content)
    assert b"".join(bytes(c["bytes"]) for c in content).decode() == "Ok 😀"
    for c in content:
        tops = [t["logprob"] for t in c["top_logprobs"]]
        assert tops == sorted(tops, reverse=True) and len(tops) == 3
        assert all(set(t) == {"token", "logprob", "bytes"} for t in c["top_logprobs"])


def test_completion_shape_lists_tokens_offsets_and_tops_with_the_chosen_one(
    tokenizer: RouterTokenizer,
) -> None:
    hello, world = tokenizer.encode("Hello world", add_special_tokens=False)
    logprobs = TokenLogprobs()
    logprobs.add((hello, -0.1, {}), 0)  # logprobs=0: the chosen token only
    logprobs.add((world, -2.5, {5: -0.2}), 5)  # it was not among the top 1: both appear
    shape = LogprobsFormatter(tokenizer, chat=False).render(logprobs)
    assert shape["tokens"] == ["Hello", " world"]
    assert shape["token_logprobs"] == [-0.1, -2.5]
    assert shape["text_offset"] == [0, 5]
    assert shape["top_logprobs"][0] == {"Hello": -0.1}
    assert shape["top_logprobs"][1] == {tokenizer.token_piece(5)[0]: -0.2, " world": -2.5}
    assert all(math.isfinite(v) for top in shape["top_logprobs"] for v in top.values())


def test_request_fields_map_to_the_engines_count_or_a_400_naming_them() -> None:
    assert engine_logprobs(False, None, None) is None
    assert engine_logprobs(False, 0, None) == 0 and engine_logprobs(False, 20, None) == 20
    assert engine_logprobs(True, False, None) is None
    assert engine_logprobs(True, True, None) == 0
    assert engine_logprobs(True, True, 5) == 5
    for chat, logprobs, top, param in (
        (False, 21, None, "logprobs"),
        (False, -1, None, "logprobs"),
        (True, False, 3, "top_logprobs"),  # OpenAI: top_logprobs needs logprobs true
        (True, True, 21, "top_logprobs"),
        (True, True, -1, "top_logprobs"),
    ):
        with pytest.raises(InvalidRequestError) as caught:
            engine_logprobs(chat, logprobs, top)
        assert caught.value.param == param
