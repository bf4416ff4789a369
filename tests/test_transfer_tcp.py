"""The `tcp` transport over real sockets: byte-exact blocks, leases (and their tokens) enforced by
the exporter, the deployment-key handshake on both sides, forged headers, timeouts, a closed
exporter, fault injection. Every exporter, socket and process is stopped."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from pdserve.transfer.base import FaultInjector, TransferError
from pdserve.transfer.tcp import TcpExporter, TcpImporter
from pdserve.transfer.tcp_wire import (
    BAD_REQUEST,
    REPLY,
    REQUEST,
    VERSION,
    handshake_as_exporter,
    handshake_as_importer,
    recv_exact,
)

SECRET = bytes(range(32))  # the deployment's KV secret in these tests
SHAPE = (3, 2, 8, 4, 2, 8)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]
BLOCK_BYTES = 3 * 2 * 4 * 2 * 8 * 4  # float32


def kv_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kv-tcp")]


@pytest.fixture
def exporter() -> Iterator[TcpExporter]:
    torch.manual_seed(0)
    exp = TcpExporter(torch.randn(SHAPE), secret=SECRET)
    try:
        yield exp
    finally:
        exp.close()
        assert kv_threads() == []


@pytest.fixture
def importer() -> Iterator[TcpImporter]:
    imp = TcpImporter(torch.zeros((3, 2, 5, 4, 2, 8)), secret=SECRET)  # fewer blocks than the source: fine
    try:
        yield imp
    finally:
        imp.close()


def test_blocks_arrive_byte_exact_from_another_process() -> None:
    # The child closes its exporter before printing its counts: the serving thread counts a pull
    # just after the last byte left, and close() joins it.
    code = (
        "import sys, torch; from pdserve.transfer.tcp import TcpExporter;"
        "torch.manual_seed(7); cache = torch.randn(4, 2, 16, 4, 2, 8).to(torch.bfloat16);"
        f"exp = TcpExporter(cache, secret={SECRET!r}); token = exp.register('r', [2, 3, 9, 11]);"
        "print(exp.address, token.hex(), flush=True); sys.stdin.readline();"
        "exp.close(); print(exp.stats.pulls, exp.stats.bytes, flush=True)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None
    local = torch.zeros((4, 2, 6, 4, 2, 8), dtype=torch.bfloat16)
    importer = TcpImporter(local, secret=SECRET)
    try:
        address, token = proc.stdout.readline().split()
        # Consecutive runs and gaps on both sides, in a different order.
        moved = importer.pull(
            address,
            [9, 2, 3, 11],
            [5, 0, 1, 3],
            timeout=10.0,
            request_id="r",
            lease_token=bytes.fromhex(token),
        )
        torch.manual_seed(7)
        source = torch.randn(4, 2, 16, 4, 2, 8).to(torch.bfloat16)
        for src, dst in zip([9, 2, 3, 11], [5, 0, 1, 3], strict=True):
            assert torch.equal(local[:, :, dst].view(torch.int16), source[:, :, src].view(torch.int16))
        assert torch.count_nonzero(local[:, :, [2, 4]].float()) == 0  # nothing else touched
        assert moved == 4 * 4 * 2 * 4 * 2 * 8 * 2 and importer.stats.bytes == moved
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().split() == ["1", str(moved)]  # the exporter counted it too
        assert proc.wait(timeout=30) == 0
    finally:
        importer.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_only_leased_blocks_of_the_named_request_are_served(
    exporter: TcpExporter, importer: TcpImporter
) -> None:
    t1 = exporter.register("r1", [1, 2])
    t2 = exporter.register("r2", [5])
    assert t1 != t2 and len(t1) == 16
    pulled = importer.pull(exporter.address, [2, 1], [0, 1], timeout=5.0, request_id="r1", lease_token=t1)
    assert pulled == 2 * BLOCK_BYTES
    assert torch.equal(importer.kv_cache[:, :, 0], exporter.kv_cache[:, :, 2])
    with pytest.raises(TransferError, match=r"not under lease.*blocks \[5\]"):
        importer.pull(exporter.address, [1, 5], [0, 1], timeout=5.0, request_id="r1", lease_token=t1)
    with pytest.raises(TransferError, match="no lease"):
        importer.pull(exporter.address, [1], [0], timeout=5.0, request_id="other", lease_token=t1)
    with pytest.raises(TransferError, match="no lease"):
        importer.pull(exporter.address, [1], [0], timeout=5.0)  # no request id: never served
    with pytest.raises(TransferError, match="wrong lease token"):  # r2's token does not open r1
        importer.pull(exporter.address, [1], [0], timeout=5.0, request_id="r1", lease_token=t2)
    with pytest.raises(TransferError, match="wrong lease token"):
        importer.pull(exporter.address, [1], [0], timeout=5.0, request_id="r1")
    exporter.unregister("r1")
    with pytest.raises(TransferError, match="no lease"):
        importer.pull(exporter.address, [1, 2], [0, 1], timeout=5.0, request_id="r1", lease_token=t1)
    assert (
        importer.pull(exporter.address, [5], [4], timeout=5.0, request_id="r2", lease_token=t2) == BLOCK_BYTES
    )
    assert (importer.stats.pulls, importer.stats.failures) == (8, 6)
    # The exporter counts a pull just after its last byte left: give its thread a moment.
    deadline = time.monotonic() + 2.0
    while exporter.stats.pulls < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (exporter.stats.pulls, exporter.stats.failures) == (8, 6)
    assert exporter.stats.bytes == importer.stats.bytes == 3 * BLOCK_BYTES


def test_layout_mismatches_are_refused_clearly(exporter: TcpExporter) -> None:
    token = exporter.register("r", [0])
    for local in (torch.zeros((3, 2, 4, 4, 2, 4)), torch.zeros((3, 2, 4, 4, 2, 16), dtype=torch.float16)):
        imp = TcpImporter(local, secret=SECRET)  # half the bytes per block; or another dtype
        try:
            with pytest.raises(TransferError, match="layout mismatch"):
                imp.pull(exporter.address, [0], [0], timeout=5.0, request_id="r", lease_token=token)
        finally:
            imp.close()


def test_timeout_when_the_exporter_stalls(importer: TcpImporter) -> None:
    # A listener that never answers: the connection completes in the kernel backlog.
    with socket.create_server(("127.0.0.1", 0)) as silent:
        address = f"127.0.0.1:{silent.getsockname()[1]}"
        started = time.monotonic()
        with pytest.raises(TransferError, match="timed out"):  # it never says hello
            importer.pull(address, [0], [0], timeout=0.3, request_id="r")
        assert time.monotonic() - started < 2.0

    # An exporter that announces the blocks and stops halfway.
    with socket.create_server(("127.0.0.1", 0)) as server:
        address = f"127.0.0.1:{server.getsockname()[1]}"
        accepted: list[socket.socket] = []

        def half_answer() -> None:
            conn, _ = server.accept()
            accepted.append(conn)
            assert handshake_as_exporter(conn, SECRET)
            conn.recv(4096)  # the whole request (a few dozen bytes)
            conn.sendall(REPLY.pack(b"PDKV", VERSION, 0, 0, BLOCK_BYTES) + b"\0" * 100)

        thread = threading.Thread(target=half_answer)
        thread.start()
        try:
            with pytest.raises(TransferError, match="timed out"):
                importer.pull(address, [0], [0], timeout=0.5, request_id="r")
        finally:
            thread.join(timeout=5)
            for conn in accepted:
                conn.close()
    assert importer.stats.failures == 2


def test_a_closed_exporter_is_a_clean_transfer_error(importer: TcpImporter) -> None:
    exp = TcpExporter(torch.randn(SHAPE), secret=SECRET)
    token = exp.register("r", [0])
    importer.pull(exp.address, [0], [0], timeout=5.0, request_id="r", lease_token=token)  # pools a connection
    exp.close()
    assert kv_threads() == []
    with pytest.raises(TransferError, match=r"cannot connect.*refused"):
        importer.pull(exp.address, [0], [0], timeout=5.0, request_id="r", lease_token=token)
    with pytest.raises(TransferError, match="host:port"):
        importer.pull("pdserve-kv-123-abc", [0], [0], timeout=5.0, request_id="r")


def test_fault_injection(exporter: TcpExporter) -> None:
    exporter.register("r", [0, 1])
    imp = TcpImporter(torch.zeros((3, 2, 5, 4, 2, 8)), FaultInjector(rate=1.0), secret=SECRET)
    try:
        with pytest.raises(TransferError, match="injected fault"):
            imp.pull(exporter.address, [0, 1], [0, 1], timeout=5.0, request_id="r")
        assert (imp.stats.pulls, imp.stats.failures) == (1, 1)
        assert exporter.stats.pulls == 0  # dropped before anything went out
    finally:
        imp.close()


def test_ending_a_lease_cuts_a_read_in_flight() -> None:
    """A reader that stops reading holds the send; ending the lease must not wait for it forever,
    and the exporter must stop sending before the blocks are freed."""
    # A 32 MiB pull: well over what the socket buffers hold (the exporter asks for 4 MiB of send
    # buffer, which Linux doubles; an 8 MiB pull sometimes fit whole and the send never blocked).
    cache = torch.randn((2, 2, 256, 16, 8, 64))
    exp = TcpExporter(cache, secret=SECRET)
    token = exp.register("r", list(range(256)))
    rid = b"r"
    request = REQUEST.pack(b"PDKV", VERSION, 1, len(rid), 256, 4, 16 * 8 * 64 * 4, b"float32", token) + rid
    request += b"".join(i.to_bytes(4, "little") for i in range(256))
    reader = socket.socket()
    try:
        reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
        reader.connect(("127.0.0.1", int(exp.address.rsplit(":", 1)[1])))
        handshake_as_importer(reader, SECRET, exp.address, time.monotonic() + 5)
        reader.sendall(request)
        assert len(reader.recv(REPLY.size, socket.MSG_WAITALL)) == REPLY.size  # sending has begun
        time.sleep(0.2)  # the exporter fills the socket buffers and blocks
        assert exp.leases._leases["r"].readers == 1, exp.stats
        started = time.monotonic()
        assert exp.leases.unregister("r", grace=0.3) is False, exp.stats  # had to abort the read
        assert time.monotonic() - started < 2.0
        deadline = time.monotonic() + 2.0
        while exp.stats.failures == 0 and time.monotonic() < deadline:
            time.sleep(0.01)  # the serving thread counts it just after it lets go of the lease
        assert exp.stats.failures == 1 and exp.stats.bytes == 0
    finally:
        reader.close()
        exp.close()
    assert kv_threads() == []


def test_a_peer_without_the_deployment_key_gets_nothing_and_is_counted(exporter: TcpExporter) -> None:
    token = exporter.register("r", [0, 1])
    stranger = TcpImporter(torch.zeros((3, 2, 5, 4, 2, 8)), secret=b"not the key" * 3)
    try:
        with pytest.raises(TransferError, match="refused this worker's KV key"):
            stranger.pull(exporter.address, [0, 1], [0, 1], timeout=5.0, request_id="r", lease_token=token)
        assert torch.count_nonzero(stranger.kv_cache) == 0
    finally:
        stranger.close()
    # Raw bytes instead of the handshake: closed, counted, nothing served.
    for junk in (
        b"GET / HTTP/1.1\r\n\r\n",
        REQUEST.pack(b"PDKV", VERSION, 1, 1, 2, 4, 256, b"float32", token) + b"r",
    ):
        with socket.create_connection(
            ("127.0.0.1", int(exporter.address.rsplit(":", 1)[1])), timeout=5
        ) as probe:
            probe.sendall(junk + b"\0" * 64)  # at least an AUTH's worth: refused at once, not at the timeout
            probe.settimeout(6)
            got = b""
            try:
                while chunk := probe.recv(4096):
                    got += chunk
            except ConnectionResetError:  # closed with our surplus bytes unread: a reset, not an EOF
                pass
            assert len(got) <= 37  # its HELLO, then the close
    deadline = time.monotonic() + 2.0
    while exporter.refused_connections < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert exporter.refused_connections == 3 and exporter.stats.pulls == 0
    assert "r" in exporter.leases._leases  # still there for the real importer


def test_an_importer_refuses_an_exporter_without_the_key() -> None:
    impostor = TcpExporter(torch.randn(SHAPE), secret=b"another deployment's key!!!!!!!!")
    imp = TcpImporter(torch.zeros(SHAPE), secret=SECRET)
    try:
        token = impostor.register("r", [0])
        with pytest.raises(TransferError, match="refused this worker's KV key"):
            imp.pull(impostor.address, [0], [0], timeout=5.0, request_id="r", lease_token=token)
        assert torch.count_nonzero(imp.kv_cache) == 0
    finally:
        imp.close()
        impostor.close()


def test_forged_sizes_in_a_header_are_refused_before_anything_is_allocated(
    exporter: TcpExporter, importer: TcpImporter
) -> None:
    """A peer that holds the key (a bug, or a compromised worker) names 4 billion blocks or a huge
    request id: the exporter answers BAD_REQUEST without reading or allocating, and serves on."""
    token = exporter.register("r", [0])
    port = int(exporter.address.rsplit(":", 1)[1])
    for num_blocks, id_len in ((2**32 - 1, 1), (9, 1), (1, 65535)):
        with socket.create_connection(("127.0.0.1", port), timeout=5) as peer:
            handshake_as_importer(peer, SECRET, exporter.address, time.monotonic() + 5)
            peer.sendall(REQUEST.pack(b"PDKV", VERSION, 1, id_len, num_blocks, 4, 256, b"float32", token))
            magic, _, status, msg_len, payload = REPLY.unpack(
                recv_exact(peer, REPLY.size, time.monotonic() + 5)
            )
            assert (magic, status, payload) == (b"PDKV", BAD_REQUEST, 0)
            assert b"this cache has 8" in recv_exact(peer, msg_len, time.monotonic() + 5)
    assert (
        importer.pull(exporter.address, [0], [0], timeout=5.0, request_id="r", lease_token=token)
        == BLOCK_BYTES
    )


def test_silent_strangers_cannot_take_an_importers_slot() -> None:
    exp = TcpExporter(torch.randn(SHAPE), secret=SECRET, max_handshakes=2)
    imp = TcpImporter(torch.zeros(SHAPE), secret=SECRET)
    port = int(exp.address.rsplit(":", 1)[1])
    try:
        token = exp.register("r", [0])
        assert imp.pull(exp.address, [0], [0], timeout=5.0, request_id="r", lease_token=token) == BLOCK_BYTES
        silent = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]  # say nothing
        time.sleep(0.2)
        # The pooled, authenticated connection still serves while they hold the handshake slots.
        assert imp.pull(exp.address, [0], [0], timeout=5.0, request_id="r", lease_token=token) == BLOCK_BYTES
        started = time.monotonic()
        for sock in silent:  # each is dropped at the handshake timeout
            sock.settimeout(5)
            assert sock.recv(4096)  # the HELLO
            assert sock.recv(4096) == b""
            sock.close()
        assert time.monotonic() - started < 4.0
        fresh = TcpImporter(torch.zeros(SHAPE), secret=SECRET)  # a new connection gets through again
        try:
            assert (
                fresh.pull(exp.address, [0], [0], timeout=5.0, request_id="r", lease_token=token)
                == BLOCK_BYTES
            )
        finally:
            fresh.close()
    finally:
        imp.close()
        exp.close()
