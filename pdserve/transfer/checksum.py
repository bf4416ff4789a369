"""A digest of a request's KV blocks, so that a transfer that changed them is a detected failure.

The holder hashes the blocks it leases (`kv_block_digests`: one digest per block) and puts the
digests in the `KVHandle`; the importer hashes the blocks that landed in its own cache and fails
the pull when they differ
(`base.ChecksumError`, which the router's kv_transfer_failed path retries and counts). What it catches:
bytes changed on the wire or in memory, a transport that wrote the wrong blocks or a torn read, a
holder that freed and reused the blocks under the lease - wrong tokens become a counted failure.
It is not authentication (that is the lease token and the deployment key): a peer that can write
the cache can also forge the digest.

The digest is XXH3-128 over each block's bytes in one fixed order: layer, then K before V, then
the blocks in the order given: the stream order of pdserve.transfer.layout. A streaming hash
does not depend on how its input is cut, so each side feeds its own runs of consecutive block
ids (one `update` per run and plane) and the two still agree when the holder's and the
importer's block ids are laid out differently. XXH3 runs
at ~20 GB/s on one core here (a stdlib crc32 at 2 GB/s would cost more than an shm pull).

A worker's lease carries one digest per block (`kv_block_digests`): a decode worker that has the
first blocks of a prompt in its prefix cache pulls only the rest (a delta), and checks just those.

A cache on a GPU is gathered and copied to the host first (the same bytes in the same order):
that costs a device-to-host copy, so `auto` (the default) checks CPU caches only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import xxhash

from pdserve.config import KV_CHECKSUM_MODES
from pdserve.transfer.layout import block_views, cache_bytes, layout_of


def checksum_enabled(mode: str, kv_cache: torch.Tensor) -> bool:
    """Whether a worker with this cache digests what it holds and checks what it pulls. Checked at
    the worker's start, so that a cache `kv_digest` cannot read fails there, not mid-serving."""
    if mode not in KV_CHECKSUM_MODES:
        raise ValueError(f"kv checksum mode must be one of {KV_CHECKSUM_MODES}, got {mode!r}")
    enabled = mode == "on" or (mode == "auto" and kv_cache.device.type == "cpu")
    if enabled and not kv_cache.is_contiguous():
        raise ValueError("the KV checksum needs one contiguous cache tensor")
    return enabled


def kv_digest(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> str:
    """Hex XXH3-128 of `block_ids` of `kv_cache` ([L, 2, NB, BS, KVH, D], contiguous)."""
    hasher = xxhash.xxh3_128()
    num_blocks = kv_cache.shape[2]
    if any(not 0 <= block < num_blocks for block in block_ids):  # a byte slice would just clip
        raise ValueError(f"block ids outside this cache of {num_blocks} blocks")
    if kv_cache.device.type != "cpu":
        index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_cache.device)
        for layer in range(kv_cache.shape[0]):  # one layer at a time: no gather of the whole KV
            gathered = kv_cache[layer].index_select(1, index).cpu()  # [2, n, BS, KVH, D]: same order
            hasher.update(gathered.contiguous().view(torch.uint8).numpy().data)
        return hasher.hexdigest()
    num_blocks, pieces, piece, _ = layout_of(kv_cache)
    for view in block_views(cache_bytes(kv_cache), num_blocks, pieces, piece, block_ids):
        hasher.update(view)  # one view per run of blocks and plane
    return hasher.hexdigest()


def kv_block_digests(kv_cache: torch.Tensor, block_ids: Sequence[int]) -> list[str]:
    """Hex XXH3-128 of each of `block_ids` on its own (its planes in stream order), so that a pull
    of some of a lease's blocks (a delta: the puller has the first ones cached) is checked too."""
    num_blocks = kv_cache.shape[2]
    if any(not 0 <= block < num_blocks for block in block_ids):
        raise ValueError(f"block ids outside this cache of {num_blocks} blocks")
    hashers = [xxhash.xxh3_128() for _ in block_ids]
    if kv_cache.device.type != "cpu":
        index = torch.tensor(list(block_ids), dtype=torch.long, device=kv_cache.device)
        for layer in range(kv_cache.shape[0]):
            gathered = kv_cache[layer].index_select(1, index).cpu()  # [2, n, BS, KVH, D]
            for kv in range(gathered.shape[0]):
                for i, hasher in enumerate(hashers):
                    hasher.update(gathered[kv, i].contiguous().view(torch.uint8).numpy().data)
        return [h.hexdigest() for h in hashers]
    num_blocks, pieces, piece, _ = layout_of(kv_cache)
    flat = cache_bytes(kv_cache)
    for p in range(pieces):
        plane = p * num_blocks
        for block, hasher in zip(block_ids, hashers, strict=True):
            start = (plane + block) * piece
            hasher.update(flat[start : start + piece])
    return [h.hexdigest() for h in hashers]
