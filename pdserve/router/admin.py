"""The admin API on the router's host and port: the pools and their workers. No torch.

    GET  /pools                        each pool's target, bounds and workers (state, load, KV, leases)
    PUT  /pools/{pool}                 {"replicas": N}: start or drain workers until the pool has N
    POST /pools/{pool}/rebalance       move streams from the busiest workers of a pool to the idlest
    POST /workers/{id}/drain           {"force": false, "replace": false}: drain it, then stop it

The routes call a `PoolControl` (the pool manager, `pdserve.pools.manager`) handed to the router,
so the router does not depend on how workers are started. Bad input is a 400 naming the problem
(an unknown pool or worker, replicas out of bounds or not an integer, a body that is not JSON).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from pdserve.errors import PdserveError
from pdserve.router import openai_types as oa
from pdserve.router.body import BodyError, read_body

MAX_BODY = 4096  # an admin body is a few fields


class PoolControl(Protocol):
    async def close(self) -> None:
        """Stop every worker (the router is shutting down); twice is fine."""

    def describe(self) -> dict[str, Any]: ...

    def scale(self, pool: str, replicas: object) -> dict[str, Any]: ...

    def drain(self, worker_id: str, *, force: bool = False, replace: bool = False) -> dict[str, Any]: ...

    def rebalance(self, pool: str) -> dict[str, Any]: ...


class ScaleBody(msgspec.Struct, forbid_unknown_fields=True):
    replicas: object  # checked by the pool manager, so that its message names the bounds


class DrainBody(msgspec.Struct, forbid_unknown_fields=True):
    force: bool = False  # drain the last worker of a pool that is up, leaving it empty
    replace: bool = False  # keep the pool's target: a new worker takes this one's place


class BadInput(PdserveError):
    pass


_Body = TypeVar("_Body", ScaleBody, DrainBody)


def _json(body: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(body), status_code=status, media_type="application/json")


def _error(message: str, status: int, kind: str = "invalid_request_error") -> Response:
    return _json(oa.error_body(message, kind, status), status)


async def _body(request: Request, kind: type[_Body], empty_ok: bool, timeout: float) -> _Body:
    data = await read_body(request, MAX_BODY, timeout)  # BodyError: a 413 or a 408
    if not data.strip() and empty_ok:
        data = b"{}"
    try:
        return msgspec.json.decode(data, type=kind)
    except msgspec.ValidationError as exc:
        raise BadInput(f"bad body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise BadInput(f"the body is not JSON: {exc}") from None


def admin_routes(pools: Callable[[], PoolControl | None], body_timeout: float) -> list[BaseRoute]:
    """The routes; `pools()` is the pool control of the moment (None: this router has none);
    `body_timeout`: seconds a client has to send a body (the API's --body-timeout)."""

    def handler(
        work: Callable[[PoolControl, Request], Awaitable[Any]],
    ) -> Callable[[Request], Awaitable[Response]]:
        async def endpoint(request: Request) -> Response:
            control = pools()
            if control is None:
                return _error("this router manages no pools", 404, "not_found_error")
            try:
                return _json(await work(control, request))
            except BodyError as exc:
                return _error(str(exc), exc.status)
            except PdserveError as exc:  # BadInput, PoolError: what the operator asked cannot be
                return _error(str(exc), 400)

        return endpoint

    async def get_pools(control: PoolControl, _request: Request) -> Any:
        return control.describe()

    async def put_pool(control: PoolControl, request: Request) -> Any:
        body = await _body(request, ScaleBody, empty_ok=False, timeout=body_timeout)
        return control.scale(request.path_params["pool"], body.replicas)

    async def rebalance(control: PoolControl, request: Request) -> Any:
        return control.rebalance(request.path_params["pool"])

    async def drain(control: PoolControl, request: Request) -> Any:
        body = await _body(request, DrainBody, empty_ok=True, timeout=body_timeout)
        return control.drain(request.path_params["worker"], force=body.force, replace=body.replace)

    return [
        Route("/pools", handler(get_pools), methods=["GET"]),
        Route("/pools/{pool}", handler(put_pool), methods=["PUT"]),
        Route("/pools/{pool}/rebalance", handler(rebalance), methods=["POST"]),
        Route("/workers/{worker}/drain", handler(drain), methods=["POST"]),
    ]
