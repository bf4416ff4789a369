"""The pool manager: each pool's workers started, watched and stopped through a cluster backend.
No torch.

A pool (`prefill`, `decode` or `colocated`) has bounds (min, max) and a target number of replicas.
The manager starts workers through the `ClusterBackend` (which returns once a worker has reported
its addresses), adds each to the router's `WorkerSet` (`starting` until it says Ready over its RPC
connection), and removes a worker when it ends, so its metric series go with it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve.cluster.base import ClusterBackend, WorkerExit, WorkerHandle, WorkerStartError
from pdserve.config import WorkerConfig
from pdserve.errors import PdserveError
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers import WorkerLink, WorkerSet, WorkerState

logger = logging.getLogger(__name__)


class PoolError(PdserveError):
    """An admin request that cannot be done as asked (HTTP 400); the message says why."""


@dataclass(frozen=True)
class PoolSpec:
    name: str  # prefill | decode | colocated
    replicas: int  # at start
    min: int
    max: int
    config: Callable[[str], WorkerConfig]  # the configuration of a new worker, given its id

    def __post_init__(self) -> None:
        if not 0 <= self.min <= self.replicas <= self.max:
            raise PdserveError(
                f"pool {self.name}: need min <= replicas <= max, got {self.min} <= {self.replicas} <= {self.max}"
            )


@dataclass
class Pool:
    spec: PoolSpec
    target: int
    next_index: int = 0  # worker ids are never reused: decode-0, decode-1, ...
    starting: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    handles: dict[str, WorkerHandle] = field(default_factory=dict)
    last_error: str | None = None


class PoolManager:
    def __init__(
        self,
        backend: ClusterBackend,
        workers: WorkerSet,
        metrics: RouterMetrics,
        pools: list[PoolSpec],
        *,
        start_timeout: float = 600.0,
        stop_timeout: float = 15.0,
    ) -> None:
        self.backend = backend
        self.workers = workers
        self.metrics = metrics
        self.pools = {p.name: Pool(p, p.replicas) for p in pools}
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        backend.set_exit_callback(self._on_exit)
        for pool in self.pools.values():
            metrics.pool_target.labels(pool.spec.name).set(pool.target)

    # -- lifecycle ----------------------------------------------------------------------------------------
    async def start(self, abort: Callable[[], str | None] | None = None) -> None:
        """Start every pool's initial workers at once and wait until all are up. Raises
        PdserveError naming the workers that failed (then nothing is left running), or when
        `abort` returns a reason to give up (Ctrl-C while models load)."""
        for pool in self.pools.values():
            for _ in range(pool.target):
                self._start_worker(pool)
        deadline = time.monotonic() + self.start_timeout
        while True:
            failed = [p.last_error for p in self.pools.values() if p.last_error]
            if failed:
                raise PdserveError("workers failed to start: " + "; ".join(str(f) for f in failed))
            reason = abort() if abort is not None else None
            if reason:
                raise PdserveError(f"start-up stopped: {reason}")
            waiting = [w.worker_id for w in self.workers.links.values() if w.state is WorkerState.STARTING]
            if not waiting:
                return
            if time.monotonic() > deadline:
                raise PdserveError(f"workers not ready after {self.start_timeout:g} s: {', '.join(waiting)}")
            await asyncio.sleep(0.05)

    async def close(self) -> None:
        """Stop every worker (what is starting too) and forget them."""
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.backend.close()
        for worker_id in list(self.workers.links):
            await self.workers.remove_worker(worker_id, "the server is shutting down")

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- starting and stopping workers ------------------------------------------------------------------
    def _start_worker(self, pool: Pool) -> str:
        worker_id = f"{pool.spec.name}-{pool.next_index}"
        pool.next_index += 1
        self.workers.add_worker(worker_id, pool.spec.name)
        pool.starting[worker_id] = self._spawn(self._run_start(pool, worker_id), f"start-{worker_id}")
        return worker_id

    async def _run_start(self, pool: Pool, worker_id: str) -> None:
        try:
            handle = await self.backend.start_worker(pool.spec.config(worker_id), self.start_timeout)
        except WorkerStartError as exc:
            pool.last_error = str(exc)
            logger.error("pool %s: %s", pool.spec.name, exc)
            await self.workers.remove_worker(worker_id, f"failed to start: {exc}")
            return
        finally:
            pool.starting.pop(worker_id, None)
        link = self.workers.links.get(worker_id)
        if link is None or link.state is WorkerState.STOPPED:  # removed while it started
            await self.backend.stop_worker(worker_id, graceful=True, timeout=self.stop_timeout)
            return
        pool.handles[worker_id] = handle
        link.connect(handle.rpc_address)

    def _on_exit(self, exit: WorkerExit) -> None:
        """A worker ended (asked to or not): its link goes, and with it its metric series."""
        for pool in self.pools.values():
            pool.handles.pop(exit.worker_id, None)
        if self._closing:
            return
        link = self.workers.links.get(exit.worker_id)
        if link is not None and not exit.expected:
            logger.error("worker %s %s", exit.worker_id, exit.reason)
        self._spawn(self.workers.remove_worker(exit.worker_id, exit.reason), f"remove-{exit.worker_id}")

    # -- what GET /pools shows ------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {"pools": {name: self._describe_pool(pool) for name, pool in self.pools.items()}}

    def _describe_pool(self, pool: Pool) -> dict[str, Any]:
        links = self.workers.in_pool(pool.spec.name)
        return {
            "target": pool.target,
            "min": pool.spec.min,
            "max": pool.spec.max,
            "last_error": pool.last_error,
            "workers": [self._describe_worker(link, pool.handles.get(link.worker_id)) for link in links],
        }

    @staticmethod
    def _describe_worker(link: WorkerLink, handle: WorkerHandle | None) -> dict[str, Any]:
        load = link.load
        view: dict[str, Any] = {
            "id": link.worker_id,
            "state": link.state.value,
            "detail": link.detail,
            "streams": len(link.legs),
            "running": load.num_running if load else None,
            "waiting": load.num_waiting if load else None,
            "kv_blocks_used": load.kv_blocks_used if load else None,
            "kv_blocks_free": load.kv_blocks_free if load else None,
            "queued_prompt_tokens": load.queued_prompt_tokens if load else None,
            "held_leases": load.num_prefilled_held if load else None,
        }
        if handle is not None:
            view.update(rpc_address=handle.rpc_address, node=handle.node, **handle.details)
        return view
