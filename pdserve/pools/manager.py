"""The pool manager: each pool's workers started, drained and stopped while serving. No torch.

A pool (`prefill`, `decode` or `colocated`) has bounds (min, max) and a target number of replicas,
and the manager keeps it there: it starts workers through the `ClusterBackend` (which returns once a
worker has reported its addresses), adds each to the router's `WorkerSet` (`starting` until it says
Ready over its RPC connection), drains the ones the pool no longer needs, and removes a worker when
it ends, so its metric series go with it. A worker that dies is replaced; one that fails to start
is retried after a growing pause, and the pool says why (`last_error`).

Drain loses nothing (`pdserve.pools.drain`): a draining worker takes no new request; a prefill
worker stops once the KV it holds has been pulled; a decode or colocated worker's streams move to
the others of its pool. Rebalance moves streams from the busiest workers to the idlest (a worker
that just started takes its share at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve import clock
from pdserve.cluster.base import ClusterBackend, WorkerExit, WorkerHandle, WorkerStartError
from pdserve.config import WorkerConfig
from pdserve.errors import PdserveError
from pdserve.pools import drain
from pdserve.router import policy
from pdserve.router.metrics import RouterMetrics
from pdserve.router.placement import STREAM_POOLS
from pdserve.router.workers import WorkerSet, WorkerState, WorkerView

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


@dataclass(frozen=True)
class PoolSettings:
    start_timeout: float = 600.0  # a worker's model load and Ready, at most
    stop_timeout: float = 15.0  # SIGTERM to SIGKILL
    drain_timeout: float = 60.0  # a draining worker's time to hand over what it holds
    # A stream pool's worker that comes up while serving takes its share of the streams.
    rebalance_on_start: bool = True
    # A worker that dies is replaced (the pool keeps its target), or the pool shrinks by one.
    replace_failed: bool = True
    # A worker down this long (its process alive but silent: hung) is killed, so it is replaced.
    down_grace: float = 60.0
    # A worker that dies this soon after it came up counts as a failed start (a pause before the
    # next), so one that crashes on its first requests is not restarted in a tight loop.
    settle_seconds: float = 30.0


@dataclass
class Pool:
    spec: PoolSpec
    target: int
    next_index: int = 0  # worker ids are never reused: decode-0, decode-1, ...
    starting: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    handles: dict[str, WorkerHandle] = field(default_factory=dict)
    drains: dict[str, asyncio.Task[None]] = field(default_factory=dict)
    replacing: set[str] = field(default_factory=set)  # to be drained once a replacement is up
    last_error: str | None = None
    failures: int = 0  # starts that failed in a row (reset by one that works)
    retry_at: float = 0.0  # no new start before this (monotonic), after a failure

    @property
    def name(self) -> str:
        return self.spec.name


class PoolManager:
    def __init__(
        self,
        backend: ClusterBackend,
        workers: WorkerSet,
        metrics: RouterMetrics,
        pools: list[PoolSpec],
        settings: PoolSettings | None = None,
    ) -> None:
        self.backend = backend
        self.workers = workers
        self.metrics = metrics
        self.pools = {p.name: Pool(p, p.replicas) for p in pools}
        self.settings = settings = settings or PoolSettings()
        self.start_timeout = settings.start_timeout
        self.stop_timeout = settings.stop_timeout
        self.drain_timeout = settings.drain_timeout
        self.rebalance_on_start = settings.rebalance_on_start
        self.replace_failed = settings.replace_failed
        self._tasks: set[asyncio.Task[Any]] = set()
        self._killing: set[str] = set()
        self._serving = False  # the initial workers are up: from now on the pools are kept
        self._closing = False
        self._keeper: asyncio.Task[None] | None = None
        # More sections of GET /pools (the planner's, the router's signals): name -> its view.
        self.describers: dict[str, Callable[[], Any]] = {}
        backend.set_exit_callback(self._on_exit)
        for pool in self.pools.values():
            metrics.pool_target.labels(pool.name).set(pool.target)

    # -- lifecycle ----------------------------------------------------------------------------------------
    async def start(self, abort: Callable[[], str | None] | None = None) -> None:
        """Start every pool's initial workers at once and wait until all are up. Raises
        PdserveError naming the workers that failed (then nothing is left running), or when
        `abort` returns a reason to give up (Ctrl-C while models load)."""
        for pool in self.pools.values():
            for _ in range(pool.target):
                self._start_worker(pool)
        deadline = clock.monotonic() + self.start_timeout
        while True:
            failed = [p.last_error for p in self.pools.values() if p.last_error]
            if failed:
                raise PdserveError("workers failed to start: " + "; ".join(str(f) for f in failed))
            reason = abort() if abort is not None else None
            if reason:
                raise PdserveError(f"start-up stopped: {reason}")
            waiting = [w.worker_id for w in self.workers.views() if w.state is WorkerState.STARTING]
            if not waiting:
                break
            left = deadline - clock.monotonic()
            if left <= 0:
                raise PdserveError(f"workers not ready after {self.start_timeout:g} s: {', '.join(waiting)}")
            # A start's failure or an abort is no worker's change: look again at least this often.
            await self.workers.wait_for_change(min(left, 0.25))
        self._serving = True
        self._keeper = self._spawn(self._keep(), "pool-keeper")

    async def close(self) -> None:
        """Stop every worker (what is starting too) and forget them. Twice is fine."""
        if self._closing:
            return
        self._closing = True
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        # The links first: a worker that stops is then not reported as one that went down.
        for view in self.workers.views():
            await self.workers.remove_worker(view.worker_id, "the server is shutting down", forget=False)
        await self.backend.close()

    def _spawn(self, coro: Any, name: str) -> asyncio.Task[Any]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:  # a bug: say so, loudly
            logger.error("pool task %s failed", task.get_name(), exc_info=task.exception())

    async def _keep(self) -> None:
        while True:
            self.keep_once(clock.monotonic())
            await asyncio.sleep(0.5)

    def keep_once(self, now: float) -> None:
        """One round of the keeper (every half second): each pool back to its target (after a
        failed start, not before its pause is over); a worker down for too long is killed (then
        replaced); a pool whose workers have run for a while forgets its failed starts."""
        for pool in self.pools.values():
            self._kill_hung(pool, now)
            up = [now - (w.up_at or now) for w in self.workers.up(pool.name)]
            if pool.failures and up and min(up) > self.settings.settle_seconds:
                pool.failures = 0
            self._reconcile(pool)

    def _kill_hung(self, pool: Pool, now: float) -> None:
        """A worker whose process lives but has been down (silent) for `down_grace` is killed: its
        exit then takes it out and the pool replaces it."""
        for worker in self.workers.views(pool.name):
            hung = worker.state is WorkerState.DOWN and now - worker.state_since > self.settings.down_grace
            if hung and worker.worker_id not in self._killing:
                self._killing.add(worker.worker_id)
                logger.error(
                    "worker %s: down for %.0f s (%s): killing it",
                    worker.worker_id,
                    now - worker.state_since,
                    worker.detail,
                )
                self._spawn(
                    self.backend.stop_worker(worker.worker_id, graceful=False), f"kill-{worker.worker_id}"
                )

    # -- the admin API --------------------------------------------------------------------------------
    def scale(self, pool_name: str, replicas: object) -> dict[str, Any]:
        """PUT /pools/{pool}: start or drain workers until the pool has `replicas`."""
        pool = self._pool(pool_name)
        if not isinstance(replicas, int) or isinstance(replicas, bool):
            raise PoolError(f"replicas must be an integer, got {replicas!r}")
        if replicas < pool.spec.min:
            raise PoolError(f"pool {pool.name}: replicas {replicas} is below its min {pool.spec.min}")
        if replicas > pool.spec.max:
            raise PoolError(f"pool {pool.name}: replicas {replicas} is above its max {pool.spec.max}")
        if replicas != pool.target:
            logger.info("pool %s: target %d -> %d", pool.name, pool.target, replicas)
        self._set_target(pool, replicas)
        pool.failures, pool.retry_at = 0, 0.0  # an operator asked: try again now
        self._reconcile(pool)
        return self._describe_pool(pool)

    def targets(self) -> dict[str, tuple[int, int, int]]:
        """Each pool's (target, min, max): what the planner plans from."""
        return {name: (p.target, p.spec.min, p.spec.max) for name, p in self.pools.items()}

    def set_planned_target(self, pool_name: str, replicas: int, reason: str) -> None:
        """The planner's target for a pool (clamped to its bounds); workers start or drain as for
        PUT /pools/{pool}. A failed start's pause is kept: the planner does not hammer a pool."""
        pool = self._pool(pool_name)
        replicas = min(max(replicas, pool.spec.min), pool.spec.max)
        if replicas != pool.target:
            logger.info("pool %s: target %d -> %d (%s)", pool.name, pool.target, replicas, reason)
        self._set_target(pool, replicas)
        self._reconcile(pool)

    def drain(self, worker_id: str, *, force: bool = False, replace: bool = False) -> dict[str, Any]:
        """POST /workers/{id}/drain: drain that worker, then stop it. The pool's target goes down by
        one, or stays (`replace`: a new worker takes its place)."""
        worker = self.workers.view(worker_id)
        if worker is None:
            raise PoolError(f"unknown worker {worker_id!r}")
        pool = self._pool(worker.pool)
        if worker.state is WorkerState.DRAINING or worker_id in pool.replacing:
            return self._describe_worker(worker, pool.handles.get(worker_id))
        if replace and worker.state is WorkerState.UP:
            # It serves on until its replacement is up (the pool never has fewer workers up than
            # its target), then drains: its streams then have somewhere to go.
            pool.replacing.add(worker_id)
            self.workers.set_detail(worker_id, "to be drained once its replacement is up")
            self._reconcile(pool)
            self._spawn(self._replace_then_drain(pool, worker_id), f"replace-{worker_id}")
            return self._describe_worker(self._now(worker), pool.handles.get(worker_id))
        if not replace:
            if pool.target - 1 < pool.spec.min:
                raise PoolError(
                    f"pool {pool.name}: draining {worker_id} would take it below its min {pool.spec.min} "
                    "(ask for replace, or lower the pool's min)"
                )
            others = [w for w in self.workers.up(pool.name) if w.worker_id != worker_id]
            if not others and not force:
                raise PoolError(
                    f"{worker_id} is the last worker of pool {pool.name} that is up: draining it leaves "
                    "the pool empty (ask for force to do it anyway)"
                )
            self._set_target(pool, pool.target - 1)
        self._begin_drain(pool, worker)
        if replace:
            self._reconcile(pool)
        return self._describe_worker(self._now(worker), pool.handles.get(worker_id))

    def _now(self, view: WorkerView) -> WorkerView:
        """The worker's view as it is now (after a command), or as it was if it is gone."""
        return self.workers.view(view.worker_id) or view

    async def _replace_then_drain(self, pool: Pool, worker_id: str) -> None:
        def replaced() -> bool:  # the pool is at its target without the workers being replaced
            others = [w for w in self.workers.up(pool.name) if w.worker_id not in pool.replacing]
            return len(others) >= max(pool.target, 1)

        while not replaced() and self.workers.view(worker_id) is not None:
            await self.workers.wait_for_change(drain.WAKE_SECONDS)
        pool.replacing.discard(worker_id)
        view = self.workers.view(worker_id)
        if view is not None and view.state is not WorkerState.DRAINING:
            self._begin_drain(pool, view)

    def rebalance(self, pool_name: str) -> dict[str, Any]:
        """POST /pools/{pool}/rebalance: move streams from the busiest workers to the idlest."""
        pool = self._pool(pool_name)
        if pool.name not in STREAM_POOLS:
            raise PoolError(
                f"pool {pool.name} holds no streams to move (only {' and '.join(STREAM_POOLS)} do)"
            )
        plan = policy.plan_rebalance({w.worker_id: w.staying for w in self.workers.up(pool.name)})
        moved: dict[str, int] = {}
        for worker_id, count in plan.items():
            moved[worker_id] = self.workers.move_newest(worker_id, count, "rebalance")
        if moved:
            logger.info("pool %s: rebalance moves %s", pool.name, moved)
        return {"pool": pool.name, "moved": moved}

    def _pool(self, name: str) -> Pool:
        pool = self.pools.get(name)
        if pool is None:
            raise PoolError(f"unknown pool {name!r} (this server has: {', '.join(self.pools)})")
        return pool

    def _set_target(self, pool: Pool, target: int) -> None:
        pool.target = target
        self.metrics.pool_target.labels(pool.name).set(target)

    # -- keeping a pool at its target ---------------------------------------------------------------
    def _reconcile(self, pool: Pool) -> None:
        if self._closing or not self._serving:
            return
        supply = [
            w
            for w in self.workers.views(pool.name)
            if w.state not in (WorkerState.DRAINING, WorkerState.STOPPED)
            and w.worker_id not in pool.replacing
        ]
        if len(supply) < pool.target:
            if clock.monotonic() < pool.retry_at:
                return
            for _ in range(pool.target - len(supply)):
                self._start_worker(pool)
        elif len(supply) > pool.target:
            # The cheapest to give up first: one still starting, one that is down, then the one
            # with the least resident work (requests, then KV blocks), the newest of equals.
            order = {WorkerState.STARTING: 0, WorkerState.DOWN: 1, WorkerState.UP: 2}
            supply.sort(
                key=lambda w: (
                    order.get(w.state, 3),
                    w.streams,
                    w.load.kv_blocks_used if w.load else 0,
                    -w.opened_at,
                )
            )
            for worker in supply[: len(supply) - pool.target]:
                self._begin_drain(pool, worker)

    def _begin_drain(self, pool: Pool, worker: WorkerView) -> None:
        worker_id = worker.worker_id
        self.workers.drain(worker_id)
        starting = pool.starting.pop(worker_id, None)
        if starting is not None:
            starting.cancel()  # the backend stops what it had started
        if worker.state is WorkerState.STARTING:  # not up yet: nothing to drain, just stop it
            self._spawn(self._stop(pool, worker_id, "cancelled"), f"stop-{worker_id}")
            return
        logger.info("worker %s: draining (%d streams)", worker_id, worker.streams)
        pool.drains[worker_id] = self._spawn(self._drain(pool, worker_id), f"drain-{worker_id}")

    async def _drain(self, pool: Pool, worker_id: str) -> None:
        outcome = await drain.drain(
            self.workers, worker_id, self.drain_timeout, moves_streams=pool.name in STREAM_POOLS
        )
        await self._stop(pool, worker_id, outcome)

    async def _stop(self, pool: Pool, worker_id: str, outcome: str) -> None:
        """After a drain: stop the worker and forget it. Past the drain timeout, what it still
        holds ends here (its streams with an error event, its prompts prefilled again)."""
        try:
            reason = {"ok": "drained", "cancelled": "stopped before it started"}.get(
                outcome, f"drain ended: {outcome}"
            )
            if outcome == "timeout":
                reason = f"--drain-timeout ({self.drain_timeout:g} s) passed while draining"
            self.metrics.worker_drains.labels(pool.name, outcome).inc()
            view = self.workers.view(worker_id)
            ready = view.ready if view is not None else None
            await self.workers.remove_worker(worker_id, reason, forget=False)
            await self.backend.stop_worker(worker_id, graceful=True, timeout=self.stop_timeout)
            # Only now: until it stopped, a late pull could have mapped its segment again.
            self.workers.forget_kv(ready)
            logger.info("worker %s: %s; stopped", worker_id, reason)
        finally:
            pool.drains.pop(worker_id, None)

    # -- starting workers ---------------------------------------------------------------------------
    def _start_worker(self, pool: Pool) -> str:
        worker_id = f"{pool.name}-{pool.next_index}"
        pool.next_index += 1
        self.workers.add_worker(worker_id, pool.name)
        pool.starting[worker_id] = self._spawn(self._run_start(pool, worker_id), f"start-{worker_id}")
        return worker_id

    async def _run_start(self, pool: Pool, worker_id: str) -> None:
        try:
            handle = await self.backend.start_worker(pool.spec.config(worker_id), self.start_timeout)
        except WorkerStartError as exc:
            self._start_failed(pool, str(exc))
            await self.workers.remove_worker(worker_id, f"failed to start: {exc}")
            return
        finally:
            pool.starting.pop(worker_id, None)
        worker = self.workers.view(worker_id)
        if worker is None or worker.state is WorkerState.DRAINING:  # drained or removed while it started
            await self.backend.stop_worker(worker_id, graceful=True, timeout=self.stop_timeout)
            return
        pool.handles[worker_id] = handle
        self.workers.connect(worker_id, handle.rpc_address, handle.rpc_public_key)
        deadline = clock.monotonic() + self.start_timeout
        while (worker := self.workers.view(worker_id)) is not None and worker.state is WorkerState.STARTING:
            left = deadline - clock.monotonic()
            if left <= 0:
                break
            await self.workers.wait_for_change(left)
        if worker is None or worker.state is not WorkerState.UP:
            return  # it ended, or never said Ready over its connection: its exit (or reconcile) follows
        pool.last_error = None
        if self._serving and self.rebalance_on_start and pool.name in STREAM_POOLS:
            self.rebalance(pool.name)

    def _start_failed(self, pool: Pool, error: str) -> None:
        pool.last_error = error
        pool.failures += 1
        pause = min(60.0, 2.0 ** (pool.failures - 1))
        pool.retry_at = clock.monotonic() + pause
        logger.error("pool %s: %s (next try in %g s)", pool.name, error, pause if self._serving else 0)

    def _on_exit(self, exit: WorkerExit) -> None:
        """A worker ended (asked to or not): its worker goes, and with it its metric series. The pool
        is brought back to its target by the keeper."""
        for pool in self.pools.values():
            pool.handles.pop(exit.worker_id, None)
        self._killing.discard(exit.worker_id)
        if self._closing:
            return
        worker = self.workers.view(exit.worker_id)
        if not exit.expected and worker is not None:
            draining = worker.state is WorkerState.DRAINING
            pool = self.pools[worker.pool]
            up_at = worker.up_at  # when it first said Ready
            if up_at is not None and clock.monotonic() - up_at < self.settings.settle_seconds:
                self._start_failed(
                    pool,
                    f"worker {exit.worker_id} {exit.reason} {clock.monotonic() - up_at:.0f} s after it started",
                )
            if self.replace_failed and not draining:
                logger.error("worker %s %s: a new one takes its place", exit.worker_id, exit.reason)
            elif not draining:
                logger.error("worker %s %s: pool %s shrinks by one", exit.worker_id, exit.reason, pool.name)
                self._set_target(pool, max(0, pool.target - 1))
        self._spawn(self.workers.remove_worker(exit.worker_id, exit.reason), f"remove-{exit.worker_id}")

    # -- what GET /pools shows ------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        view: dict[str, Any] = {
            "pools": {name: self._describe_pool(pool) for name, pool in self.pools.items()}
        }
        for section, describe in self.describers.items():
            view[section] = describe()
        return view

    def _describe_pool(self, pool: Pool) -> dict[str, Any]:
        views = self.workers.views(pool.name)
        return {
            "pool": pool.name,
            "target": pool.target,
            "min": pool.spec.min,
            "max": pool.spec.max,
            "last_error": pool.last_error,
            "workers": [
                self._describe_worker(worker, pool.handles.get(worker.worker_id)) for worker in views
            ],
        }

    @staticmethod
    def _describe_worker(worker: WorkerView, handle: WorkerHandle | None) -> dict[str, Any]:
        load = worker.load
        view: dict[str, Any] = {
            "id": worker.worker_id,
            "pool": worker.pool,
            "state": worker.state.value,
            "detail": worker.detail,
            "streams": worker.streams,
            "running": load.num_running if load else None,
            "waiting": load.num_waiting if load else None,
            "kv_blocks_used": load.kv_blocks_used if load else None,
            "kv_blocks_free": load.kv_blocks_free if load else None,
            "queued_prompt_tokens": load.queued_prompt_tokens if load else None,
            "held_leases": load.num_held if load else None,
            "prefill_tokens_per_s": worker.prefill_tokens_per_s,
            "last_step_s": load.last_step_ms / 1000 if load else None,
            # Since it first said Ready: its first steps (the cost model's cold start) are left out.
            "up_s": round(clock.monotonic() - worker.up_at, 3) if worker.up_at is not None else None,
        }
        if handle is not None:
            view.update(rpc_address=handle.rpc_address, node=handle.node, **handle.details)
        return view
