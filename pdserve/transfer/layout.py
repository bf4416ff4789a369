"""Byte views of a KV cache in the order blocks travel, shared by whatever reads blocks as bytes:
the `tcp` transport sends and receives them, `nixl` sizes its pieces by them, the checksum hashes
them. No dependency on the transports themselves.

Stream order: for each of the L*2 (layer, K/V) planes of a [L, 2, NB, BS, KVH, D] cache, the
blocks in the order given, each one [block_size, kv_heads, head_dim] piece. Each side cuts that
stream into its own runs of consecutive block ids, so two block lists of the same length give
the same stream from different places.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch


def cache_bytes(kv_cache: torch.Tensor) -> memoryview:
    """The whole cache as one flat writable byte view (no copy; works for every dtype)."""
    if not kv_cache.is_contiguous() or kv_cache.device.type != "cpu":
        raise ValueError("byte views need a contiguous CPU KV cache")
    # numpy's view of a 1-D uint8 array is already format "B"; a .cast() copy of it slices slower.
    return kv_cache.view(-1).view(torch.uint8).numpy().data


def layout_of(kv_cache: torch.Tensor) -> tuple[int, int, int, bytes]:
    """(blocks, pieces per block, bytes per piece, dtype) of a [L, 2, NB, BS, KVH, D] cache."""
    layers, two, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
    piece = block_size * kv_heads * head_dim * kv_cache.element_size()
    return num_blocks, layers * two, piece, str(kv_cache.dtype).removeprefix("torch.").encode()


def block_views(
    flat: memoryview, num_blocks: int, pieces: int, piece: int, blocks: Sequence[int]
) -> Iterator[memoryview]:
    """Views of `blocks` in stream order, one per run of consecutive block ids in each plane.

    A generator: 256 MiB of scattered blocks are ~22k views, and holding them all at once makes
    the garbage collector run full collections (~100 ms each in a process with torch loaded);
    made and dropped a batch at a time, they never trigger one."""
    runs: list[tuple[int, int]] = []  # (first block, count)
    for b in blocks:
        if runs and b == runs[-1][0] + runs[-1][1]:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    for p in range(pieces):
        plane = p * num_blocks
        for first, count in runs:
            start = (plane + first) * piece
            yield flat[start : start + count * piece]
