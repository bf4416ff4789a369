"""Staged KV transfer (a cache with no byte view here: on a GPU, or a private CPU cache standing in
for one): chunk plans that cover the stream, blocks byte-exact whichever side stages, in one chunk
or many, a cut stream that copies nothing it did not get, the checksum over staged blocks, and the
same over a real GPU where there is one."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pdserve.transfer import staging
from pdserve.transfer.checksum import kv_digest
from pdserve.transfer.layout import block_views, cache_bytes, layout_of
from pdserve.transfer.staging import StagedBlocks
from pdserve.transfer.tcp import TcpExporter, TcpImporter

SECRET = bytes(range(32))
SHAPE = (3, 2, 16, 4, 2, 8)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]
PIECE = 4 * 2 * 8 * 2  # bytes of one block of one plane, bf16


def source_cache(device: str = "cpu") -> torch.Tensor:
    torch.manual_seed(3)
    return torch.randn(SHAPE).to(torch.bfloat16).to(device)


def stream(kv_cache: torch.Tensor, blocks: list[int]) -> bytes:
    """The blocks' bytes in stream order, as a direct (unstaged) side sends them."""
    num_blocks, pieces, piece, _ = layout_of(kv_cache)
    return b"".join(bytes(v) for v in block_views(cache_bytes(kv_cache), num_blocks, pieces, piece, blocks))


@pytest.mark.parametrize("count", [1, 3, 16])
@pytest.mark.parametrize("chunk_bytes", [PIECE, 3 * PIECE, 5 * 3 * PIECE, 1 << 20])
def test_chunks_cover_the_stream_once_in_order(count: int, chunk_bytes: int) -> None:
    staged = StagedBlocks(source_cache(), chunk_bytes)
    covered = [
        (p, j) for p0, p1, j0, j1 in staged.chunks(count) for p in range(p0, p1) for j in range(j0, j1)
    ]
    assert covered == [(p, j) for p in range(6) for j in range(count)]
    for p0, p1, j0, j1 in staged.chunks(count):
        assert (p1 - p0) * (j1 - j0) * PIECE <= chunk_bytes
        assert p1 - p0 == 1 or (j0, j1) == (0, count)  # whole planes, or a run within one


@pytest.mark.parametrize("chunk_bytes", [PIECE, 2 * PIECE, 4 * 6 * PIECE, 1 << 20])
def test_what_a_staged_side_sends_is_the_direct_stream_and_lands_where_asked(chunk_bytes: int) -> None:
    cache = source_cache()
    blocks = [9, 2, 3, 11]
    sent: list[bytes] = []
    assert (
        StagedBlocks(cache, chunk_bytes).send(blocks, lambda view: sent.append(bytes(view))) == 4 * 6 * PIECE
    )
    assert b"".join(sent) == stream(cache, blocks)
    assert len(sent) == len(StagedBlocks(cache, chunk_bytes).chunks(4))

    landed = torch.zeros(SHAPE, dtype=torch.bfloat16)
    wire = b"".join(sent)

    def receive(view: memoryview) -> int:
        nonlocal wire
        view[:] = wire[: len(view)]
        wire = wire[len(view) :]
        return len(view)

    assert StagedBlocks(landed, chunk_bytes).receive([5, 0, 1, 3], receive) == 4 * 6 * PIECE
    for src, dst in zip(blocks, [5, 0, 1, 3], strict=True):
        assert torch.equal(landed[:, :, dst].view(torch.int16), cache[:, :, src].view(torch.int16))
    untouched = [b for b in range(16) if b not in (5, 0, 1, 3)]
    assert torch.count_nonzero(landed[:, :, untouched].float()) == 0


def test_a_cut_stream_copies_only_the_chunks_that_arrived_whole() -> None:
    cache = source_cache()
    wire = stream(cache, [0, 1])
    landed = torch.zeros(SHAPE, dtype=torch.bfloat16)
    calls = 0

    def receive(view: memoryview) -> int:  # the first chunk whole, then half of the second
        nonlocal calls
        calls += 1
        part = wire[: len(view)] if calls == 1 else wire[2 * PIECE : 2 * PIECE + len(view) // 2]
        view[: len(part)] = part
        return len(part)

    got = StagedBlocks(landed, 2 * PIECE).receive([0, 1], receive)  # one plane of 2 blocks a chunk
    assert got == 2 * PIECE + PIECE and calls == 2
    assert torch.equal(landed[0, 0, :2], cache[0, 0, :2])  # plane 0: copied
    assert torch.count_nonzero(landed[0, 1].float()) == 0  # plane 1 was cut: nothing of it copied
    assert torch.count_nonzero(landed[1:].float()) == 0


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(staging, "CHUNK_BYTES", 3 * PIECE)  # many chunks of both kinds


def pair(
    exporter_staged: bool | None, importer_staged: bool | None, device: str = "cpu"
) -> Iterator[tuple[TcpExporter, TcpImporter]]:
    exporter = TcpExporter(source_cache(device), secret=SECRET, staged=exporter_staged)
    importer = TcpImporter(
        torch.zeros(SHAPE, dtype=torch.bfloat16, device=device), secret=SECRET, staged=importer_staged
    )
    try:
        yield exporter, importer
    finally:
        importer.close()
        exporter.close()


@pytest.mark.parametrize(("exporter_staged", "importer_staged"), [(True, False), (False, True), (True, True)])
def test_tcp_pulls_are_byte_exact_whichever_side_stages(
    small_chunks: None, exporter_staged: bool, importer_staged: bool
) -> None:
    for exporter, importer in pair(exporter_staged, importer_staged):
        blocks, into = [14, 2, 3, 4, 9], [0, 7, 8, 9, 1]
        token = exporter.register("r", blocks)
        digest = kv_digest(exporter.kv_cache, blocks)
        moved = importer.pull(
            exporter.address, blocks, into, 10.0, request_id="r", lease_token=token, digest=digest
        )
        assert moved == 5 * 6 * PIECE == importer.stats.bytes
        for src, dst in zip(blocks, into, strict=True):
            assert torch.equal(importer.kv_cache[:, :, dst], exporter.kv_cache[:, :, src])
        exporter.unregister("r")


def test_a_staged_exporter_still_serves_only_leased_blocks(small_chunks: None) -> None:
    for exporter, importer in pair(True, True):
        token = exporter.register("r", [1, 2])
        with pytest.raises(Exception, match=r"not under lease.*\[5\]"):
            importer.pull(exporter.address, [1, 5], [0, 1], 5.0, request_id="r", lease_token=token)
        assert torch.count_nonzero(importer.kv_cache.float()) == 0
        assert importer.stats.failures == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_caches_move_over_tcp_through_pinned_buffers(small_chunks: None) -> None:
    for exporter, importer in pair(None, None, "cuda"):  # staged because the caches are on the GPU
        blocks, into = [14, 2, 3, 4, 9], [0, 7, 8, 9, 1]
        token = exporter.register("r", blocks)
        digest = kv_digest(exporter.kv_cache, blocks)
        importer.pull(exporter.address, blocks, into, 10.0, request_id="r", lease_token=token, digest=digest)
        for src, dst in zip(blocks, into, strict=True):
            assert torch.equal(importer.kv_cache[:, :, dst], exporter.kv_cache[:, :, src])
