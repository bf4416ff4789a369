"""KV-cache block manager: pure Python, no torch."""

import random

import pytest

from pdserve.blockkeys import prompt_keys
from pdserve.engine.kv import KVCacheManager


def test_allocate_grows_table_in_token_order() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate("a", 5) == [0, 1]
    assert kv.allocate("a", 8) == []  # still fits in two blocks
    assert kv.allocate("a", 9) == [2]
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5
    kv.check_consistency()


def test_allocate_is_all_or_nothing() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2)
    assert kv.allocate("a", 4) == [0, 1]
    assert kv.allocate("b", 4) is None  # needs 2, only 1 free: nothing taken
    assert kv.num_free_blocks == 1
    assert not kv.has_blocks("b")
    kv.check_consistency()


def test_free_returns_blocks_and_is_idempotent() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate("a", 3)
    kv.allocate("b", 2)
    assert kv.free("a") == 2
    assert kv.free("a") == 0
    assert kv.num_free_blocks == 3
    assert kv.allocate("c", 6) is not None
    kv.free("b")
    kv.free("c")
    assert kv.num_free_blocks == 4 and kv.usage == 0.0
    kv.check_consistency()


def test_can_fit_and_blocks_for_tokens() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=16)
    assert kv.blocks_for_tokens(1) == 1 and kv.blocks_for_tokens(16) == 1 and kv.blocks_for_tokens(17) == 2
    assert kv.can_fit("x", 32) and not kv.can_fit("x", 33)


@pytest.mark.parametrize("num_blocks,block_size", [(0, 16), (4, 0)])
def test_bad_sizes_rejected(num_blocks: int, block_size: int) -> None:
    with pytest.raises(ValueError):
        KVCacheManager(num_blocks, block_size)


def test_a_spare_block_is_free_stays_free_and_is_none_when_the_cache_is_full() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    spare = kv.spare_block()
    assert spare is not None and kv.num_free_blocks == 3  # looking takes nothing
    table = kv.allocate("a", 8)  # two blocks
    assert table is not None and spare not in table and kv.spare_block() == spare
    assert kv.allocate("b", 4) == [spare]  # the last free block is the spare one
    assert kv.spare_block() is None
    kv.free("a")
    assert kv.spare_block() in table


# -- prefix caching -------------------------------------------------------------------------------
def cached(num_blocks: int = 8, block_size: int = 4, salt: bytes = b"m|f32") -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, prefix_cache=True, salt=salt)


def compute(kv: KVCacheManager, rid: str, tokens: list[int]) -> int:
    """What the scheduler does for a request: reuse its cached prefix, allocate the rest, and
    commit once every token is computed. Returns the tokens it found cached."""
    hit = kv.match_prefix(rid, tokens, len(tokens) - 1)
    assert kv.allocate(rid, len(tokens)) is not None
    kv.commit(rid, len(tokens), lambda a, b: tokens[a:b])
    return hit


def test_a_later_prompt_shares_the_cached_blocks_of_its_prefix_read_only() -> None:
    kv = cached()
    prompt = list(range(100, 110))  # 2 full blocks and 2 tokens
    assert compute(kv, "a", prompt) == 0
    a_table = kv.block_table("a")
    # While "a" still runs, "b" (same first 8 tokens, then its own) shares its two full blocks.
    assert compute(kv, "b", [*prompt[:8], 1, 2, 3]) == 8
    assert kv.block_table("b")[:2] == a_table[:2] and kv.block_table("b")[2] not in a_table
    kv.check_consistency()
    kv.free("a")
    kv.free("b")
    assert kv.num_free_blocks == kv.num_blocks and kv.num_cached_blocks == 2
    # Nobody holds them now, and they are still found; at least the last token is always computed.
    assert compute(kv, "c", prompt[:8]) == 4
    kv.free("c")
    kv.check_consistency()


def test_different_prompts_never_share_a_block() -> None:
    rng = random.Random(7)
    kv = cached(num_blocks=64, block_size=4)
    seen: list[list[int]] = []
    for n in range(60):
        base = rng.choice(seen) if seen and rng.random() < 0.7 else []
        common = rng.randint(0, len(base))
        tokens = base[:common] + [rng.randint(1, 5) for _ in range(rng.randint(1, 20))]
        best = max((_common_prefix(tokens, s) for s in seen), default=0)
        hit = compute(kv, f"r{n}", tokens)
        # Exactly the whole blocks of the longest prefix seen before (within all but the last token),
        # unless some were evicted: never a block of other tokens.
        assert hit <= min(best, len(tokens) - 1) // 4 * 4
        for index, block in enumerate(kv.block_table(f"r{n}")[: hit // 4]):
            assert kv._key_of[block] == prompt_keys(tokens, 4, kv.salt)[index]
        kv.free(f"r{n}")
        kv.check_consistency()
        seen.append(tokens)
    assert kv.prefix_hits == 0  # counted by the scheduler's count_lookup, not here


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_cached_blocks_are_evicted_least_recently_used_and_only_when_no_free_block_is_left() -> None:
    kv = cached(num_blocks=6, block_size=2)
    compute(kv, "a", [1, 2, 3, 4, 5])  # 3 blocks, 2 of them keyed
    compute(kv, "b", [6, 7, 8])  # 2 blocks, 1 keyed
    kv.free("a")
    kv.free("b")
    assert kv.num_cached_blocks == 3 and kv.num_free_blocks == 6
    assert kv.allocate("x", 6) is not None  # 3 blocks: the 3 unkeyed free ones first
    assert kv.num_cached_blocks == 3 and kv.evictions == 0
    assert kv.allocate("y", 2) is not None  # now one cached block must go: a's, the oldest
    assert kv.evictions == 1
    assert kv.match_prefix("a2", [1, 2, 3, 4, 5], 4) == 2  # its second block was evicted first
    assert kv.match_prefix("b2", [6, 7, 8], 2) == 2  # b's block, used more recently, stays
    kv.check_consistency()
    # A held block is never evicted: with every block held, nothing more is given out.
    assert kv.allocate("z", 2) is None
    for rid in ("x", "y", "a2", "b2"):
        kv.free(rid)
    kv.check_consistency()


def test_the_spare_block_is_never_a_cached_one() -> None:
    kv = cached(num_blocks=3, block_size=2)
    compute(kv, "a", [1, 2, 3])  # two blocks, the first keyed
    kv.free("a")
    compute(kv, "b", [9])  # one unkeyed block
    spare = kv.spare_block()
    assert spare is not None and spare not in kv._key_of and kv.num_cached_blocks == 1
    compute(kv, "c", [8])  # the last unkeyed one: only the cached block is free now
    spare = kv.spare_block()
    assert spare is not None and kv.num_cached_blocks == 0 and kv.evictions == 1  # evicted to be it
    assert kv.match_prefix("a2", [1, 2, 3], 2) == 0
    kv.free("b")
    kv.free("c")
    kv.check_consistency()


def test_two_requests_computing_the_same_block_keep_their_own_and_the_first_is_found() -> None:
    kv = cached()
    for rid in ("a", "b"):  # both admitted before either computed anything
        assert kv.match_prefix(rid, [1, 2, 3, 4, 5], 4) == 0
        assert kv.allocate(rid, 5) is not None
    kv.commit("a", 5, lambda s, e: [1, 2, 3, 4, 5][s:e])
    kv.commit("b", 5, lambda s, e: [1, 2, 3, 4, 5][s:e])
    assert kv.num_cached_blocks == 1
    kv.free("b")  # b's copy is plain free again
    kv.free("a")
    assert kv.match_prefix("c", [1, 2, 3, 4, 5], 4) == 4
    kv.free("c")
    kv.check_consistency()


def test_with_prefix_caching_off_nothing_is_kept_or_found() -> None:
    kv = KVCacheManager(8, 4)
    compute(kv, "a", list(range(10)))
    kv.free("a")
    assert kv.num_cached_blocks == 0 and kv.match_prefix("b", list(range(10)), 9) == 0
    kv.count_lookup(10, 0)
    assert kv.prefix_queries == 0


def test_the_keys_stored_and_evicted_are_told_once_each() -> None:
    kv = cached()
    kv.record_events = True
    assert not kv.has_events
    prompt = list(range(100, 110))  # 2 full blocks
    compute(kv, "a", prompt)
    assert kv.has_events
    stored, evicted = kv.take_events()
    assert len(stored) == 2 and evicted == [] and not kv.has_events
    kv.free("a")  # still cached: nothing to tell
    assert not kv.has_events
    # A prompt that needs every block evicts a's two: told as evicted (its own, as stored).
    compute(kv, "b", list(range(500, 532)))
    stored_b, evicted = kv.take_events()
    assert sorted(evicted) == sorted(stored) and len(stored_b) == 8 and not set(stored_b) & set(stored)
