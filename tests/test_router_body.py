"""Request bodies on a real server, through the one reader every route uses: over the limit is
a 413 (by its Content-Length, before a byte is read, or as soon as it grows past it), slower than
--body-timeout a 408, on the OpenAI routes and the admin routes alike; the server serves on."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from serving import Server


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[Server]:
    srv = Server(tiny_llama, "--colocated", "1", "--colocated-max", "2", "--body-timeout", "1.5")
    try:
        yield srv
    finally:
        assert srv.stop() == 0


def send_raw(
    server: Server, head: str, body: bytes, wait: float = 10.0
) -> tuple[int, dict[str, object], float]:
    """Send a head and part of a body, then nothing more; (status, error body, seconds to answer)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=wait) as sock:
        started = time.monotonic()
        sock.sendall(head.encode() + body)
        answer = b""
        while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
        elapsed = time.monotonic() - started
    status = int(answer.split(b" ", 2)[1])
    payload = json.loads(answer.split(b"\r\n\r\n", 1)[1])
    return status, payload["error"], elapsed


@pytest.mark.parametrize(
    ("method", "path"),
    [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("PUT", "/pools/colocated")],
)
def test_a_body_that_stops_arriving_gets_a_408_after_the_body_timeout(
    server: Server, method: str, path: str
) -> None:
    head = f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 200\r\n\r\n"
    status, error, elapsed = send_raw(server, head, b'{"model": "')
    assert status == 408 and "did not arrive within 1.5 s" in str(error["message"])
    assert 1.4 < elapsed < 8
    assert server.http.get("/health").status_code == 200


def test_a_declared_length_over_the_limit_is_refused_before_the_body_is_read(server: Server) -> None:
    head = "PUT /pools/colocated HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\n\r\n"
    status, error, elapsed = send_raw(server, head, b"")  # none of the 5000 bytes is sent
    assert status == 413 and "limit of 4096 bytes" in str(error["message"]) and elapsed < 1.4
    head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 99999999999\r\n\r\n"
    status, error, _ = send_raw(server, head, b"")
    assert status == 413 and "limit of 8388608 bytes" in str(error["message"])
    assert server.pools()["colocated"]["target"] == 1  # nothing changed


def test_a_chunked_body_that_grows_past_the_limit_is_a_413(server: Server) -> None:
    def endless() -> Iterator[bytes]:
        yield b'{"replicas": 2, "pad": "'
        for _ in range(100):
            yield b"x" * 1024

    answer = server.http.put("/pools/colocated", content=endless())
    assert answer.status_code == 413 and answer.json()["error"]["code"] == 413
    assert server.pools()["colocated"]["target"] == 1
    # A good body still works afterwards.
    assert server.scale("colocated", 1).status_code == 200
