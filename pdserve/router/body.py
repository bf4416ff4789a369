"""Reading a request body within a size and a time limit: one reader for every route that takes
a body (the OpenAI routes and the admin routes), so none of them can be held open or filled up by
a client that sends slowly or without end. No torch."""

from __future__ import annotations

import asyncio

from starlette.requests import Request

from pdserve.errors import InvalidRequestError


class BodyError(InvalidRequestError):
    """A body too large (413) or too slow (408)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


async def read_body(request: Request, limit: int, timeout: float) -> bytes:
    """The whole body, at most `limit` bytes, arrived within `timeout` seconds (BodyError else).
    A declared Content-Length over the limit is refused before a byte of the body is read."""
    declared = request.headers.get("content-length", "")
    too_large = f"the request body is over this server's limit of {limit} bytes"
    if declared.isdigit() and int(declared) > limit:
        raise BodyError(too_large, 413)
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise BodyError(too_large, 413)
                chunks.append(chunk)
    except TimeoutError:
        raise BodyError(f"the request body did not arrive within {timeout:g} s", 408) from None
    return b"".join(chunks)
