"""Blocks of a KV cache that has no byte view on this host (a GPU cache; in tests a private CPU
cache standing in for one), read and written through host buffers in the stream order of
pdserve.transfer.layout, so that a staged side and a direct side interoperate on the same wire.

A transfer of n blocks is cut into chunks that are contiguous ranges of that stream: several whole
(layer, K/V) planes of the n blocks when one plane fits a chunk, else a run of the blocks of one
plane. Each chunk is one gather (`index_select`) into a host buffer or one scatter (`index_copy_`)
out of it. Two buffers per transfer, so that on a GPU the copy of one chunk (device <-> pinned
host, on a side stream) overlaps the network on the other: the sender gathers chunk i + 1 while
chunk i is sent, the receiver copies chunk i into its blocks while chunk i + 1 arrives. On a CPU
cache the copies are synchronous and the same code runs (that is what the CPU tests exercise).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

import torch

# Bytes of one staging buffer: big enough that a chunk's copy and send cost far more than the
# per-chunk overhead, small enough that two per concurrent transfer stay cheap in pinned memory.
CHUNK_BYTES = 4 << 20


class StagedBlocks:
    """Gathers and scatters blocks of `kv_cache` ([L, 2, NB, BS, KVH, D], contiguous) through
    host buffers. Thread-safe: concurrent transfers each take their own pair of buffers."""

    def __init__(self, kv_cache: torch.Tensor, chunk_bytes: int | None = None) -> None:
        """`chunk_bytes`: of one staging buffer (default CHUNK_BYTES)."""
        if not kv_cache.is_contiguous():
            raise ValueError("staging needs one contiguous KV cache tensor")
        layers, two, num_blocks, block_size, kv_heads, head_dim = kv_cache.shape
        self.kv_cache = kv_cache
        self._planes = kv_cache.view(layers * two, num_blocks, block_size * kv_heads * head_dim)  # [P, NB, E]
        self._piece = (
            block_size * kv_heads * head_dim * kv_cache.element_size()
        )  # bytes of a block in a plane
        self._chunk_bytes = max(CHUNK_BYTES if chunk_bytes is None else chunk_bytes, self._piece)
        self._cuda = kv_cache.device.type == "cuda"
        self._free: list[tuple[torch.Tensor, torch.Tensor]] = []  # idle buffer pairs, [chunk_bytes] uint8
        self._lock = threading.Lock()

    @property
    def device(self) -> torch.device:
        return self.kv_cache.device

    def chunks(self, count: int) -> list[tuple[int, int, int, int]]:
        """(first plane, end plane, first block, end block) of each chunk of a transfer of `count`
        blocks, in stream order."""
        planes = self._planes.shape[0]
        per_plane = count * self._piece
        if per_plane <= self._chunk_bytes:
            step = self._chunk_bytes // per_plane
            return [(p, min(p + step, planes), 0, count) for p in range(0, planes, step)]
        step = self._chunk_bytes // self._piece
        return [(p, p + 1, j, min(j + step, count)) for p in range(planes) for j in range(0, count, step)]

    def send(self, blocks: Sequence[int], send: Callable[[memoryview], None]) -> int:
        """Gathers `blocks` chunk by chunk and hands each chunk's bytes to `send` (which must be done
        with them when it returns). Returns the bytes sent."""
        if not blocks:
            return 0
        index = torch.tensor(list(blocks), dtype=torch.long, device=self.device)
        chunks = self.chunks(len(blocks))
        pair = self._take()
        side = self._side_stream()
        ready: list[torch.cuda.Event | None] = [None, None]
        total = 0

        def gather(i: int) -> torch.Tensor:
            p0, p1, j0, j1 = chunks[i]
            host = self._view(pair[i % 2], p1 - p0, j1 - j0)  # [planes, blocks, E]
            source = self._planes[p0:p1].index_select(1, index[j0:j1])
            if side is None:
                host.copy_(source)
            else:  # issued on the side stream: the caller waits on `ready` before reading host
                with torch.cuda.stream(side):
                    host.copy_(source, non_blocking=True)
                    event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                    event.record(side)
                    ready[i % 2] = event
            return host

        try:
            if side is not None:  # after whatever the engine has queued (the prefill that wrote them)
                side.wait_stream(torch.cuda.default_stream(self.device))
            current = gather(0)
            for i in range(len(chunks)):
                event = ready[i % 2]
                if event is not None:
                    event.synchronize()
                following = None
                if i + 1 < len(chunks):  # the next chunk's copy overlaps this chunk's send
                    following = gather(i + 1)
                view = _bytes(current)
                send(view)
                total += len(view)
                if following is not None:
                    current = following
            return total
        finally:
            if side is not None:
                side.synchronize()  # no copy may still write a buffer handed back
            self._give(pair)

    def receive(self, blocks: Sequence[int], receive: Callable[[memoryview], int]) -> int:
        """Fills each chunk's bytes with `receive` (which returns how many it got) and copies the
        chunk into `blocks`. Returns the bytes received: short if `receive` came back short, and
        then the chunk that was cut is not copied (the caller frees the blocks)."""
        if not blocks:
            return 0
        index = torch.tensor(list(blocks), dtype=torch.long, device=self.device)
        pair = self._take()
        side = self._side_stream()
        copied: list[torch.cuda.Event | None] = [None, None]
        total = 0
        try:
            for i, (p0, p1, j0, j1) in enumerate(self.chunks(len(blocks))):
                event = copied[i % 2]
                if event is not None:
                    event.synchronize()  # this buffer's previous chunk is in the cache: reuse it
                host = self._view(pair[i % 2], p1 - p0, j1 - j0)  # [planes, blocks, E]
                view = _bytes(host)
                got = receive(view)
                total += got
                if got < len(view):
                    return total
                target = self._planes[p0:p1]
                if side is None:
                    target.index_copy_(1, index[j0:j1], host)
                else:  # overlaps the next chunk's arrival
                    with torch.cuda.stream(side):
                        target.index_copy_(1, index[j0:j1], host.to(self.device, non_blocking=True))
                        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                        event.record(side)
                        copied[i % 2] = event
            return total
        finally:
            if side is not None:
                side.synchronize()  # the blocks are in place before the caller uses or hashes them
            self._give(pair)

    # -- buffers ----------------------------------------------------------------------------------
    def _side_stream(self) -> torch.cuda.Stream | None:
        return torch.cuda.Stream(device=self.device) if self._cuda else None  # type: ignore[no-untyped-call]

    def _take(self) -> tuple[torch.Tensor, torch.Tensor]:
        with self._lock:
            if self._free:
                return self._free.pop()
        return (self._buffer(), self._buffer())

    def _give(self, pair: tuple[torch.Tensor, torch.Tensor]) -> None:
        with self._lock:
            self._free.append(pair)

    def _buffer(self) -> torch.Tensor:
        # Pinned on a GPU host: the copies then run asynchronously on the copy engine.
        return torch.empty(self._chunk_bytes, dtype=torch.uint8, pin_memory=self._cuda)

    def _view(self, buffer: torch.Tensor, planes: int, blocks: int) -> torch.Tensor:
        elements = self._planes.shape[2]
        nbytes = planes * blocks * self._piece
        return buffer[:nbytes].view(self.kv_cache.dtype).view(planes, blocks, elements)


def _bytes(host: torch.Tensor) -> memoryview:
    """A contiguous host tensor's bytes, writable, without a copy."""
    return host.reshape(-1).view(torch.uint8).numpy().data
