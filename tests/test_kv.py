"""KV-cache block manager: pure Python, no torch."""

import pytest

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
