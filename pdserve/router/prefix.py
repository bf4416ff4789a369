"""What each worker has cached of a prompt, for KV-aware routing. No torch.

A worker keys every full KV block it computes or receives by a hash chain over its tokens
(pdserve/blockkeys.py) and says in each load report which keys it stored and evicted since the last
(`wire.Load.prefix_stored` / `prefix_evicted`); its greeting says its salt (`wire.Ready.prefix_salt`).
The router keeps each worker's keys (`CachedPrefixes`), computes a prompt's keys the same way
(`PromptKeys`, once per salt and block size), and so knows how many of the prompt's leading tokens
each worker would find cached: the path choice counts only the tokens left to compute, and the
worker choice weighs them against load (router/policy.py).

It is a hint: a report that never arrived, or a block evicted since the last one, makes the worker
compute more than predicted, never anything wrong (the worker finds its own blocks by key). A
worker that goes down forgets nothing the router could use: its keys are dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

from pdserve.blockkeys import BlockKey, prompt_keys


class CachedPrefixes:
    """One worker's cached block keys, as its load reports have said."""

    def __init__(self) -> None:
        self.keys: set[BlockKey] = set()

    def apply(self, stored: Sequence[BlockKey], evicted: Sequence[BlockKey]) -> None:
        self.keys.difference_update(evicted)
        self.keys.update(stored)

    def clear(self) -> None:
        self.keys.clear()

    def cached_blocks(self, keys: Sequence[BlockKey]) -> int:
        """How many of `keys` (a prompt's, in order) it has, from the first: the chain means a
        block is usable only when every block before it is there too."""
        n = 0
        for key in keys:
            if key not in self.keys:
                break
            n += 1
        return n


class PromptKeys:
    """A prompt's block keys for each (salt, block size) asked for, computed once each."""

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = tokens
        self._keys: dict[tuple[str, int], list[BlockKey]] = {}

    def cached_tokens(self, prefixes: CachedPrefixes, salt: str, block_size: int) -> int:
        """Tokens of the prompt a worker with `prefixes` (and this salt and block size) has cached,
        leaving at least the last token to compute (the worker never reuses more)."""
        if not salt or block_size <= 0 or not prefixes.keys or len(self.tokens) < 2:
            return 0
        keys = self._keys.get((salt, block_size))
        if keys is None:
            keys = prompt_keys(self.tokens, block_size, salt.encode(), len(self.tokens) - 1)
            self._keys[salt, block_size] = keys
        return prefixes.cached_blocks(keys) * block_size
