"""Measures KV pulls on this machine (torch): the real transports (`shm`, `tcp`) between two caches
of the model's block shape and dtype, with the deployment's checksum check, for a range of block
counts; fitted to base + per block (least squares on the medians)."""

from __future__ import annotations

import secrets
import statistics
import time

import torch

from pdserve.sim.profile import TransferTime
from pdserve.transfer.checksum import kv_block_digests

BLOCK_COUNTS = (1, 4, 16, 64, 256)
QUICK_BLOCK_COUNTS = (1, 4, 16)


def cache_shape(
    num_layers: int, blocks: int, block_size: int, kv_heads: int, head_dim: int
) -> tuple[int, ...]:
    return (num_layers, 2, blocks, block_size, kv_heads, head_dim)  # [L, 2, NB, BS, KVH, D]


def _timed_pulls(
    pull: object, counts: tuple[int, ...], repeats: int, source: torch.Tensor
) -> list[tuple[int, float]]:
    medians = []
    for n in counts:
        blocks = list(range(n))
        digest = kv_block_digests(source, blocks)  # as a worker's lease carries them
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            pull(blocks, digest)  # type: ignore[operator]
            times.append(time.perf_counter() - started)
        medians.append((n, statistics.median(times)))
    return medians


def measure(
    transport: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    counts: tuple[int, ...] = BLOCK_COUNTS,
    repeats: int = 5,
    checksum: bool = True,
) -> TransferTime:
    """Times pulls of each count of blocks over `transport` (shm or tcp); `shape` is a cache of at
    least max(counts) blocks."""
    source_data = torch.randn(shape).to(dtype)
    local = torch.zeros(shape, dtype=dtype)
    if transport == "shm":
        from pdserve.transfer.shm import OwnedSegment, ShmImporter

        segment = OwnedSegment(shape, dtype)
        segment.tensor.copy_(source_data)
        importer = ShmImporter(local)
        try:
            samples = _timed_pulls(
                lambda blocks, digest: importer.pull(
                    segment.name, blocks, blocks, 30.0, block_digests=digest if checksum else ()
                ),
                counts,
                repeats,
                segment.tensor,
            )
        finally:
            importer.close()
            segment.close()
    elif transport == "tcp":
        from pdserve.transfer.tcp import TcpExporter, TcpImporter

        secret = secrets.token_bytes(32)
        exporter = TcpExporter(source_data, secret=secret)
        tcp = TcpImporter(local, secret=secret)
        token = exporter.register("probe", list(range(shape[2])))
        try:
            samples = _timed_pulls(
                lambda blocks, digest: tcp.pull(
                    exporter.address,
                    blocks,
                    blocks,
                    30.0,
                    request_id="probe",
                    lease_token=token,
                    block_digests=digest if checksum else (),
                ),
                counts,
                repeats,
                source_data,
            )
        finally:
            tcp.close()
            exporter.close()
    else:
        raise ValueError(f"cannot measure the {transport} transport here (shm or tcp)")
    base, per_block = _line(samples)
    return TransferTime(base, per_block, [(n, round(s, 6)) for n, s in samples])


def _line(samples: list[tuple[int, float]]) -> tuple[float, float]:
    """Least squares seconds = base + per_block * n, both kept >= 0."""
    xs = [float(n) for n, _ in samples]
    ys = [s for _, s in samples]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var if var else 0.0
    slope = max(0.0, slope)
    return max(0.0, my - slope * mx), slope
