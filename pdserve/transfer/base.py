"""The KV transfer interface, split by side (torch).

The exporting (prefill) side owns a KV cache tensor and publishes an `address` through which its
blocks can be read while they are under lease. The importing (decode) side pulls a list of source
blocks into its own block ids. Both sides count bytes, time and failures; a failed pull raises
`TransferError` and is never papered over here: the caller reports it and the router retries.

Cache layout on both sides: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], so a
block id indexes axis 2.
"""

from __future__ import annotations

import abc
import random
import threading
import time
from dataclasses import dataclass, field

import torch

from pdserve.errors import PdserveError


class TransferError(PdserveError):
    """A KV pull failed or timed out. The request's blocks on the decode side must be freed."""


@dataclass
class TransferStats:
    pulls: int = 0
    failures: int = 0
    bytes: int = 0
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, nbytes: int, seconds: float, ok: bool) -> None:
        with self._lock:
            self.pulls += 1
            self.seconds += seconds
            if ok:
                self.bytes += nbytes
            else:
                self.failures += 1


class FaultInjector:
    """Makes a fraction of pulls fail on purpose, for fault tests (`--kv-fault-rate`)."""

    def __init__(self, rate: float = 0.0, seed: int = 0) -> None:
        if not 0.0 <= rate <= 1.0:
            raise ValueError(f"fault rate must be in [0, 1], got {rate}")
        self.rate = rate
        self._rng = random.Random(seed)

    def maybe_fail(self, what: str) -> None:
        if self.rate and self._rng.random() < self.rate:
            raise TransferError(f"injected fault: {what} dropped")


class KVImporter(abc.ABC):
    """Decode side: brings blocks of another worker's cache into this worker's cache."""

    def __init__(self, kv_cache: torch.Tensor, faults: FaultInjector | None = None) -> None:
        self.kv_cache = kv_cache  # [L, 2, NB, BS, KVH, D], this worker's cache
        self.stats = TransferStats()
        self.faults = faults or FaultInjector()

    def pull(self, address: str, src_blocks: list[int], dst_blocks: list[int], timeout: float) -> int:
        """Copy `src_blocks` of the cache at `address` into `dst_blocks` here. Returns bytes moved."""
        if len(src_blocks) > len(dst_blocks):
            raise TransferError(
                f"{len(src_blocks)} source blocks but only {len(dst_blocks)} destination blocks"
            )
        started = time.perf_counter()
        nbytes = 0
        try:
            self.faults.maybe_fail(f"pull of {len(src_blocks)} blocks from {address}")
            nbytes = self._pull(address, src_blocks, dst_blocks[: len(src_blocks)], timeout)
        except TransferError:
            self.stats.record(0, time.perf_counter() - started, ok=False)
            raise
        except Exception as exc:  # a transport bug or an OS error is still a failed transfer
            self.stats.record(0, time.perf_counter() - started, ok=False)
            raise TransferError(f"pull from {address} failed: {exc}") from exc
        self.stats.record(nbytes, time.perf_counter() - started, ok=True)
        return nbytes

    @abc.abstractmethod
    def _pull(self, address: str, src_blocks: list[int], dst_blocks: list[int], timeout: float) -> int: ...

    def close(self) -> None:  # noqa: B027 (optional hook)
        pass


def block_nbytes(kv_cache: torch.Tensor) -> int:
    """Bytes of one block across all layers and K/V."""
    layers, two, _, block_size, kv_heads, head_dim = kv_cache.shape
    return layers * two * block_size * kv_heads * head_dim * kv_cache.element_size()
