"""Shared-memory KV cache segments: the `shm` transport's storage (same host).

The prefill worker's whole KV cache lives in one POSIX shared-memory segment
(/dev/shm/pdserve-kv-...), so a decode worker on the same host maps it read-only and copies a
request's blocks straight out of it: one memcpy per block and layer, no serialization, no socket.

The creating process owns the segment and unlinks it on close. Python's resource tracker also
unlinks it if that process dies without closing (SIGKILL). When both are killed at once, the
owner's lock on the file is what tells a later sweep that the segment is garbage (segments.py).
An attaching process maps the file directly and never registers it with its own tracker (which
would unlink a segment that is not its own when it exits).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import threading
import warnings
from multiprocessing import shared_memory

import torch

from pdserve.errors import PdserveError
from pdserve.transfer.base import FaultInjector, KVImporter, TransferError, block_nbytes
from pdserve.transfer.segments import (
    SEGMENT_PREFIX,
    SHM_DIR,
    SegmentSpaceError,
    create_locked_segment,
    segment_name,
)

_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
_MADV_POPULATE_WRITE = 23  # not in Python's mmap module yet


class SharedSegmentError(PdserveError):
    """A shared-memory segment could not be created or opened."""


class OwnedSegment:
    """A new segment holding a tensor of `shape` and `dtype`, zero-filled."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        self.name = segment_name(os.getpid(), secrets.token_hex(4))
        self._shm: shared_memory.SharedMemory | None = None
        self._lock_fd: int | None = None
        try:
            # Locked from birth and held until close, or until this process ends however it
            # ends: what tells a sweep whether the segment still has an owner (segments.py).
            self._lock_fd = create_locked_segment(self.name, nbytes)
        except SegmentSpaceError as exc:
            raise SharedSegmentError(
                f"/dev/shm has no room for a {nbytes / 2**20:.0f} MiB KV cache segment "
                f"(`df -h /dev/shm`; lower --kv-cache-memory-gib or --num-kv-blocks): {exc}"
            ) from exc
        except OSError as exc:
            raise SharedSegmentError(
                f"cannot create a {nbytes / 2**20:.0f} MiB shared-memory segment for the KV cache "
                f"(is /dev/shm there and writable? `df -h /dev/shm`): {exc}"
            ) from exc
        try:
            # Attached by name: Python's resource tracker then removes it if this process is
            # killed alone (the common case; the lock covers the rest).
            self._shm = shared_memory.SharedMemory(name=self.name)
        except OSError as exc:
            self.close()
            raise SharedSegmentError(f"cannot map the new KV segment {self.name}: {exc}") from exc
        self._populate()
        # [shape] view over the segment; the segment is fresh, so already zero.
        self.tensor = torch.frombuffer(self._shm.buf, dtype=dtype, count=torch.Size(shape).numel()).view(
            shape
        )

    def _populate(self) -> None:
        """Map every page now, so that the first KV written into each page (a prompt, a pull
        into a worker that just started) does not pay for a page fault: several times slower
        than the copy itself."""
        # MADV_POPULATE_WRITE, Linux 5.14+: content unchanged; ~0.5 s a GiB at start, once.
        mapping = getattr(self._shm, "_mmap", None)
        if mapping is not None:
            # 2 MiB pages where transparent_hugepage/shmem_enabled allows a mapping to ask (advise,
            # within_size; ops/cpu/huge_pages.py says why): asked before the pages are mapped.
            with contextlib.suppress(OSError, ValueError, AttributeError):
                mapping.madvise(_MADV_HUGEPAGE)
            with contextlib.suppress(OSError, ValueError):
                mapping.madvise(_MADV_POPULATE_WRITE)

    def close(self) -> None:
        """Drop the mapping and remove the segment. Safe to call twice."""
        shm, self._shm = self._shm, None
        lock_fd, self._lock_fd = self._lock_fd, None
        if hasattr(self, "tensor"):
            del self.tensor  # the tensor holds an export of the buffer: release it before closing
        if shm is not None:
            # BufferError: a view is still alive somewhere; the unlink below still removes the name.
            with contextlib.suppress(BufferError):
                shm.close()
            with contextlib.suppress(FileNotFoundError):
                shm.unlink()  # and out of the resource tracker's list
        elif lock_fd is not None:  # created, never mapped
            with contextlib.suppress(FileNotFoundError):
                (SHM_DIR / self.name).unlink()
        if lock_fd is not None:
            os.close(lock_fd)  # after the unlink: a sweep never sees it ownerless


class AttachedSegment:
    """Another process's segment, mapped read-only as a tensor of `shape` and `dtype`."""

    def __init__(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        if not name.startswith(SEGMENT_PREFIX) or "/" in name:
            raise SharedSegmentError(f"not a pdserve KV segment name: {name!r}")
        path = SHM_DIR / name
        count = torch.Size(shape).numel()
        nbytes = count * torch.empty((), dtype=dtype).element_size()
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError as exc:
            raise SharedSegmentError(f"cannot open KV segment {name}: {exc}") from exc
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise SharedSegmentError(f"KV segment {name} holds {size} bytes, expected at least {nbytes}")
            self._map: mmap.mmap | None = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        # torch warns that it cannot mark the tensor read-only; the mapping is PROT_READ, so a write
        # would fault rather than corrupt the owner's cache. Nothing here writes to it.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            self.tensor = torch.frombuffer(memoryview(self._map), dtype=dtype, count=count).view(shape)
        self.name = name

    def close(self) -> None:
        mapping, self._map = self._map, None
        if mapping is None:
            return
        del self.tensor
        with contextlib.suppress(BufferError):
            mapping.close()


class ShmImporter(KVImporter):
    """Decode side of `shm`: maps the prefill worker's cache segment and copies blocks out of it."""

    def __init__(self, kv_cache: torch.Tensor, faults: FaultInjector | None = None) -> None:
        super().__init__(kv_cache, faults)
        self._segments: dict[str, AttachedSegment] = {}
        self._gone: set[str] = set()  # forgotten: their worker ended, never map them again
        self._lock = threading.Lock()

    def _source(self, address: str) -> torch.Tensor:
        with self._lock:
            if address in self._gone:
                raise TransferError(f"KV segment {address} belongs to a worker that is gone")
            segment = self._segments.get(address)
            if segment is None:
                layers, two, _, block_size, kv_heads, head_dim = self.kv_cache.shape
                per_block = block_nbytes(self.kv_cache)
                try:
                    size = (SHM_DIR / address).stat().st_size
                except OSError as exc:
                    raise TransferError(f"KV segment {address} is gone: {exc}") from exc
                # The source may have a different number of blocks; everything else must match.
                shape = (layers, two, size // per_block, block_size, kv_heads, head_dim)
                segment = AttachedSegment(address, shape, self.kv_cache.dtype)
                self._segments[address] = segment
            return segment.tensor

    def _pull(self, address: str, src_blocks: list[int], dst_blocks: list[int], timeout: float) -> int:
        source = self._source(address)
        if src_blocks and max(src_blocks) >= source.shape[2]:
            raise TransferError(
                f"block {max(src_blocks)} is outside segment {address} ({source.shape[2]} blocks)"
            )
        # One strided copy per run of blocks consecutive on both sides, straight from the mapping
        # into our cache: [L, 2, n, BS, KVH, D]. (An indexed gather then scatter went through a
        # temporary and ran at a fraction of memcpy speed.)
        for src_start, dst_start, n in _runs(src_blocks, dst_blocks):
            self.kv_cache[:, :, dst_start : dst_start + n].copy_(source[:, :, src_start : src_start + n])
        return len(src_blocks) * block_nbytes(self.kv_cache)

    def forget(self, address: str) -> None:
        """Unmap a source that went away (its worker died), so its memory can be reclaimed."""
        with self._lock:
            segment = self._segments.pop(address, None)
            self._gone.add(address)
        if segment is not None:
            segment.close()

    def close(self) -> None:
        with self._lock:
            segments, self._segments = list(self._segments.values()), {}
        for segment in segments:
            segment.close()


def _runs(src: list[int], dst: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the maximal runs where both lists count up by one."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if runs:
            s0, d0, n = runs[-1]
            if s == s0 + n and d == d0 + n:
                runs[-1] = (s0, d0, n + 1)
                continue
        runs.append((s, d, 1))
    return runs
