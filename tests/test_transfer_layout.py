"""Byte views of a KV cache in the order blocks travel: one view per run of consecutive blocks in
each (layer, K/V) plane, no copy, and a clear refusal of a cache they cannot view."""

from __future__ import annotations

import pytest
import torch

from pdserve.transfer.layout import block_views, cache_bytes, layout_of


def test_block_views_follow_the_stream_order_one_view_per_run() -> None:
    cache = torch.arange(2 * 2 * 8 * 3, dtype=torch.float32).reshape(2, 2, 8, 3)  # [L, K/V, NB, piece]
    num_blocks, pieces, piece, dtype = layout_of(cache.view(2, 2, 8, 1, 1, 3))
    assert (num_blocks, pieces, piece, dtype) == (8, 4, 12, b"float32")
    blocks = [5, 6, 7, 2, 0, 1]  # three runs: 5-7, 2, 0-1
    views = list(block_views(cache_bytes(cache), num_blocks, pieces, piece, blocks))
    assert len(views) == pieces * 3
    stream = torch.frombuffer(bytearray(b"".join(bytes(v) for v in views)), dtype=torch.float32)
    planes = cache.reshape(pieces, num_blocks, 3)
    assert torch.equal(stream, planes[:, blocks].reshape(-1))


def test_cache_bytes_refuses_a_non_contiguous_cache() -> None:
    with pytest.raises(ValueError, match="contiguous CPU"):
        cache_bytes(torch.zeros(4, 6).t())
