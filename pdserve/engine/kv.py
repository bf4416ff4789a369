"""KV-cache block manager. Pure Python: it hands out block ids; the model runner owns the tensors.

The cache is `num_blocks` fixed-size blocks of `block_size` token slots. Each request owns a block
table (an ordered list of block ids) covering its computed tokens plus the tokens being computed
this step. Token `i` of a request lives in slot `table[i // block_size] * block_size + i % block_size`.
"""

from __future__ import annotations

from collections import deque


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    # -- queries -----------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def spare_block(self) -> int | None:
        """A block no request holds (the one next to be handed out last), or None if none is free.
        It stays free: what is written to it is scratch (a padded decode step's extra rows), as a
        block's slots are always written before they are read once it is allocated."""
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
        return self.blocks_for_tokens(total_tokens) - have <= len(self._free)

    @property
    def request_ids(self) -> list[str]:
        return list(self._tables)

    # -- changes -----------------------------------------------------------------------------------
    def allocate(self, request_id: str, total_tokens: int) -> list[int] | None:
        """Grow the request's table to hold `total_tokens` tokens.

        All or nothing: returns the newly added block ids (possibly none), or None, with nothing
        changed, when there are not enough free blocks."""
        table = self._tables.get(request_id)
        have = len(table) if table is not None else 0
        need = self.blocks_for_tokens(total_tokens) - have
        if need <= 0:
            if table is None:
                self._tables[request_id] = []
            return []
        if need > len(self._free):
            return None
        new_blocks = [self._free.popleft() for _ in range(need)]
        if table is None:
            self._tables[request_id] = new_blocks.copy()
        else:
            table.extend(new_blocks)
        return new_blocks

    def free(self, request_id: str) -> int:
        """Return every block of the request to the free pool. Returns how many were freed."""
        table = self._tables.pop(request_id, None)
        if not table:
            return 0
        # Freed blocks go to the front: they are warm in the CPU caches and reused first.
        self._free.extendleft(reversed(table))
        return len(table)

    def check_consistency(self) -> None:
        """Every block is either free or owned by exactly one request. For tests and debugging."""
        owned = [b for table in self._tables.values() for b in table]
        seen = owned + list(self._free)
        if len(seen) != self.num_blocks or set(seen) != set(range(self.num_blocks)):
            raise AssertionError(
                f"KV blocks inconsistent: {len(owned)} owned + {len(self._free)} free != {self.num_blocks}"
            )
