"""The KV checksum: the same blocks hash the same wherever they sit; any change is caught."""

from __future__ import annotations

import pytest
import torch

from pdserve.transfer.base import ChecksumError, FaultInjector
from pdserve.transfer.checksum import checksum_enabled, kv_block_digests, kv_digest
from pdserve.transfer.shm import OwnedSegment, ShmImporter

SHAPE = (3, 2, 10, 4, 2, 8)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]


def copy_blocks(src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int]) -> None:
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        dst[:, :, d] = src[:, :, s]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_the_same_blocks_at_other_ids_hash_the_same(dtype: torch.dtype) -> None:
    holder = torch.randn(SHAPE).to(dtype)
    puller = torch.zeros((3, 2, 16, 4, 2, 8), dtype=dtype)  # another size, other ids, other runs
    src, dst = [3, 4, 5, 9, 0], [0, 7, 8, 1, 15]
    copy_blocks(holder, src, puller, dst)
    assert kv_digest(holder, src) == kv_digest(puller, dst)
    assert len(kv_digest(holder, src)) == 32  # 128 bits
    # The order of the blocks is part of what is checked: KV in the wrong positions is wrong KV.
    assert kv_digest(holder, [4, 3, 5, 9, 0]) != kv_digest(holder, src)
    # Blocks outside the list do not count.
    before = kv_digest(holder, src)
    holder[:, :, 7] += 1
    assert kv_digest(holder, src) == before


def test_per_block_digests_check_any_subset_of_a_lease() -> None:
    holder = torch.randn(SHAPE)
    puller = torch.zeros((3, 2, 16, 4, 2, 8))
    src, dst = [3, 4, 5, 9, 0], [0, 7, 8, 1, 15]
    digests = kv_block_digests(holder, src)
    assert len(digests) == 5 and len(set(digests)) == 5
    # A delta: the puller has the first two already (its own, maybe computed otherwise) and pulls
    # the last three; their digests are the holder's last three.
    copy_blocks(holder, src[2:], puller, dst[2:])
    assert kv_block_digests(puller, dst[2:]) == digests[2:]
    assert kv_block_digests(holder, [9]) == [digests[3]]
    puller[1, 0, 8] += 1  # one plane of one block changed: that block's digest, and only it
    changed = kv_block_digests(puller, dst[2:])
    assert changed[0] != digests[2] and changed[1:] == digests[3:]
    with pytest.raises(ValueError, match="outside"):
        kv_block_digests(holder, [16])


def test_every_single_bit_flip_changes_the_digest() -> None:
    holder = torch.randn(SHAPE)
    blocks = [2, 3, 6]
    reference = kv_digest(holder, blocks)
    raw = holder.view(torch.int32)  # [L, 2, NB, BS, KVH, D]
    for layer, kv, block, bit in [(0, 0, 2, 0), (2, 1, 6, 30), (1, 1, 3, 17), (2, 0, 3, 9)]:
        raw[layer, kv, block, 1, 1, 5] ^= 1 << bit
        assert kv_digest(holder, blocks) != reference
        raw[layer, kv, block, 1, 1, 5] ^= 1 << bit
        assert kv_digest(holder, blocks) == reference


def test_an_injected_corruption_is_caught_by_the_importer_and_counted() -> None:
    owner = OwnedSegment(SHAPE, torch.float32)
    owner.tensor.copy_(torch.randn(SHAPE))
    local = torch.zeros((3, 2, 6, 4, 2, 8))
    try:
        digest = kv_digest(owner.tensor, [1, 4, 5])
        clean = ShmImporter(local)
        clean.pull(owner.name, [1, 4, 5], [2, 0, 1], timeout=5.0, digest=digest)
        assert clean.stats.failures == 0 and kv_digest(local, [2, 0, 1]) == digest
        with pytest.raises(ChecksumError, match="checksum mismatch"):  # a digest of other blocks
            clean.pull(owner.name, [1, 4, 5], [2, 0, 1], timeout=5.0, digest=kv_digest(owner.tensor, [1, 4]))
        assert clean.stats.checksum_failures == 1
        clean.close()

        corrupting = ShmImporter(local, FaultInjector(corrupt_rate=1.0, seed=3))
        for _ in range(5):  # a different bit of a different block each time: always caught
            with pytest.raises(ChecksumError):
                corrupting.pull(owner.name, [1, 4, 5], [2, 0, 1], timeout=5.0, digest=digest)
        assert corrupting.stats.failures == corrupting.stats.checksum_failures == 5
        assert corrupting.stats.bytes == 0
        # Without a digest the same corruption goes through unseen: what the checksum is for.
        corrupting.pull(owner.name, [1, 4, 5], [2, 0, 1], timeout=5.0)
        assert kv_digest(local, [2, 0, 1]) != digest
        corrupting.close()
    finally:
        owner.close()


def test_the_mode_decides_by_where_the_cache_is() -> None:
    cpu_cache = torch.zeros(SHAPE)
    assert checksum_enabled("auto", cpu_cache) and checksum_enabled("on", cpu_cache)
    assert not checksum_enabled("off", cpu_cache)
    with pytest.raises(ValueError, match="auto"):
        checksum_enabled("yes", cpu_cache)
    with pytest.raises(ValueError, match="contiguous"):  # at the worker's start, not mid-serving
        checksum_enabled("auto", cpu_cache.transpose(0, 1))


def test_block_ids_outside_the_cache_are_an_error_not_a_shorter_digest() -> None:
    cache = torch.randn(SHAPE)  # 10 blocks
    for bad in ([9, 10], [-1], [3, 42]):
        with pytest.raises(ValueError, match="outside this cache of 10 blocks"):
            kv_digest(cache, bad)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_gpu_cache_hashes_like_the_same_blocks_on_the_host() -> None:
    host = torch.randn(SHAPE).to(torch.bfloat16)
    device = host.cuda()
    assert not checksum_enabled("auto", device) and checksum_enabled("on", device)
    assert kv_digest(device, [5, 1, 2]) == kv_digest(host, [5, 1, 2])
