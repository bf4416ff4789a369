"""The admin API on the router's host and port: the pools and their workers. No torch.

    GET  /pools                    each pool's target, bounds and workers (state, load, KV, leases)

The routes call a `PoolControl` (the pool manager, `pdserve.pools.manager`) handed to the router,
so the router does not depend on how workers are started. Bad input is a 400 naming the problem.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from pdserve.router import openai_types as oa


class PoolControl(Protocol):
    def describe(self) -> dict[str, Any]: ...


def _json(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def _error(message: str, status: int, kind: str = "invalid_request_error") -> Response:
    return _json(oa.error_body(message, kind, status), status)


def admin_routes(pools: Callable[[], PoolControl | None]) -> list[BaseRoute]:
    """The routes; `pools()` is the pool control of the moment (None: this router has none)."""

    def control() -> PoolControl:
        current = pools()
        if current is None:
            raise _NoPools
        return current

    async def get_pools(_request: Request) -> Response:
        try:
            return _json(control().describe())
        except _NoPools:
            return _error("this router manages no pools", 404, "not_found_error")

    return [Route("/pools", get_pools, methods=["GET"])]


class _NoPools(Exception):
    pass
