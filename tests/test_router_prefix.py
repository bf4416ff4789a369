"""What the router knows of each worker's prefix cache: keys from load reports, matched by chain."""

from pdserve.blockkeys import prompt_keys
from pdserve.router.prefix import CachedPrefixes, PromptKeys


def test_a_worker_s_keys_follow_its_reports_and_count_only_from_the_first_block() -> None:
    tokens = list(range(100, 200))  # 100 tokens: 6 blocks of 16, and 4 over
    keys = prompt_keys(tokens, 16, b"m|f32")
    cached = CachedPrefixes()
    cached.apply(keys[:3], [])
    prompt = PromptKeys(tokens)
    assert prompt.cached_tokens(cached, "m|f32", 16) == 48
    cached.apply(keys[3:], [keys[1]])  # block 1 evicted: blocks 2.. are of no use without it
    assert prompt.cached_tokens(cached, "m|f32", 16) == 16
    cached.apply([keys[1]], [])
    assert prompt.cached_tokens(cached, "m|f32", 16) == 96  # 6 blocks; the last token always computed
    assert prompt.cached_tokens(cached, "other|f32", 16) == 0  # another model's keys differ
    assert prompt.cached_tokens(cached, "", 16) == 0  # prefix caching off there
    exact = PromptKeys(tokens[:96])  # a prompt of exactly 6 blocks: its last block is computed again
    assert exact.cached_tokens(cached, "m|f32", 16) == 80
    cached.clear()
    assert prompt.cached_tokens(cached, "m|f32", 16) == 0
