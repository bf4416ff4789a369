"""Who may call the router: API keys on the OpenAI routes, admin keys on the admin API, an optional
key on /metrics. No torch.

    Authorization: Bearer <key>

- `/health` is always open (a load balancer's probe carries no key).
- `/metrics` is open unless metrics keys are given (Prometheus scrapes with `authorization`).
- The admin API (`/pools...`, `/workers...`) takes only an admin key. A server started with API
  keys but no admin key keeps its admin API closed: an API key never scales or drains a pool.
- Every other path, unknown ones included (no route list leaks to a caller without a key), takes
  an API key when API keys are given.
With no key at all, everything is open: the default for a server on 127.0.0.1 (the caller of
`pdserve serve` warns when it listens on another address without keys).

A key is compared as its SHA-256 digest against every configured digest with
`hmac.compare_digest`, all of them every time: the time taken says nothing of how much of a key
matched, nor of which key did. A refusal is OpenAI's 401 body, which the official client raises
as `AuthenticationError`, and is counted (`pdserve_auth_failures_total{route}`).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

ADMIN_PREFIXES = ("/pools", "/workers")


@dataclass(frozen=True)
class AccessKeys:
    """The keys each kind of route accepts (empty: that kind is open, see the module doc)."""

    api: tuple[str, ...] = ()
    admin: tuple[str, ...] = ()
    metrics: tuple[str, ...] = ()

    @property
    def any(self) -> bool:
        return bool(self.api or self.admin or self.metrics)


class KeyRing:
    """Accepted keys, kept only as digests; `accepts` takes the same time whatever it is given."""

    def __init__(self, keys: Sequence[str]) -> None:
        self._digests = [_digest(k.encode()) for k in keys]

    def accepts(self, presented: bytes | None) -> bool:
        if presented is None:
            return False
        digest = _digest(presented)
        matched = False
        for known in self._digests:  # no early exit: every key is compared, every time
            matched |= hmac.compare_digest(digest, known)
        return matched


def _digest(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()


def route_kind(path: str) -> str:
    """ "open", "metrics", "admin" or "api"."""
    if path == "/health":
        return "open"
    if path == "/metrics":
        return "metrics"
    if any(path == p or path.startswith(p + "/") for p in ADMIN_PREFIXES):
        return "admin"
    return "api"


def bearer_token(scope: Scope) -> bytes | None:
    """The key in `Authorization: Bearer <key>`, or None."""
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = bytes(value).partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


class AuthMiddleware:
    """ASGI middleware in front of the router's app: refuses a request without the key its route
    needs before the app reads a byte of its body."""

    def __init__(
        self, app: ASGIApp, keys: AccessKeys, on_refused: Callable[[str], None] | None = None
    ) -> None:
        self.app = app
        self._rings = {
            "api": KeyRing(keys.api) if keys.api else None,
            "admin": KeyRing(keys.admin) if keys.admin else None,
            "metrics": KeyRing(keys.metrics) if keys.metrics else None,
        }
        # With API keys but no admin key, the admin API is closed rather than open.
        self._admin_closed = bool(keys.api) and not keys.admin
        self._on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan
            await self.app(scope, receive, send)
            return
        kind = route_kind(scope["path"])
        refusal = self._refusal(kind, scope)
        if refusal is None:
            await self.app(scope, receive, send)
            return
        if self._on_refused is not None:
            self._on_refused(kind)
        await _send_401(send, refusal)

    def _refusal(self, kind: str, scope: Scope) -> str | None:
        """Why the request is refused, or None if it may go on."""
        if kind == "open":
            return None
        if kind == "admin" and self._admin_closed:
            return "the admin API is closed: this server was started with API keys but no admin key (--admin-key)"
        ring = self._rings[kind]
        if ring is None:
            return None
        token = bearer_token(scope)
        if token is None:
            what = {"api": "an API key", "admin": "an admin key", "metrics": "a metrics key"}[kind]
            return f"this route needs {what}: send the header 'Authorization: Bearer <key>'"
        if not ring.accepts(token):
            return f"incorrect {'API' if kind == 'api' else kind} key provided"
        return None


async def _send_401(send: Send, message: str) -> None:
    body = json.dumps(
        {
            "error": {
                "message": message,
                "type": "invalid_request_error",
                "param": None,
                "code": "invalid_api_key",
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 401,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b'Bearer realm="pdserve"'),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})
