"""The KV transfer interface, split by side (torch).

The exporting (prefill) side owns a KV cache tensor and publishes an `address` through which its
blocks can be read while they are under lease (`KVExporter`, for transports that serve reads; the
`shm` segment needs no server). The importing (decode) side pulls a list of source blocks into its
own block ids, naming the request whose lease covers them. Both sides count bytes, time and failures; a failed pull raises
`TransferError` and is never papered over here: the caller reports it and the router retries.

Cache layout on both sides: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim], so a
block id indexes axis 2.
"""

from __future__ import annotations

import abc
import hmac
import random
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pdserve.errors import PdserveError
from pdserve.transfer.checksum import kv_block_digests, kv_digest


class TransferError(PdserveError):
    """A KV pull failed or timed out. The request's blocks on the decode side must be freed."""


class ChecksumError(TransferError):
    """The blocks that arrived are not the blocks the holder leased (see transfer/checksum.py)."""


@dataclass
class TransferStats:
    pulls: int = 0
    failures: int = 0
    checksum_failures: int = 0  # of `failures`: the blocks arrived, but not as the holder had them
    bytes: int = 0
    seconds: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, nbytes: int, seconds: float, ok: bool, checksum_failed: bool = False) -> None:
        with self._lock:
            self.pulls += 1
            self.seconds += seconds
            if ok:
                self.bytes += nbytes
            else:
                self.failures += 1
                self.checksum_failures += checksum_failed


class FaultInjector:
    """Makes a fraction of pulls fail (`--kv-fault-rate`) or land with one bit flipped
    (`--kv-corrupt-rate`) on purpose, for fault tests."""

    def __init__(self, rate: float = 0.0, seed: int = 0, corrupt_rate: float = 0.0) -> None:
        for name, value in (("fault rate", rate), ("corrupt rate", corrupt_rate)):
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        self.rate = rate
        self.corrupt_rate = corrupt_rate
        self._rng = random.Random(seed)

    def maybe_fail(self, what: str) -> None:
        if self.rate and self._rng.random() < self.rate:
            raise TransferError(f"injected fault: {what} dropped")

    def maybe_corrupt(self, kv_cache: torch.Tensor, dst_blocks: Sequence[int]) -> None:
        """Flip one bit of one of the blocks that just landed, as a bad link or memory would."""
        if not (self.corrupt_rate and dst_blocks and self._rng.random() < self.corrupt_rate):
            return
        block = kv_cache[:, :, self._rng.choice(list(dst_blocks))]  # [L, 2, BS, KVH, D], a view
        flat = block.reshape(-1)  # a copy when the view is not contiguous: written back below
        position = self._rng.randrange(flat.numel())
        as_int = flat[position : position + 1].view(_INT_OF_SIZE[flat.element_size()])
        as_int ^= 1 << self._rng.randrange(8 * flat.element_size() - 1)
        block.copy_(flat.view(block.shape))


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class KVImporter(abc.ABC):
    """Decode side: brings blocks of another worker's cache into this worker's cache."""

    def __init__(self, kv_cache: torch.Tensor, faults: FaultInjector | None = None) -> None:
        self.kv_cache = kv_cache  # [L, 2, NB, BS, KVH, D], this worker's cache
        self.stats = TransferStats()
        self.faults = faults or FaultInjector()

    def pull(
        self,
        address: str,
        src_blocks: list[int],
        dst_blocks: list[int],
        timeout: float,
        *,
        request_id: str = "",
        lease_token: bytes = b"",
        digest: str = "",
        block_digests: Sequence[str] = (),
    ) -> int:
        """Copy `src_blocks` of the cache at `address` into `dst_blocks` here. Returns bytes moved.

        With `digest` (the holder's `kv_digest` of `src_blocks`), or `block_digests` (its
        `kv_block_digests` of them, one per block), what landed is hashed and a difference is a
        ChecksumError: the blocks are not used.

        `request_id` names the prefill side's lease on `src_blocks` and `lease_token` proves the
        right to it (the holder made it, unguessable, and put it in the KVHandle); transports whose
        exporter checks leases (tcp, nixl) refuse a pull without both, so a late pull can never
        read blocks that were freed and reused by another request, nor a stranger any block."""
        if len(src_blocks) > len(dst_blocks):
            raise TransferError(
                f"{len(src_blocks)} source blocks but only {len(dst_blocks)} destination blocks"
            )
        num_blocks = self.kv_cache.shape[2]
        if dst_blocks and max(dst_blocks) >= num_blocks:
            raise TransferError(
                f"destination block {max(dst_blocks)} is outside this cache ({num_blocks} blocks)"
            )
        started = time.perf_counter()
        nbytes = 0
        try:
            self.faults.maybe_fail(f"pull of {len(src_blocks)} blocks from {address}")
            landed = dst_blocks[: len(src_blocks)]
            nbytes = self._pull_request(request_id, lease_token, address, src_blocks, landed, timeout)
            self.faults.maybe_corrupt(self.kv_cache, landed)
            if digest and (got := kv_digest(self.kv_cache, landed)) != digest:
                raise ChecksumError(
                    f"KV checksum mismatch on {len(landed)} blocks pulled from {address}: the "
                    f"holder's digest is {digest}, what arrived hashes to {got}"
                )
            if block_digests:
                arrived = kv_block_digests(self.kv_cache, landed)
                bad = [i for i, (a, b) in enumerate(zip(arrived, block_digests, strict=True)) if a != b]
                if bad:
                    raise ChecksumError(
                        f"KV checksum mismatch on {len(bad)} of {len(landed)} blocks pulled from {address} "
                        f"(the first: block {src_blocks[bad[0]]} there, {landed[bad[0]]} here)"
                    )
        except ChecksumError:
            self.stats.record(0, time.perf_counter() - started, ok=False, checksum_failed=True)
            raise
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

    def _pull_request(
        self,
        request_id: str,
        lease_token: bytes,
        address: str,
        src_blocks: list[int],
        dst_blocks: list[int],
        timeout: float,
    ) -> int:
        """Backends that name the lease to the exporter override this; the others ignore it."""
        return self._pull(address, src_blocks, dst_blocks, timeout)

    def forget(self, address: str) -> None:  # noqa: B027 (optional hook)
        """The worker at `address` is gone: drop what is kept for it (a mapping, connections)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        pass


def block_nbytes(kv_cache: torch.Tensor) -> int:
    """Bytes of one block across all layers and K/V."""
    layers, two, _, block_size, kv_heads, head_dim = kv_cache.shape
    return layers * two * block_size * kv_heads * head_dim * kv_cache.element_size()


class LeaseError(PdserveError):
    """A read of blocks that are not under a live lease of the named request."""


LEASE_TOKEN_BYTES = 16


@dataclass
class _Lease:
    blocks: frozenset[int]
    token: bytes
    readers: int = 0  # reads of these blocks in flight
    revoked: bool = False  # ended while a read was still in flight (that read must fail)
    aborts: list[Callable[[], None]] = field(default_factory=list)  # stop the in-flight reads


class LeaseTable:
    """Which blocks of the exporter's cache may be read, per request, and who is reading them.

    The worker registers a request's blocks when it is prefilled and unregisters them before it
    frees them (Release, Abort, lease expiry). `unregister` waits for reads in flight, and after a
    grace period aborts them, so a block is never freed, reused and then sent under an old lease.
    Thread-safe: the engine thread registers, the transport's threads read."""

    def __init__(self) -> None:
        self._leases: dict[str, _Lease] = {}
        self._changed = threading.Condition()

    def register(self, request_id: str, block_ids: Sequence[int]) -> bytes:
        """Lease `block_ids` under `request_id`; returns the lease's token, which a read must show."""
        token = secrets.token_bytes(LEASE_TOKEN_BYTES)
        with self._changed:
            self._leases[request_id] = _Lease(frozenset(block_ids), token)
        return token

    def unregister(self, request_id: str, grace: float = 1.0) -> bool:
        """End the lease. Returns False if reads were still in flight after `grace` seconds and
        were aborted (they report a failure to their importer)."""
        with self._changed:
            lease = self._leases.pop(request_id, None)
            if lease is None or self._changed.wait_for(lambda: lease.readers == 0, timeout=grace):
                return True
            lease.revoked = True
            aborts = list(lease.aborts)
        for abort in aborts:  # outside the lock: an abort may wake a reader that takes it
            abort()
        with self._changed:
            # An aborted read ends at once (its socket is shut); the bound only guards a bug.
            self._changed.wait_for(lambda: lease.readers == 0, timeout=grace)
        return False

    def acquire(
        self, request_id: str, token: bytes, block_ids: Sequence[int], abort: Callable[[], None]
    ) -> _Lease:
        """Start a read of `block_ids` under `request_id`'s lease, whose token is `token`; `abort`
        stops it if the lease must end before the read does. Pair with `release`."""
        with self._changed:
            lease = self._leases.get(request_id)
            if lease is None:
                raise LeaseError(f"request {request_id!r} holds no lease here (released or expired)")
            if not hmac.compare_digest(token, lease.token):
                raise LeaseError(f"wrong lease token for request {request_id!r}")
            outside = sorted(set(block_ids) - lease.blocks)
            if outside:
                raise LeaseError(f"blocks {outside[:8]} are not under the lease of request {request_id!r}")
            lease.readers += 1
            lease.aborts.append(abort)
            return lease

    def release(self, lease: _Lease, abort: Callable[[], None]) -> bool:
        """End a read. False if the lease ended during it (the data read may be torn)."""
        with self._changed:
            lease.readers -= 1
            lease.aborts.remove(abort)
            self._changed.notify_all()
            return not lease.revoked

    def __len__(self) -> int:
        with self._changed:
            return len(self._leases)


class KVExporter(abc.ABC):
    """Prefill side of a transport that serves reads: publishes `address`, serves the blocks of
    requests under lease, counts what it served (`stats`)."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        if not kv_cache.is_contiguous():
            raise ValueError("the exported KV cache must be one contiguous tensor")
        self.kv_cache = kv_cache  # [L, 2, NB, BS, KVH, D], this worker's cache
        self.leases = LeaseTable()
        self.stats = TransferStats()
        self.refused_connections = 0  # failed the handshake (no or a wrong deployment key)

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """What goes into `KVHandle.address`."""

    def register(self, request_id: str, block_ids: Sequence[int]) -> bytes:
        """The request's blocks may now be read (it is prefilled and under lease) by whoever shows
        the token returned (it goes in the KVHandle)."""
        return self.leases.register(request_id, block_ids)

    def unregister(self, request_id: str) -> None:
        """The request's blocks are about to be freed: no read of them may be in flight after this."""
        self.leases.unregister(request_id)

    @abc.abstractmethod
    def close(self) -> None:
        """Stop serving; every thread and socket of the exporter is gone when this returns."""
