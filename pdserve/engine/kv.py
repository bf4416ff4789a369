"""KV-cache block manager, with prefix caching. Pure Python: it hands out block ids; the model
runner owns the tensors.

The cache is `num_blocks` fixed-size blocks of `block_size` token slots. Each request owns a block
table (an ordered list of block ids) covering its computed tokens plus the tokens being computed
this step. Token `i` of a request lives in slot `table[i // block_size] * block_size + i % block_size`.

Prefix caching (`prefix_cache=True`): once all `block_size` slots of a request's block hold computed
KV, the block is keyed by a hash chain (`block_key`: the previous block's key, the block's tokens and
the cache's salt, which names whatever else changes the values: the model and the cache's dtype).
A request that starts later finds its longest run of leading blocks by key (`match_prefix`) and
shares them read-only (a reference count per block) instead of computing them again. A block is
never written while shared: a request's first new token falls on a block boundary after its hits,
and the scratch block (`spare_block`) is never a keyed one. When no request holds a keyed block any
more it stays findable ("cached"), and it is evicted, least recently used first, only when a
request needs a block and no unkeyed free block is left. Two requests that compute the same block
at the same time both keep their own; the first one keyed is the one found.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Sequence

from pdserve.blockkeys import BlockKey, block_key, prompt_keys


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, prefix_cache: bool = False, salt: bytes = b""
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.prefix_cache = prefix_cache
        self.salt = salt
        self._free: deque[int] = deque(range(num_blocks))  # no request holds them, nothing to find
        # Keyed blocks no request holds, least recently used first: free, but findable until evicted.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks  # requests holding each block
        self._key_of: dict[int, BlockKey] = {}
        self._block_of: dict[BlockKey, int] = {}
        self._tables: dict[str, list[int]] = {}
        self._keys: dict[str, list[BlockKey]] = {}  # a request's full blocks' keys, in table order
        # Since start (tokens): looked up when a request was admitted, and found cached.
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.evictions = 0
        # Keys keyed or evicted since `take_events` (only when `record_events`: a worker reports
        # them to the router, which routes by what each worker has cached).
        self.record_events = False
        self._touched: set[BlockKey] = set()

    # -- queries -----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can be given: free ones and cached ones no request holds."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Keyed blocks (held by requests or not): what a new prompt can find."""
        return len(self._key_of)

    def spare_block(self) -> int | None:
        """A block no request holds (the one next to be handed out last), or None if none is free.
        It stays free: what is written to it is scratch (a padded decode step's extra rows), as a
        block's slots are always written before they are read once it is allocated. Never a cached
        block: the least recently used one is evicted to be the spare when no other is free."""
        if not self._free and self._evictable:
            self._free.append(self._evict())
        return self._free[-1] if self._free else None

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_for_tokens(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        """The request's block ids, in token order. Empty if it holds none."""
        return self._tables.get(request_id, [])

    def has_blocks(self, request_id: str) -> bool:
        return request_id in self._tables

    def can_fit(self, request_id: str, total_tokens: int) -> bool:
        have = len(self._tables.get(request_id, ()))
        return self.blocks_for_tokens(total_tokens) - have <= self.num_free_blocks

    @property
    def request_ids(self) -> list[str]:
        return list(self._tables)

    # -- changes -----------------------------------------------------------------------------------
    def match_prefix(self, request_id: str, tokens: Sequence[int], limit: int) -> int:
        """A request with no blocks yet: share the cached blocks that hold the longest prefix of
        `tokens` within its first `limit` tokens (the caller leaves at least one token to compute,
        which yields the logits to sample from). Returns how many tokens they hold (a multiple
        of block_size; 0 with prefix caching off). Nothing is counted: `count_lookup` does that
        once the request is admitted."""
        if not self.prefix_cache or request_id in self._tables:
            return 0
        table: list[int] = []
        keys: list[BlockKey] = []
        for key in prompt_keys(tokens, self.block_size, self.salt, limit):
            block = self._block_of.get(key)
            if block is None:
                break
            if self._refs[block] == 0:
                del self._evictable[block]
            self._refs[block] += 1
            table.append(block)
            keys.append(key)
        if table:
            self._tables[request_id] = table
            self._keys[request_id] = keys
        return len(table) * self.block_size

    def count_lookup(self, num_tokens: int, num_hit: int) -> None:
        """A request was admitted: `num_tokens` looked up, `num_hit` of them found cached."""
        if self.prefix_cache:
            self.prefix_queries += num_tokens
            self.prefix_hits += num_hit

    def allocate(self, request_id: str, total_tokens: int) -> list[int] | None:
        """Grow the request's table to hold `total_tokens` tokens.

        All or nothing: returns the newly added block ids (possibly none), or None, with nothing
        changed, when there are not enough free blocks (cached ones no request holds count as
        free: the least recently used are evicted)."""
        table = self._tables.get(request_id)
        have = len(table) if table is not None else 0
        need = self.blocks_for_tokens(total_tokens) - have
        if need <= 0:
            if table is None:
                self._tables[request_id] = []
            return []
        if need > self.num_free_blocks:
            return None
        new_blocks = [self._free.popleft() if self._free else self._evict() for _ in range(need)]
        for block in new_blocks:
            self._refs[block] = 1
        if table is None:
            self._tables[request_id] = new_blocks.copy()
        else:
            table.extend(new_blocks)
        return new_blocks

    def commit(self, request_id: str, num_computed: int, tokens: Callable[[int, int], Sequence[int]]) -> None:
        """The request's first `num_computed` tokens hold computed KV: key its blocks that are now
        full, so that later requests find them. `tokens(start, stop)`: the request's token ids
        in that range (asked only for blocks not keyed yet)."""
        if not self.prefix_cache:
            return
        table = self._tables.get(request_id)
        if table is None:
            return
        keys = self._keys.setdefault(request_id, [])
        full = min(num_computed // self.block_size, len(table))
        parent = keys[-1] if keys else b""
        for index in range(len(keys), full):
            start = index * self.block_size
            parent = block_key(parent, tokens(start, start + self.block_size), self.salt)
            keys.append(parent)
            block = table[index]
            if parent not in self._block_of and block not in self._key_of:
                self._block_of[parent] = block
                self._key_of[block] = parent
                if self.record_events:
                    self._touched.add(parent)

    def free(self, request_id: str) -> int:
        """The request lets go of all its blocks. Returns how many it held. A block no request
        holds any more stays cached if keyed (the request's last blocks are evicted first),
        else it goes to the front of the free pool (warm in the CPU caches, reused first)."""
        table = self._tables.pop(request_id, None)
        self._keys.pop(request_id, None)
        if not table:
            return 0
        for block in reversed(table):
            self._refs[block] -= 1
            if self._refs[block] > 0:
                continue
            if block in self._key_of:
                self._evictable[block] = None
            else:
                self._free.appendleft(block)
        return len(table)

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        key = self._key_of.pop(block)
        del self._block_of[key]
        self.evictions += 1
        if self.record_events:
            self._touched.add(key)
        return block

    @property
    def has_events(self) -> bool:
        """Keys were stored or evicted since the last `take_events`."""
        return bool(self._touched)

    def take_events(self) -> tuple[list[BlockKey], list[BlockKey]]:
        """(keys now cached, keys no longer cached) among those that changed since the last call:
        the net change, so that the two lists are disjoint and their order does not matter."""
        touched, self._touched = self._touched, set()
        stored = [k for k in touched if k in self._block_of]
        return stored, [k for k in touched if k not in self._block_of]

    def check_consistency(self) -> None:
        """Every block is held (as many times as tables list it), or free, or cached and held by
        none; keys and blocks map one to one. For tests and debugging."""
        held = [0] * self.num_blocks
        for table in self._tables.values():
            for block in table:
                held[block] += 1
        unheld = list(self._free) + list(self._evictable)
        problems = []
        if held != self._refs:
            problems.append("reference counts differ from the tables")
        if len(unheld) != len(set(unheld)) or any(held[b] for b in unheld):
            problems.append("a free block is held or listed twice")
        if sum(1 for h in held if h) + len(unheld) != self.num_blocks:
            problems.append(f"{sum(1 for h in held if h)} held + {len(unheld)} free != {self.num_blocks}")
        if any(b not in self._key_of for b in self._evictable):
            problems.append("an evictable block has no key")
        if {k: b for b, k in self._key_of.items()} != self._block_of:
            problems.append("keys and blocks do not map one to one")
        if problems:
            raise AssertionError("KV blocks inconsistent: " + "; ".join(problems))
