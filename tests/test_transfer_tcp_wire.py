"""The `tcp` transport's wire format and socket I/O, without an exporter: addresses, block ids and
whole-buffer sends and receives over a socket pair."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from pdserve.transfer.base import TransferError
from pdserve.transfer.tcp_wire import (
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
