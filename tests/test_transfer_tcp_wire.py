"""The `tcp` transport's wire format and socket I/O, without an exporter: addresses, block ids, the
block stream's views of a cache, and whole-buffer sends and receives over a socket pair."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from pdserve.transfer.base import TransferError
from pdserve.transfer.tcp_wire import (
    block_views,
    cache_bytes,
    layout_of,
    pack_ids,
    parse_address,
    recv_exact,
    recv_views,
    send_views,
    unpack_ids,
)


def test_addresses_parse_with_and_without_brackets() -> None:
    assert parse_address("10.0.0.7:5555") == ("10.0.0.7", 5555)
    assert parse_address("[::1]:80") == ("::1", 80)
    for bad in ("pdserve-kv-123-abc", "host:", "host:port"):
        with pytest.raises(TransferError, match="host:port"):
            parse_address(bad)


def test_block_ids_are_little_endian_uint32() -> None:
    ids = [0, 1, 258, 2**32 - 1]
    assert pack_ids(ids)[:12] == b"\0\0\0\0\1\0\0\0\2\1\0\0"
    assert unpack_ids(pack_ids(ids)) == ids


def test_block_views_follow_the_stream_order_one_view_per_run() -> None:
    cache = torch.arange(2 * 2 * 8 * 3, dtype=torch.float32).reshape(2, 2, 8, 3)  # [L, K/V, NB, piece]
    num_blocks, pieces, piece, dtype = layout_of(cache.view(2, 2, 8, 1, 1, 3))
    assert (num_blocks, pieces, piece, dtype) == (8, 4, 12, b"float32")
    blocks = [5, 6, 7, 2, 0, 1]  # three runs: 5-7, 2, 0-1
    views = list(block_views(cache_bytes(cache), num_blocks, pieces, piece, blocks))
    assert len(views) == pieces * 3
    stream = torch.frombuffer(bytearray(b"".join(bytes(v) for v in views)), dtype=torch.float32)
    planes = cache.reshape(pieces, num_blocks, 3)
    assert torch.equal(stream, planes[:, blocks].reshape(-1))


def test_cache_bytes_refuses_a_non_contiguous_cache() -> None:
    with pytest.raises(ValueError, match="contiguous CPU"):
        cache_bytes(torch.zeros(4, 6).t())


def test_views_cross_a_socket_whole_in_batches() -> None:
    # More views than one sendmsg takes (512) and more bytes than the socket buffers hold, so
    # both sides go through partial sends and receives.
    source = [bytes([i % 251]) * 3000 for i in range(1500)]
    received = [bytearray(3000) for _ in source]
    a, b = socket.socketpair()
    try:
        deadline = time.monotonic() + 30.0
        sender = threading.Thread(target=send_views, args=(a, [memoryview(s) for s in source], deadline))
        sender.start()
        got = recv_views(b, [memoryview(r) for r in received], deadline)
        sender.join(timeout=30.0)
        assert got == 1500 * 3000 and [bytes(r) for r in received] == source
    finally:
        a.close()
        b.close()


def test_recv_exact_tells_a_clean_end_from_a_short_one() -> None:
    a, b = socket.socketpair()
    try:
        deadline = time.monotonic() + 5.0
        a.sendall(b"abc")
        assert recv_exact(b, 3, deadline) == b"abc"
        a.sendall(b"xy")
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionError, match="after 2 of 4 bytes"):
            recv_exact(b, 4, deadline)
        assert recv_exact(b, 4, deadline, eof_ok=True) == b""  # closed before any byte
        with pytest.raises(TimeoutError):
            recv_exact(b, 1, time.monotonic() - 1.0)  # the deadline has passed
    finally:
        a.close()
        b.close()
