"""The bound on request heads, on a real uvicorn server and real sockets: a head too long (sent
whole or trickled), or with too many headers, is a 431 and a closed connection, before the app
runs; normal requests, keep-alive ones included, are served."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from serving import free_port
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from pdserve.router.http_limits import MAX_HEAD_BYTES, MAX_HEADERS, BoundedHttpToolsProtocol

CALLS: list[str] = []


async def echo(request: Request) -> PlainTextResponse:
    CALLS.append(request.url.path)
    return PlainTextResponse(str(len(await request.body())))


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    port = free_port()
    app = Starlette(routes=[Route("/{path:path}", echo, methods=["GET", "POST"])])
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, http=BoundedHttpToolsProtocol, log_level="error")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(timeout=10)


def exchange(port: int, *pieces: bytes) -> bytes:
    """Send the pieces (a short pause between them) and read until the server closes or 2 s pass."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        for piece in pieces:
            try:
                s.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
            time.sleep(0.01)
        s.settimeout(2)
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except (TimeoutError, ConnectionResetError):
            pass
        return answer


def test_normal_and_keep_alive_requests_are_served(port: int) -> None:
    one = b"POST /a HTTP/1.1\r\nhost: x\r\ncontent-length: 5\r\n\r\nhello"
    big_but_fine = (
        b"GET /b HTTP/1.1\r\nhost: x\r\nx-big: "
        + b"v" * (MAX_HEAD_BYTES // 2)
        + b"\r\nconnection: close\r\n\r\n"
    )
    # A large body is not a head: the read that ends it must not count against the next request.
    body = b"b" * 300_000
    large = b"POST /f HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
    # A chunked body of a thousand small chunks: its framing is far under the bound.
    chunked = b"POST /g HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n64\r\n"
    chunked += b"\r\n64\r\n".join(b"c" * 100 for _ in range(1000)) + b"\r\n0\r\n\r\n"
    answer = exchange(port, one, large, large, chunked, big_but_fine)
    assert answer.count(b"HTTP/1.1 200") == 5 and b"\r\n\r\n5" in answer and b"300000" in answer
    assert b"100000" in answer


def test_a_head_over_the_limit_is_a_431_before_the_app_runs(port: int) -> None:
    CALLS.clear()
    whole = b"GET /c HTTP/1.1\r\nhost: x\r\nx-big: " + b"v" * (MAX_HEAD_BYTES + 1) + b"\r\n\r\n"
    assert exchange(port, whole).startswith(b"HTTP/1.1 431")
    # Trickled in small pieces, never finishing a header: still refused once past the limit.
    trickle = [b"GET /d HTTP/1.1\r\nx-slow: "] + [b"v" * 8192] * (MAX_HEAD_BYTES // 8192 + 2)
    assert exchange(port, *trickle).startswith(b"HTTP/1.1 431")
    many = b"GET /e HTTP/1.1\r\n" + b"".join(b"x-%d: 1\r\n" % i for i in range(MAX_HEADERS + 1)) + b"\r\n"
    answer = exchange(port, many)
    assert answer.startswith(b"HTTP/1.1 431") and b"headers" in answer
    assert CALLS == []


def test_a_trailer_that_never_ends_is_refused(port: int) -> None:
    start = b"POST /t HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\nx-trailer: "
    answer = exchange(port, start, *[b"v" * 8192] * (MAX_HEAD_BYTES // 8192 + 2))
    assert answer.startswith(b"HTTP/1.1 431") and b"trailers" in answer
