"""The `tcp` transport: KV blocks across hosts, block-granular, zero-copy framing.

Prefill side (`TcpExporter`): a listening socket served by its own threads (one accepts, one per
connection). Each connection first passes a mutual HMAC handshake over the deployment's KV secret
(pdserve.security); one that fails is closed and counted. A pull names a request, the lease's
token and its source blocks; the exporter checks them against the request's lease (`LeaseTable`),
then sends one small reply header and the blocks straight out of
the KV cache tensor: `sendmsg` over memoryviews of the cache, one per contiguous run of blocks in
each layer's K or V plane. No pickle, no per-block Python copy.

Decode side (`TcpImporter`): keeps a few idle connections per address, sends the request and
`recvmsg_into`s the payload directly into its own destination block slices.

A cache without a byte view here (on a GPU) is staged instead (pdserve.transfer.staging): the
exporter gathers the leased blocks chunk by chunk into pinned host buffers and sends those, the
importer receives into them and copies each chunk into its blocks; the bytes on the wire are the
same, so a staged side and a direct one work together.

The wire format (headers, block ids, the order of the block stream) and the socket I/O are in
pdserve.transfer.tcp_wire.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
import time
from collections.abc import Sequence

import torch

from pdserve.transfer.base import FaultInjector, KVExporter, KVImporter, LeaseError, TransferError
from pdserve.transfer.layout import block_views, cache_bytes, layout_of
from pdserve.transfer.staging import StagedBlocks
from pdserve.transfer.tcp_wire import (
    BAD_REQUEST,
    LAYOUT,
    MAGIC,
    MAX_REQUEST_ID,
    NO_LEASE,
    OK,
    OP_PULL,
    REPLY,
    REQUEST,
    STATUS_TEXT,
    VERSION,
    handshake_as_exporter,
    handshake_as_importer,
    pack_ids,
    parse_address,
    recv_exact,
    recv_views,
    send_views,
    tune_socket,
    unpack_ids,
)


def _storage(kv_cache: torch.Tensor, staged: bool | None) -> tuple[StagedBlocks | None, memoryview | None]:
    """How a side reads and writes its blocks: through host buffers, or as bytes of the cache."""
    if staged is None:
        staged = kv_cache.device.type != "cpu"
    if staged:
        return StagedBlocks(kv_cache), None
    return None, cache_bytes(kv_cache)


class _Stale(Exception):
    """A pooled connection the peer had closed before this request: retry on a fresh one."""


class TcpExporter(KVExporter):
    """Serves leased blocks of `kv_cache` on `host:port` (port 0: any free port)."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        secret: bytes,
        advertise_host: str | None = None,
        send_timeout: float = 30.0,
        idle_timeout: float = 300.0,
        max_connections: int = 64,
        max_handshakes: int = 128,
        staged: bool | None = None,
    ) -> None:
        """`staged`: send through host buffers (pdserve.transfer.staging) instead of straight out
        of the cache's bytes; None: where the cache is not in this host's memory (a GPU)."""
        super().__init__(kv_cache)  # [L, 2, NB, BS, KVH, D]
        self._secret = secret  # the deployment's KV secret: every connection must prove it holds it
        self._staging, self._flat = _storage(kv_cache, staged)
        self._layout = layout_of(kv_cache)
        self.send_timeout = send_timeout  # one reply must be sent within this
        self.idle_timeout = idle_timeout  # an importer's pooled connection is dropped after this
        self.max_connections = max_connections  # authenticated importers at once
        # Connections still in the handshake, counted apart: a process without the key that opens
        # sockets and says nothing holds a slot for at most HANDSHAKE_TIMEOUT, and never one of
        # the authenticated importers' slots.
        self.max_handshakes = max_handshakes
        self._authenticated = 0
        self._listener = socket.create_server((host, port), backlog=64)
        self._listener.settimeout(0.2)  # bounds how long close() waits for the accept thread
        bound_port = self._listener.getsockname()[1]
        if advertise_host is None:
            advertise_host = socket.gethostname() if host in ("", "0.0.0.0", "::") else host
        self._address = (
            f"[{advertise_host}]:{bound_port}" if ":" in advertise_host else f"{advertise_host}:{bound_port}"
        )
        self._closed = threading.Event()
        self._lock = threading.Lock()
        self._conns: dict[socket.socket, threading.Thread] = {}
        self._acceptor = threading.Thread(target=self._accept_loop, name="kv-tcp-accept", daemon=True)
        self._acceptor.start()

    @property
    def address(self) -> str:
        return self._address

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._acceptor.join(timeout=5.0)
        self._listener.close()
        with self._lock:
            conns = dict(self._conns)
        for conn in conns:  # wakes a thread blocked in recv or sendmsg
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        for thread in conns.values():
            thread.join(timeout=5.0)

    # -- threads ----------------------------------------------------------------------------------
    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            tune_socket(conn)
            thread = threading.Thread(target=self._serve, args=(conn,), name="kv-tcp-serve", daemon=True)
            with self._lock:
                if len(self._conns) - self._authenticated >= self.max_handshakes:
                    conn.close()  # the importer sees EOF: a clear failure, not a hang
                    continue
                self._conns[conn] = thread
            thread.start()

    def _serve(self, conn: socket.socket) -> None:
        counted = False
        try:
            if not handshake_as_exporter(conn, self._secret):
                with self._lock:
                    self.refused_connections += 1
                return
            with self._lock:
                if self._authenticated >= self.max_connections:
                    return  # the importer sees EOF after its handshake: a clear failure
                self._authenticated += 1
                counted = True
            while not self._closed.is_set():
                try:
                    head = recv_exact(conn, REQUEST.size, time.monotonic() + self.idle_timeout, eof_ok=True)
                except OSError:  # includes the idle timeout
                    return
                if not head:
                    return  # the importer closed its pooled connection
                deadline = time.monotonic() + self.send_timeout
                if not self._serve_one(conn, head, deadline):
                    return
        finally:
            self._connection_closed(conn)
            with self._lock:
                self._conns.pop(conn, None)
                self._authenticated -= counted
            conn.close()

    def _connection_closed(self, conn: socket.socket) -> None:
        """Hook: an importer's connection ended (subclasses drop what it held)."""

    def _serve_one(self, conn: socket.socket, head: bytes, deadline: float) -> bool:
        """Answers one request. False when the connection must be closed."""
        magic, version, op, id_len, num_blocks, pieces, piece, dtype, token = REQUEST.unpack(head)
        if magic != MAGIC or version != VERSION:
            self._reply_error(conn, BAD_REQUEST, f"not a pdserve KV request (version {version})", deadline)
            return False
        # Every size is checked before anything of that size is read or allocated: a request can
        # name at most every block of this cache once.
        if id_len > MAX_REQUEST_ID or num_blocks > self._layout[0]:
            self._reply_error(
                conn,
                BAD_REQUEST,
                f"a request id of {id_len} bytes (at most {MAX_REQUEST_ID}) or {num_blocks} blocks "
                f"(this cache has {self._layout[0]})",
                deadline,
            )
            return False
        try:
            body = recv_exact(conn, id_len + 4 * num_blocks, deadline)  # one call: it came in one
            request_id = body[:id_len].decode()
        except (OSError, UnicodeDecodeError):
            return False
        return self._handle(
            conn, op, request_id, token, unpack_ids(body[id_len:]), (pieces, piece, dtype), deadline
        )

    def _handle(
        self,
        conn: socket.socket,
        op: int,
        request_id: str,
        token: bytes,
        blocks: list[int],
        layout: tuple[int, int, bytes],
        deadline: float,
    ) -> bool:
        """One request of kind `op`; subclasses add their own kinds."""
        if op != OP_PULL:
            return self._reply_error(conn, BAD_REQUEST, f"unknown operation {op}", deadline)
        status, error = self._check_layout(layout, blocks)
        if error:
            return self._reply_error(conn, status, error, deadline)
        started = time.perf_counter()

        def abort() -> None:  # the lease ends while we send: cut the stream, the importer fails
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)

        try:
            lease = self.leases.acquire(request_id, token, blocks, abort)
        except LeaseError as exc:
            return self._reply_error(conn, NO_LEASE, str(exc), deadline)
        num_blocks, pieces, piece, _ = self._layout
        nbytes = len(blocks) * pieces * piece
        ok = False
        try:
            header = REPLY.pack(MAGIC, VERSION, OK, 0, nbytes)
            if self._staging is not None:
                send_views(conn, [memoryview(header)], deadline)
                self._staging.send(blocks, lambda view: send_views(conn, [view], deadline))
            else:
                assert self._flat is not None
                views = block_views(self._flat, num_blocks, pieces, piece, blocks)
                send_views(conn, itertools.chain([memoryview(header)], views), deadline)
            ok = True
        except OSError:
            pass  # the importer's side reports it (a short read or its own timeout)
        finally:
            ok = self.leases.release(lease, abort) and ok
            self.stats.record(nbytes, time.perf_counter() - started, ok)
        return ok

    def _check_layout(self, layout: tuple[int, int, bytes], blocks: list[int]) -> tuple[int, str]:
        num_blocks, pieces, piece, dtype = self._layout
        want_pieces, want_piece, want_dtype = layout
        want_dtype = want_dtype.rstrip(b"\0")
        if (want_pieces, want_piece, want_dtype) != (pieces, piece, dtype):
            theirs = want_dtype.decode(errors="replace")
            return LAYOUT, (
                f"KV layout mismatch: this exporter has {pieces} pieces of {piece} bytes per block "
                f"({dtype.decode()}), the importer expects {want_pieces} of {want_piece} ({theirs}): "
                "same model, block size and dtype on both sides?"
            )
        if blocks and max(blocks) >= num_blocks:
            return BAD_REQUEST, f"block {max(blocks)} is outside this cache ({num_blocks} blocks)"
        return OK, ""

    def _reply_ok(self, conn: socket.socket, body: bytes, deadline: float) -> bool:
        """A small OK reply with `body` as its payload (side-channel operations)."""
        try:
            send_views(conn, [memoryview(REPLY.pack(MAGIC, VERSION, OK, 0, len(body)) + body)], deadline)
        except OSError:
            return False
        return True

    def _reply_error(self, conn: socket.socket, status: int, message: str, deadline: float) -> bool:
        text = message.encode()[:4096]
        self.stats.record(0, 0.0, ok=False)  # before the reply: the importer may look at once
        try:
            send_views(conn, [memoryview(REPLY.pack(MAGIC, VERSION, status, len(text), 0) + text)], deadline)
        except OSError:
            return False
        return True


class TcpImporter(KVImporter):
    """Decode side of `tcp`: pulls blocks from a `TcpExporter` into this worker's cache."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        faults: FaultInjector | None = None,
        max_idle_per_address: int = 4,
        *,
        secret: bytes,
        staged: bool | None = None,
    ) -> None:
        """`staged`: as TcpExporter's (receive into host buffers, then copy into the blocks)."""
        super().__init__(kv_cache, faults)  # [L, 2, NB, BS, KVH, D]
        self._secret = secret  # the deployment's KV secret: each new connection proves it
        self._staging, self._flat = _storage(kv_cache, staged)
        self._layout = layout_of(kv_cache)
        self.max_idle_per_address = max_idle_per_address
        self._idle: dict[str, list[socket.socket]] = {}
        self._lock = threading.Lock()

    def _pull(self, address: str, src_blocks: list[int], dst_blocks: list[int], timeout: float) -> int:
        return self._pull_request("", b"", address, src_blocks, dst_blocks, timeout)

    def _pull_request(
        self,
        request_id: str,
        lease_token: bytes,
        address: str,
        src_blocks: list[int],
        dst_blocks: list[int],
        timeout: float,
    ) -> int:
        deadline = time.monotonic() + timeout
        num_blocks, pieces, piece, _ = self._layout
        request = self.request(OP_PULL, request_id, src_blocks, lease_token)
        sock: socket.socket | None
        sock, reply = self.exchange(address, request, deadline, timeout)
        try:
            _, _, status, msg_len, payload = reply
            if status != OK:
                error = self._refused(address, sock, status, msg_len, deadline)
                self.put_back(address, sock)  # an error reply leaves the stream in step
                sock = None
                raise error
            expected = len(src_blocks) * pieces * piece
            if payload != expected:
                raise TransferError(f"{address} announced {payload} bytes, expected {expected}")
            if self._staging is not None:
                conn = sock
                got = self._staging.receive(dst_blocks, lambda view: recv_views(conn, [view], deadline))
            else:
                assert self._flat is not None
                got = recv_views(
                    sock, block_views(self._flat, num_blocks, pieces, piece, dst_blocks), deadline
                )
            if got < expected:
                raise TransferError(
                    f"short read from {address}: connection closed after {got} of {expected} bytes"
                )
            self.put_back(address, sock)
            sock = None
            return expected
        except TimeoutError as exc:
            raise TransferError(f"pull from {address} timed out after {timeout:.1f} s") from exc
        finally:
            if sock is not None:
                sock.close()  # mid-stream: this connection can never be reused

    def request(self, op: int, request_id: str, blocks: Sequence[int], lease_token: bytes = b"") -> bytes:
        """A request of kind `op`, carrying this side's layout (the exporter refuses a mismatch)."""
        _, pieces, piece, dtype = self._layout
        rid = request_id.encode()
        head = REQUEST.pack(MAGIC, VERSION, op, len(rid), len(blocks), pieces, piece, dtype, lease_token)
        return head + rid + pack_ids(blocks)

    def call(
        self,
        address: str,
        op: int,
        request_id: str,
        blocks: Sequence[int],
        timeout: float,
        sock: socket.socket | None = None,
        lease_token: bytes = b"",
    ) -> tuple[bytes, socket.socket]:
        """One request with a small reply (side-channel operations). Returns the reply's payload
        and the connection, which the caller owns: `put_back` it, or pass it as `sock` to go on
        on the same connection. On any error the connection is closed or back in the pool."""
        deadline = time.monotonic() + timeout
        sock, (_, _, status, msg_len, payload) = self.exchange(
            address, self.request(op, request_id, blocks, lease_token), deadline, timeout, sock
        )
        try:
            error = self._refused(address, sock, status, msg_len, deadline) if status != OK else None
            body = recv_exact(sock, payload, deadline) if error is None else b""
        except TimeoutError as exc:
            sock.close()
            raise TransferError(f"request to {address} timed out after {timeout:.1f} s") from exc
        except BaseException:
            sock.close()
            raise
        if error is not None:
            self.put_back(address, sock)  # a complete error reply leaves the stream in step
            raise error
        return body, sock

    def _refused(
        self, address: str, sock: socket.socket, status: int, msg_len: int, deadline: float
    ) -> TransferError:
        message = recv_exact(sock, msg_len, deadline).decode(errors="replace")
        return TransferError(f"{address} refused the request ({STATUS_TEXT.get(status, status)}): {message}")

    def exchange(
        self,
        address: str,
        request: bytes,
        deadline: float,
        timeout: float,
        given: socket.socket | None = None,
    ) -> tuple[socket.socket, tuple[bytes, int, int, int, int]]:
        """Sends `request` (on `given`, or a pooled or new connection), reads the reply header.
        A pooled connection the exporter had closed is retried once on a fresh one (the exporter
        drops idle connections)."""
        for attempt in range(2):
            if given is not None:
                sock, pooled = given, False
            else:
                sock, pooled = self._connection(address, deadline, timeout, fresh=attempt > 0)
            try:
                try:
                    send_views(sock, [memoryview(request)], deadline)
                    head = recv_exact(sock, REPLY.size, deadline, eof_ok=True)
                except ConnectionError as exc:
                    if pooled:
                        raise _Stale() from exc
                    raise TransferError(f"{address} dropped the connection: {exc}") from exc
                if not head:
                    if pooled:
                        raise _Stale()
                    raise TransferError(f"{address} closed the connection before replying")
                reply = REPLY.unpack(head)
                if reply[0] != MAGIC or reply[1] != VERSION:
                    raise TransferError(f"{address} is not a pdserve KV exporter of version {VERSION}")
                return sock, reply
            except _Stale:
                sock.close()
            except TimeoutError as exc:
                sock.close()
                raise TransferError(f"pull from {address} timed out after {timeout:.1f} s") from exc
            except BaseException:
                sock.close()
                raise
        raise TransferError(f"{address} keeps closing connections")  # unreachable: fresh is never stale

    def _connection(
        self, address: str, deadline: float, timeout: float, fresh: bool
    ) -> tuple[socket.socket, bool]:
        if not fresh:
            with self._lock:
                idle = self._idle.get(address)
                if idle:
                    return idle.pop(), True
        host, port = parse_address(address)
        try:
            sock = socket.create_connection((host, port), timeout=max(0.001, deadline - time.monotonic()))
        except TimeoutError as exc:
            raise TransferError(f"connecting to {address} timed out after {timeout:.1f} s") from exc
        except OSError as exc:
            raise TransferError(f"cannot connect to KV exporter {address}: {exc}") from exc
        try:
            tune_socket(sock)
            handshake_as_importer(sock, self._secret, address, deadline)
        except BaseException:
            sock.close()
            raise
        return sock, False

    def put_back(self, address: str, sock: socket.socket) -> None:
        with self._lock:
            idle = self._idle.setdefault(address, [])
            if len(idle) < self.max_idle_per_address:
                idle.append(sock)
                return
        sock.close()

    def forget(self, address: str) -> None:
        """Close the idle connections to an exporter that went away."""
        with self._lock:
            idle = self._idle.pop(address, [])
        for sock in idle:
            sock.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, {}
        for socks in idle.values():
            for sock in socks:
                sock.close()
