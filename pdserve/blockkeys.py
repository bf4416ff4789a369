"""The keys of full KV blocks for prefix caching: a hash chain over token ids. Pure Python.

A block's key is the hash of the key of the block before it (b"" for the first), its tokens and a
salt that names whatever else changes the block's values (the model, the cache's dtype). Equal keys
mean equal KV; the chain makes a key stand for every token before it too. The engine keys its
blocks with it (engine/kv.py); the router computes the same keys from a prompt's tokens to find
which worker has how much of it cached (router/prefix.py), so it is deterministic across
processes and hosts.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockKey = bytes


def block_key(parent: BlockKey, tokens: Sequence[int], salt: bytes) -> BlockKey:
    """The key of a full block of `tokens` after the block keyed `parent`."""
    digest = hashlib.blake2b(parent, digest_size=16)
    digest.update(array("q", tokens).tobytes())
    digest.update(salt)
    return digest.digest()


def prompt_keys(
    tokens: Sequence[int], block_size: int, salt: bytes, limit: int | None = None
) -> list[BlockKey]:
    """The keys of the full blocks among the first `limit` (default all) of `tokens`."""
    keys: list[BlockKey] = []
    parent = b""
    end = (len(tokens) if limit is None else min(limit, len(tokens))) // block_size * block_size
    for start in range(0, end, block_size):
        parent = block_key(parent, tokens[start : start + block_size], salt)
        keys.append(parent)
    return keys
