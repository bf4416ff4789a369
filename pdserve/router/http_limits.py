"""Bounds on an HTTP request's head (request line and headers), which uvicorn's httptools parser
does not have: without them a client can send megabytes of headers and the router buffers them all.

A head past `MAX_HEAD_BYTES`, or with more than `MAX_HEADERS` headers, gets a 431 and the
connection is closed before the app sees the request. The body has its own limit in the app
(`--max-body-bytes`, 413).
"""

from __future__ import annotations

from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

MAX_HEAD_BYTES = 64 * 1024  # nginx allows 4 x 8 KiB by default; no OpenAI client sends a tenth
MAX_HEADERS = 100


class _HeadTooLarge(Exception):
    pass


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._awaiting_head = True  # between requests, or inside a head
        self._head_bytes = 0
        self._header_count = 0
        self._refused: str | None = None
        self._messages_ended = 0  # in the read being parsed
        self._body_bytes = 0  # of the read being parsed, handed to the app
        self._framing_bytes = 0  # of the current body's reads, not body: chunk sizes, trailers

    def data_received(self, data: bytes) -> None:
        in_head_before = self._awaiting_head
        self._messages_ended = 0
        self._body_bytes = 0
        super().data_received(data)
        # In a body, what a read holds beyond the body itself is chunk framing and trailers, which
        # httptools also buffers to itself: bounded like a head (a chunked body's framing is a few
        # bytes a chunk; a trailer that never ends is not).
        if not in_head_before and not self._awaiting_head and self._refused is None:
            self._framing_bytes += max(0, len(data) - self._body_bytes)
            if self._framing_bytes > MAX_HEAD_BYTES:
                self._refuse(f"the request's chunk framing and trailers are over {MAX_HEAD_BYTES} bytes")
                return
        # httptools keeps a header's pieces to itself until the header is whole, so the bytes of a
        # head still incomplete after this read are counted here, not in the callbacks. A read that
        # also ended a message (its tail is the last body's) is not counted: at most one read of
        # the next head goes uncounted.
        in_head_throughout = in_head_before and self._awaiting_head and not self._messages_ended
        if in_head_throughout and self._refused is None:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(f"the request head is over {MAX_HEAD_BYTES} bytes")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._header_count = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > MAX_HEADERS:
            self._refused = f"the request has more than {MAX_HEADERS} headers"
            raise _HeadTooLarge  # the parser stops; uvicorn answers through send_400_response
        super().on_header(name, value)

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_headers_complete(self) -> None:
        self._awaiting_head = False
        self._head_bytes = 0
        self._framing_bytes = 0
        # A head that arrived whole in one read is measured here, from what was parsed.
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > MAX_HEAD_BYTES:
            self._refused = f"the request head is over {MAX_HEAD_BYTES} bytes"
            raise _HeadTooLarge  # before uvicorn hands the request to the app
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._awaiting_head = True  # keep-alive: the next request's head is counted afresh
        self._messages_ended += 1

    def send_400_response(self, msg: str) -> None:
        if self._refused is not None:
            self._refuse(self._refused)
        else:
            super().send_400_response(msg)

    def _refuse(self, why: str) -> None:
        # Written straight to the socket, as uvicorn's own 400: a response still being sent on
        # this connection (a pipelined one) is cut by it, and the connection closes.
        self._refused = why
        if self.transport.is_closing():
            return
        self.logger.warning("refused a request from %s: %s", self.client, why)
        body = why.encode("ascii")
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
            b"content-type: text/plain; charset=utf-8\r\n"
            b"content-length: " + str(len(body)).encode("ascii") + b"\r\n"
            b"connection: close\r\n\r\n" + body
        )
        self.transport.close()
