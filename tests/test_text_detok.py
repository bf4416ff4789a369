"""Incremental detokenization and stop strings, with the real SmolLM2 tokenizer (byte-level BPE
with multi-byte merges) and the tests' byte-per-token tokenizer, where every multi-byte UTF-8
character is split across tokens. The text built token by token must be exactly what decoding
all the tokens at once gives, and streaming must never show text a stop string later removes."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from conftest import make_tokenizer

from pdserve.text.detok import IncrementalDetokenizer

TEXTS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "Café déjà vu, naïve façade — “quotes” ½ €5",
    "中文字符测试：你好，世界。日本語もOK",
    "emoji 🎉👍🏽 family 👨\u200d👩\u200d👧 flags 🇫🇷 end",
    " leading space\n\nnew lines\ttabs  two  spaces ",
    "mixed 1234567890 ünïcödé 中 🎉x",
]


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> Any:
    from pdserve.modelfiles.gguf_file import find_builtin_gguf
    from pdserve.modelfiles.gguf_tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(find_builtin_gguf())


@pytest.fixture(scope="module")
def byte_tokenizer() -> Any:
    return make_tokenizer()  # type: ignore[no-untyped-call]


@pytest.fixture(params=["smollm2", "bytes"])
def tokenizer(request: pytest.FixtureRequest) -> Any:
    return request.getfixturevalue("smollm2_tokenizer" if request.param == "smollm2" else "byte_tokenizer")


def run(tokenizer: Any, text: str, prompt: str = "Say:", **kwargs: Any) -> IncrementalDetokenizer:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode(prompt), **kwargs)
    for token in tokenizer.encode(text, add_special_tokens=False):
        if detok.add_token(token) is not None:
            break
    return detok


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_decoding_everything_at_once(tokenizer: Any, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Prompt"))
    seen = []
    for token in ids:
        assert detok.add_token(token) is None
        seen.append(detok.text)
        assert "\ufffd" not in detok.text  # a half character is never shown
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True) == text
    # The text only ever grows: what was produced is never rewritten.
    assert all(b.startswith(a) for a, b in itertools.pairwise(seen))


def test_multi_byte_characters_wait_for_their_last_byte(byte_tokenizer: Any) -> None:
    ids = byte_tokenizer.encode("a中🎉", add_special_tokens=False)
    assert len(ids) == 1 + 3 + 4  # one token per byte
    detok = IncrementalDetokenizer(byte_tokenizer, byte_tokenizer.encode("x"))
    texts = []
    for token in ids:
        detok.add_token(token)
        texts.append(detok.text)
    assert texts == ["a", "a", "a", "a中", "a中", "a中", "a中", "a中🎉"]


def test_smollm2_splits_some_characters_across_tokens(smollm2_tokenizer: Any) -> None:
    # Make sure the real tokenizer exercises the split-character path the test above relies on.
    ids = smollm2_tokenizer.encode("🎉", add_special_tokens=False)
    assert len(ids) > 1 and "\ufffd" in smollm2_tokenizer.decode(ids[:1])
    assert run(smollm2_tokenizer, "🎉").text == "🎉"


def test_first_output_token_keeps_its_leading_space(smollm2_tokenizer: Any) -> None:
    # " Paris" decoded alone could lose its space in some tokenizers; the prompt is context.
    detok = run(smollm2_tokenizer, " Paris is", prompt="The capital of France is")
    assert detok.text == " Paris is"


def test_special_tokens_are_skipped_or_kept(smollm2_tokenizer: Any) -> None:
    tok = smollm2_tokenizer
    ids = [
        *tok.encode("Hi", add_special_tokens=False),
        tok.eos_token_id,
        *tok.encode(" there", add_special_tokens=False),
    ]
    skipped = IncrementalDetokenizer(tok, tok.encode("x"))
    kept = IncrementalDetokenizer(tok, tok.encode("x"), skip_special_tokens=False)
    for token in ids:
        skipped.add_token(token)
        kept.add_token(token)
    assert skipped.text == tok.decode(ids, skip_special_tokens=True) == "Hi there"
    assert kept.text == tok.decode(ids, skip_special_tokens=False)
    assert tok.eos_token in kept.text


@pytest.mark.parametrize(
    "text,stop,expected,reason",
    [
        ("The answer is 42. Done.", ["42"], "The answer is ", "42"),
        ("line one\nline two\n\nnext paragraph", ["\n\n"], "line one\nline two", "\n\n"),
        # Earliest in the text wins, whatever the order of the list.
        ("alpha beta gamma", ["gamma", "beta"], "alpha ", "beta"),
        ("alpha beta gamma", ["beta", "gamma"], "alpha ", "beta"),
        # Several stops complete with the same token: still the earliest in the text.
        ("hello world", ["ld", "o w"], "hell", "o w"),
        ("中文字符测试", ["符测"], "中文字", "符测"),
        ("party 🎉 time", ["🎉"], "party ", "🎉"),
        ("no stop here", ["xyz"], "no stop here", None),
        ("stop at the very start", ["stop"], "", "stop"),
    ],
)
def test_stop_strings(tokenizer: Any, text: str, stop: list[str], expected: str, reason: str | None) -> None:
    detok = run(tokenizer, text, stop=stop)
    assert detok.text == expected
    assert detok.stop_reason == reason
    included = run(tokenizer, text, stop=stop, include_stop_str_in_output=True)
    assert included.text == expected + (reason or "")
    assert included.stop_reason == reason


def test_stop_string_split_across_many_tokens_is_found(byte_tokenizer: Any) -> None:
    # Byte tokens: "world" arrives as five tokens; the stop is reported by the one that completes it.
    ids = byte_tokenizer.encode("hello world!", add_special_tokens=False)
    detok = IncrementalDetokenizer(byte_tokenizer, [1], stop=["world"])
    results = [detok.add_token(t) for t in ids]
    assert results == [None] * 10 + ["world", "world"]  # and stays stopped afterwards
    assert detok.text == "hello "


def test_a_shorter_stop_that_completes_first_wins(byte_tokenizer: Any) -> None:
    # "c" completes (at the third byte) before the longer "abcd" could: generation stops there.
    detok = run(byte_tokenizer, "abcdef", stop=["abcd", "c"])
    assert detok.text == "ab" and detok.stop_reason == "c"


def test_stop_inside_the_prompt_does_not_count(tokenizer: Any) -> None:
    detok = run(tokenizer, " and more", prompt="Stop here", stop=["Stop"])
    assert detok.text == " and more" and detok.stop_reason is None


@pytest.mark.parametrize(
    "text,stop",
    [
        ("one two three four five", ["three", "xx"]),
        ("aaaaab", ["aab"]),  # a stop whose prefix repeats
        ("The end is near. END", ["END", "near."]),
        ("abababab", ["bab", "ababx"]),
        ("中文字符测试字符", ["字符测"]),
        ("🎉 party 🎉🎉 time", ["🎉🎉"]),
        ("nothing matches at all", ["zzz", "qq"]),
        ("ends with a partial sto", ["stop"]),
    ],
)
def test_streaming_never_shows_text_a_stop_string_removes(tokenizer: Any, text: str, stop: list[str]) -> None:
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Go"), stop=stop)
    holdback = max(len(s) for s in stop) - 1
    shown: list[str] = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        stopped = detok.add_token(token) is not None
        streamed = detok.streamable_text(finished=stopped)
        if not stopped:
            assert len(streamed) == max(0, len(detok.text) - holdback)
        shown.append(streamed)
        if stopped:
            break
    final = detok.streamable_text(finished=True)
    assert final == detok.text
    # Every streamed state is a prefix of the next and of the final text: nothing is taken back.
    for before, after in zip(shown, [*shown[1:], final], strict=True):
        assert after.startswith(before)
    for s in stop:
        assert all(s not in part for part in shown)
    first = min((i for i in (text.find(s) for s in stop) if i != -1), default=len(text))
    assert final == text[:first]


def test_no_holdback_without_stop_strings(tokenizer: Any) -> None:
    detok = run(tokenizer, "stream me")
    assert detok.streamable_text(finished=False) == detok.text == "stream me"


def test_streaming_the_held_back_tail_of_an_unfinished_request(byte_tokenizer: Any) -> None:
    detok = run(byte_tokenizer, "hello wor", stop=["world", "x"])
    # "wor" could still become "world": the last len("world") - 1 characters wait.
    assert detok.streamable_text(finished=False) == "hello"
    assert detok.streamable_text(finished=True) == "hello wor"


def test_stop_strings_wait_for_min_tokens(byte_tokenizer: Any) -> None:
    ids = byte_tokenizer.encode("ab stop cd stop ef", add_special_tokens=False)
    early = IncrementalDetokenizer(byte_tokenizer, [1], stop=["stop"])
    late = IncrementalDetokenizer(byte_tokenizer, [1], stop=["stop"], min_tokens=8)
    for detok in (early, late):
        for token in ids:
            if detok.add_token(token) is not None:
                break
    assert early.text == "ab " and early.stop_reason == "stop"
    # The first "stop" ends with the 7th byte token, inside min_tokens: only the second counts.
    assert late.text == "ab stop cd " and late.stop_reason == "stop"
