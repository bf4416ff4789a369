"""Benchmark prompts: real text, exact token counts, a different start for every request."""

from __future__ import annotations

from pathlib import Path

from pdserve.bench.prompts import PromptBuilder, corpus_text
from pdserve.text.tokenizer import RouterTokenizer


def test_token_id_prompts_have_the_asked_length_and_differ(tiny_llama: Path) -> None:
    builder = PromptBuilder(RouterTokenizer(tiny_llama), seed=1)
    prompts = [builder.token_ids(n) for n in (1, 50, 3000)]
    assert [len(p) for p in prompts] == [1, 50, 3000]
    assert builder.token_ids(40)[:8] != builder.token_ids(40)[:8]  # no shared prefix to cache


def test_text_prompts_encode_back_to_the_asked_length(tiny_llama: Path) -> None:
    tokenizer = RouterTokenizer(tiny_llama)
    builder = PromptBuilder(tokenizer, seed=2)
    for n in (5, 64, 700):
        text, count = builder.text(n)
        assert count == n == len(tokenizer.encode(text))
        assert text.strip()


def test_the_corpus_is_real_english_text() -> None:
    text = corpus_text()
    assert len(text) > 100_000 and " the " in text


def test_a_window_longer_than_the_corpus_reads_it_round_and_round(tiny_llama: Path) -> None:
    builder = PromptBuilder(RouterTokenizer(tiny_llama), seed=3, text=corpus_text()[:20_000])
    ids = builder.ids
    window = builder.token_ids(2 * len(ids) + 5)
    assert len(window) == 2 * len(ids) + 5
    starts = [s for s in range(len(ids)) if ids[s] == window[0]]
    assert any(all(w == ids[(s + i) % len(ids)] for i, w in enumerate(window)) for s in starts)
