"""The `tcp` transport's wire format, and the socket I/O that moves it (see pdserve.transfer.tcp).

Stream order of a payload: for each of the L*2 (layer, K/V) planes, the requested blocks in
request order, each one [block_size, kv_heads, head_dim] piece. Each side cuts that stream into
its own runs of consecutive block ids, so the source and destination block ids are independent.

Handshake, once per connection, before any request (mutual, by the deployment's KV secret):
  exporter -> HELLO (its nonce); importer -> AUTH (its nonce, HMAC-SHA256 over both nonces);
  exporter -> PROOF (its HMAC over both nonces, the other way round). A side that gets a wrong
  HMAC closes the connection: neither talks to a peer that does not hold the secret.
Request:  REQUEST header (with the lease's token), request id (utf-8), num_blocks little-endian
          uint32 block ids. The exporter checks every size in the header against its own cache
          before it reads or allocates anything.
Reply:    REPLY header, then `payload_bytes` of blocks (status OK) or an error text (otherwise).

Blocks go out and come in as memoryviews of the KV cache tensor itself
(`pdserve.transfer.layout`), with `sendmsg` / `recvmsg_into` over batches of them: no per-block
Python copy.
"""

from __future__ import annotations

import hashlib
import hmac
import itertools
import secrets
import socket
import struct
import sys
import time
from array import array
from collections.abc import Iterable, Iterator, Sequence

from pdserve.transfer.base import TransferError

MAGIC = b"PDKV"
VERSION = 2
# magic, version, op, request id bytes, num blocks, pieces per block (L*2), piece bytes, dtype,
# the lease's token (pdserve.transfer.base.LeaseTable)
REQUEST = struct.Struct("<4sBBHIIQ16s16s")
NONCE_BYTES = 32
HELLO = struct.Struct(f"<4sB{NONCE_BYTES}s")  # magic, version, the exporter's nonce
AUTH = struct.Struct(f"<4sB{NONCE_BYTES}s32s")  # magic, version, the importer's nonce, its HMAC
PROOF = struct.Struct("<4sB32s")  # magic, version, the exporter's HMAC
HANDSHAKE_TIMEOUT = 2.0  # seconds for the whole handshake, on either side (loopback or LAN: ms)
# magic, version, status, message bytes, payload bytes
REPLY = struct.Struct("<4sBBIQ")

OP_PULL = 1
OK, NO_LEASE, LAYOUT, BAD_REQUEST, BUSY = 0, 1, 2, 3, 4
STATUS_TEXT = {
    NO_LEASE: "not under lease",
    LAYOUT: "layout mismatch",
    BAD_REQUEST: "bad request",
    BUSY: "busy",
}

_IOV_MAX = 512  # buffers per sendmsg / recvmsg_into call (Linux allows 1024)
MAX_REQUEST_ID = 1024
_SOCKET_BUFFER = 4 << 20  # a large window keeps loopback and LAN transfers streaming


def _mac(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    return hmac.new(secret, b"pdserve-kv/" + role + first + second, hashlib.sha256).digest()


def handshake_as_exporter(sock: socket.socket, secret: bytes) -> bool:
    """The exporter's side of the handshake. False (nothing sent after HELLO) if the importer did
    not prove that it holds `secret`, or did not answer within HANDSHAKE_TIMEOUT."""
    deadline = time.monotonic() + HANDSHAKE_TIMEOUT
    mine = secrets.token_bytes(NONCE_BYTES)
    try:
        send_views(sock, [memoryview(HELLO.pack(MAGIC, VERSION, mine))], deadline)
        magic, version, theirs, mac = AUTH.unpack(recv_exact(sock, AUTH.size, deadline))
    except (OSError, ConnectionError):
        return False
    if (
        magic != MAGIC
        or version != VERSION
        or not hmac.compare_digest(mac, _mac(secret, b"importer", mine, theirs))
    ):
        return False
    try:
        send_views(
            sock, [memoryview(PROOF.pack(MAGIC, VERSION, _mac(secret, b"exporter", theirs, mine)))], deadline
        )
    except OSError:
        return False
    return True


def handshake_as_importer(sock: socket.socket, secret: bytes, address: str, deadline: float) -> None:
    """The importer's side: raises TransferError unless the exporter proves it holds `secret`."""
    deadline = min(deadline, time.monotonic() + HANDSHAKE_TIMEOUT)
    mine = secrets.token_bytes(NONCE_BYTES)
    try:
        magic, version, theirs = HELLO.unpack(recv_exact(sock, HELLO.size, deadline))
        if magic != MAGIC or version != VERSION:
            raise TransferError(f"{address} is not a pdserve KV exporter of version {VERSION}")
        auth = AUTH.pack(MAGIC, VERSION, mine, _mac(secret, b"importer", theirs, mine))
        send_views(sock, [memoryview(auth)], deadline)
        head = recv_exact(sock, PROOF.size, deadline, eof_ok=True)
    except TimeoutError as exc:
        raise TransferError(f"the KV handshake with {address} timed out") from exc
    except (OSError, ConnectionError) as exc:
        raise TransferError(f"the KV handshake with {address} failed: {exc}") from exc
    if not head:
        raise TransferError(f"{address} refused this worker's KV key: not of the same deployment?")
    _, _, proof = PROOF.unpack(head)
    if not hmac.compare_digest(proof, _mac(secret, b"exporter", mine, theirs)):
        raise TransferError(f"{address} could not prove it holds the deployment's KV key: refused")


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise TransferError(f"not a host:port KV address: {address!r}")
    return host.strip("[]"), int(port)


def pack_ids(ids: Sequence[int]) -> bytes:
    """Block ids on the wire: little-endian uint32."""
    packed = array("I", ids)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tobytes()


def unpack_ids(raw: bytes) -> list[int]:
    packed = array("I")
    packed.frombytes(raw)
    if sys.byteorder == "big":
        packed.byteswap()
    return packed.tolist()


def _deadline_timeout(sock: socket.socket, deadline: float) -> None:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    sock.settimeout(left)


def _refill(batch: list[memoryview], views: Iterator[memoryview]) -> list[memoryview]:
    """Up to _IOV_MAX views: what is left of `batch`, then the next ones of `views`."""
    batch.extend(itertools.islice(views, _IOV_MAX - len(batch)))
    return batch


def _advance(batch: list[memoryview], nbytes: int) -> list[memoryview]:
    """`batch` without its first `nbytes` bytes."""
    i = 0
    while nbytes and nbytes >= len(batch[i]):
        nbytes -= len(batch[i])
        i += 1
    rest = batch[i:]
    if nbytes:
        rest[0] = rest[0][nbytes:]
    return rest


def send_views(sock: socket.socket, views: Iterable[memoryview], deadline: float) -> None:
    """sendmsg every byte of `views`, handling partial sends, within `deadline`."""
    source = iter(views)
    batch = _refill([], source)
    while batch:
        _deadline_timeout(sock, deadline)
        batch = _refill(_advance(batch, sock.sendmsg(batch)), source)


def recv_views(sock: socket.socket, views: Iterable[memoryview], deadline: float) -> int:
    """recvmsg_into until every view is full; returns the bytes received (short on EOF)."""
    source = iter(views)
    batch = _refill([], source)
    total = 0
    while batch:
        _deadline_timeout(sock, deadline)
        got = sock.recvmsg_into(batch)[0]
        if got == 0:
            break
        total += got
        batch = _refill(_advance(batch, got), source)
    return total


def recv_exact(sock: socket.socket, n: int, deadline: float, eof_ok: bool = False) -> bytes:
    """Exactly `n` bytes; b"" if `eof_ok` and the peer closed before sending any."""
    buf = bytearray(n)
    got = recv_views(sock, [memoryview(buf)], deadline) if n else 0
    if got == 0 and n and eof_ok:
        return b""
    if got < n:
        raise ConnectionError(f"connection closed after {got} of {n} bytes")
    return bytes(buf)


def tune_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the request is one small write
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCKET_BUFFER)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCKET_BUFFER)
