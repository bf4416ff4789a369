"""The `ray` cluster backend: each worker a Ray actor that runs the worker process on its node.
No torch (Ray itself is an optional extra, `pdserve[ray]`, imported only when this backend is used).

The actor is a small keeper, not the engine: it starts `python -m pdserve.worker` on its node as
the `local` backend does (configuration and secrets in the child's environment, never its command
line; the child binds its own sockets on the node's address and reports them on a pipe), and
returns the worker's `Ready`. The engine process asks for PR_SET_PDEATHSIG against the thread that
started it, which lives as long as the child does, so it never outlives its actor: an actor that
is killed, or a node that is lost, takes its worker with it. The router then connects to the
worker's own address, as on one host.

Each pool's actors are placed by Ray: custom resources that an operator gives the nodes meant for
that pool (`--ray-prefill-resources '{"pdserve_prefill": 1}'`), CPUs and GPUs, and a strategy
(pack: Ray's default, fill a node before the next; spread: one node after another). A worker
whose actor cannot be placed within the start timeout is a failed start, with the reason, not a
hang. The end of a worker is seen by a call that the actor answers when its process ends; a dead
actor or a lost node fails that call (RayActorError) and is reported as an unexpected exit.

Worker logs: the process inherits the actor's stdout and stderr, which Ray writes to the node's
log files and forwards to the driver (`pdserve serve`'s terminal).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from pdserve import wire
from pdserve.cluster.base import ClusterError, ExitCallback, WorkerExit, WorkerHandle, WorkerStartError
from pdserve.cluster.local import exit_reason, start_worker_process
from pdserve.config import WorkerConfig
from pdserve.security import WorkerSecrets

logger = logging.getLogger(__name__)

RAY_NAMESPACE = "pdserve"
STRATEGIES = {"pack": "DEFAULT", "spread": "SPREAD"}


@dataclass(frozen=True)
class RayPlacement:
    """Where one pool's actors may run: what each takes from its node, and how they spread."""

    resources: dict[str, float] = field(default_factory=dict)  # custom resources, per worker
    num_cpus: float = 1.0  # the worker's engine thread runs on the node's CPUs
    num_gpus: float = 0.0
    strategy: str = "pack"  # pack | spread

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ClusterError(f"ray placement strategy must be pack or spread, got {self.strategy!r}")
        for name, amount in {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, **self.resources}.items():
            if not amount >= 0:
                raise ClusterError(f"ray resource {name} must be >= 0, got {amount}")
            if 0 < amount < 0.0001:  # Ray's smallest unit
                raise ClusterError(f"ray resource {name} must be 0 or at least 0.0001, got {amount}")
        reserved = {"CPU", "GPU", "memory", "object_store_memory"} & set(self.resources)
        if reserved:
            raise ClusterError(
                f"ray resources {sorted(reserved)} are Ray's own: give CPUs and GPUs with "
                "--ray-num-cpus / --ray-num-gpus (or num_cpus / num_gpus in [pools.NAME.ray])"
            )
        if self.num_gpus > 1 and self.num_gpus != int(self.num_gpus):
            raise ClusterError(f"ray num_gpus above 1 must be a whole number, got {self.num_gpus}")


def parse_resources(text: str | None, flag: str) -> dict[str, float]:
    """`{"pdserve_prefill": 1}` (JSON) -> a resource dict; ClusterError naming `flag` otherwise."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ClusterError(
            f"{flag}: expected a JSON object like '{{\"pdserve_prefill\": 1}}': {exc}"
        ) from None
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
        for k, v in value.items()
    ):
        raise ClusterError(f"{flag}: expected a JSON object of resource names to numbers, got {text!r}")
    return {k: float(v) for k, v in value.items()}


class WorkerKeeper:
    """The actor (made remote by `RayCluster`): starts one worker process on its node, reports
    its end, stops it. Its methods run on Ray's threads (a threaded actor), so `wait` can block
    while `stop` is called."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._exited = threading.Event()
        self._code: int | None = None

    def start(self, config_json: bytes, secrets_json: bytes, timeout: float) -> dict[str, Any]:
        import ray

        ip = ray.util.get_node_ip_address()  # type: ignore[no-untyped-call]
        node_id = ray.get_runtime_context().get_node_id()
        if not ray.get_gpu_ids():
            # Ray (2.60) leaves an actor given no GPU every GPU of its node: the worker must not
            # take one that Ray may give another actor (its engine would pick `cuda` by itself).
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        config = msgspec.json.decode(config_json, type=WorkerConfig)
        # Its sockets on this node's address (the router and the other workers reach it there);
        # the Ray node names the node, so that workers on one node pull KV over shm (same-node shm).
        config = replace(config, rpc_bind=f"tcp://{ip}:*", kv_host=ip, node_id=node_id)
        secrets = msgspec.json.decode(secrets_json, type=WorkerSecrets)
        started: concurrent.futures.Future[wire.Ready] = concurrent.futures.Future()

        def keep() -> None:  # the child's parent thread: alive exactly as long as the child
            try:
                process, ready = start_worker_process(config, secrets, timeout)
            except BaseException as exc:
                started.set_exception(exc)
                self._exited.set()
                return
            self._process = process
            started.set_result(ready)
            self._code = process.wait()
            self._exited.set()

        threading.Thread(target=keep, name=f"keep-{config.worker_id}", daemon=True).start()
        ready = started.result()
        assert self._process is not None
        return {
            "ready": msgspec.json.encode(ready),
            "pid": self._process.pid,
            "node_ip": ip,
            "node_id": node_id,
        }

    def wait(self) -> int | None:
        """Returns once the worker process has ended: its exit code."""
        self._exited.wait()
        return self._code

    def stop(self, graceful: bool, timeout: float) -> int | None:
        process = self._process
        if process is None:
            return None
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
        if not self._exited.wait(timeout if graceful else 10.0):
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            self._exited.wait(10.0)
        return self._code


def sweep_node() -> list[str]:
    """Run as a Ray task on one node: remove the KV segments there that no live process owns
    (a worker killed with its whole process tree: a lost raylet, an OOM kill)."""
    from pdserve.transfer.segments import sweep_dead_segments

    return sweep_dead_segments()


@dataclass(eq=False)
class _RayWorker:
    config: WorkerConfig
    actor: Any
    handle: WorkerHandle | None = None
    stopping: bool = False
    watcher: asyncio.Task[None] | None = field(default=None, repr=False)


class RayCluster:
    name = "ray"

    def __init__(
        self,
        secrets: WorkerSecrets,
        address: str,
        placements: dict[str, RayPlacement] | None = None,
        connect_timeout: float = 30.0,
    ) -> None:
        self._secrets = secrets
        self.address = address
        self.placements = placements or {}
        self.connect_timeout = connect_timeout
        self._workers: dict[str, _RayWorker] = {}
        self._nodes_used: set[str] = set()  # the Ray nodes this deployment ran workers on
        self._on_exit: ExitCallback | None = None
        self._keeper: Any = None
        self._connected_here = False
        self._connecting = asyncio.Lock()

    def set_exit_callback(self, callback: ExitCallback) -> None:
        self._on_exit = callback

    async def connect(self) -> None:
        """Join the Ray cluster at `address`; ClusterError (not a hang) when there is none."""
        async with self._connecting:  # one ray.init, however many starts ask at once
            if self._keeper is None:
                await self._connect()

    async def _connect(self) -> None:
        try:
            import ray
        except ImportError:
            raise ClusterError("--cluster ray needs Ray: pip install 'pdserve[ray]'") from None
        if not ray.is_initialized():
            # ray.init retries an address where nothing listens for minutes: a plain connect first.
            await self._probe()
            loop = asyncio.get_running_loop()
            joined: asyncio.Future[None] = loop.create_future()

            def settle(exc: BaseException | None) -> None:
                if not joined.done():
                    if exc is None:
                        joined.set_result(None)
                    else:
                        joined.set_exception(exc)

            def join() -> None:
                try:
                    ray.init(address=self.address, namespace=RAY_NAMESPACE, logging_level=logging.WARNING)
                except BaseException as exc:
                    loop.call_soon_threadsafe(settle, exc)
                    return
                loop.call_soon_threadsafe(settle, None)

            # A daemon thread, not the executor's: one stuck in ray.init must not hold up the exit.
            threading.Thread(target=join, name="ray-init", daemon=True).start()
            try:
                async with asyncio.timeout(self.connect_timeout):
                    await asyncio.shield(joined)
            except TimeoutError:
                raise ClusterError(
                    f"no Ray cluster answered at {self.address!r} within {self.connect_timeout:g} s "
                    "(start one with `ray start --head`, or give --ray-address)"
                ) from None
            except (ConnectionError, RuntimeError, ValueError) as exc:
                raise ClusterError(f"cannot join the Ray cluster at {self.address!r}: {exc}") from None
            self._connected_here = True  # this process joined: it leaves when it closes
        self._keeper = ray.remote(max_concurrency=4)(WorkerKeeper)  # type: ignore[call-overload]

    async def _probe(self) -> None:
        """ClusterError if nothing listens at a host:port address within the connect timeout
        (tried again every second: a head that is still starting, as beside a KubeRay sidecar,
        gets the time it needs); auto and ray:// are left to Ray, which fails fast on them."""
        if self.address == "auto" or "://" in self.address:
            return
        host, _, port = self.address.rpartition(":")
        host = host.strip("[]")  # [::1]:6379
        if not host or not port.isdigit():
            raise ClusterError(
                f"--ray-address must be host:port, auto or ray://host:port, got {self.address!r}"
            )

        def connect() -> None:
            socket.create_connection((host, int(port)), timeout=min(5.0, self.connect_timeout)).close()

        deadline = time.monotonic() + self.connect_timeout
        while True:
            try:
                await asyncio.to_thread(connect)
                return
            except OSError as exc:
                if time.monotonic() + 1.0 > deadline:
                    raise ClusterError(
                        f"no Ray cluster at {self.address!r} ({exc}) within {self.connect_timeout:g} s: "
                        "start one with `ray start --head`, or give the address of its head with --ray-address"
                    ) from None
            await asyncio.sleep(1.0)

    async def start_worker(self, config: WorkerConfig, timeout: float) -> WorkerHandle:
        import ray

        try:
            await self.connect()
        except ClusterError as exc:
            raise WorkerStartError(f"worker {config.worker_id}: {exc}") from None
        if config.worker_id in self._workers:
            raise ClusterError(f"worker {config.worker_id} is already running")
        placement = self.placements.get(config.pool, RayPlacement())
        worker = _RayWorker(replace(config, cpus=None), None)
        self._workers[config.worker_id] = worker
        logger.info("starting worker %s (%s) as a Ray actor %s", config.worker_id, config.pool, placement)
        config_json = msgspec.json.encode(worker.config)
        try:
            async with asyncio.timeout(timeout):
                # Off the loop: creating an actor writes to the cluster's control store.
                worker.actor = await asyncio.to_thread(self._new_actor, placement)
                if worker.stopping:
                    raise WorkerStartError(f"worker {config.worker_id} was stopped while it started")
                started = await worker.actor.start.remote(
                    config_json, msgspec.json.encode(self._secrets), timeout
                )
            if worker.stopping:  # stopped while it started
                raise WorkerStartError(f"worker {config.worker_id} was stopped while it started")
        except BaseException as exc:  # failed, timed out or cancelled: nothing may be left running
            self._workers.pop(config.worker_id, None)
            await self._kill(worker)
            if isinstance(exc, TimeoutError):
                raise WorkerStartError(
                    f"worker {config.worker_id} was not ready within {timeout:g} s: no Ray node has "
                    f"what its pool asks for ({placement}), or its model loads slowly"
                ) from None
            if isinstance(exc, ray.exceptions.RayTaskError):
                cause = getattr(exc, "cause", None) or exc
                raise WorkerStartError(f"worker {config.worker_id} did not start on Ray: {cause}") from None
            if isinstance(exc, ray.exceptions.RayError | ValueError | TypeError):  # ValueError: options
                raise WorkerStartError(f"worker {config.worker_id} did not start on Ray: {exc}") from None
            raise
        ready = msgspec.json.decode(started["ready"], type=wire.Ready)
        self._nodes_used.add(started["node_id"])
        worker.handle = WorkerHandle(
            worker_id=config.worker_id,
            pool=config.pool,
            rpc_address=ready.rpc_address,
            kv_address=ready.kv_address,
            node=started["node_id"],
            rpc_public_key=ready.rpc_public_key,
            details={
                "pid": started["pid"],
                "node_ip": started["node_ip"],
                "actor": worker.actor._actor_id.hex(),
            },
        )
        worker.watcher = asyncio.create_task(self._watch(worker), name=f"watch-{config.worker_id}")
        logger.info(
            "worker %s is ready on %s (node %s, pid %d)",
            config.worker_id,
            ready.rpc_address,
            started["node_id"][:12],
            started["pid"],
        )
        return worker.handle

    def _new_actor(self, placement: RayPlacement) -> Any:
        return self._keeper.options(
            num_cpus=placement.num_cpus,
            num_gpus=placement.num_gpus,
            resources=placement.resources,
            scheduling_strategy=STRATEGIES[placement.strategy],
            max_restarts=0,
        ).remote()

    async def _kill(self, worker: _RayWorker) -> None:
        """Kill the actor (its worker process goes with it); off the loop: it may wait on the
        cluster's control store."""
        if worker.actor is None:
            return
        import ray

        with contextlib.suppress(Exception):
            await asyncio.to_thread(ray.kill, worker.actor, no_restart=True)

    async def _watch(self, worker: _RayWorker) -> None:
        import ray

        reason = "ended"
        try:
            while True:
                try:
                    code = await worker.actor.wait.remote()
                    reason = exit_reason(code) if code is not None else "ended"
                    break
                except ray.exceptions.ActorUnavailableError:
                    await asyncio.sleep(1.0)  # unreachable for now (a network blip): ask again
                except ray.exceptions.RayActorError as exc:
                    reason = f"its Ray actor died (actor killed or node lost): {str(exc).splitlines()[0]}"
                    break
                except ray.exceptions.RayError as exc:
                    reason = f"its Ray actor failed: {type(exc).__name__}: {str(exc).splitlines()[0]}"
                    break
        finally:
            worker_id = worker.config.worker_id
            if self._workers.get(worker_id) is worker:
                del self._workers[worker_id]
            if worker.stopping:
                logger.info("worker %s stopped (%s)", worker_id, reason)
            else:
                logger.error("worker %s %s", worker_id, reason)
            await self._kill(worker)
            if self._on_exit is not None:
                self._on_exit(WorkerExit(worker_id, expected=worker.stopping, reason=reason))
            if not worker.stopping and worker.handle is not None:
                # Its KV segment may be left on its node (if the node lives on): free that memory.
                await self._sweep_nodes({worker.handle.node})

    async def _sweep_nodes(self, node_ids: set[str], timeout: float = 30.0) -> None:
        """Remove dead workers' KV segments on those of `node_ids` that are alive; a failure is
        logged, never raised (the sweep is cleanup)."""
        if not node_ids:
            return
        import ray
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        def sweep() -> None:
            nodes = ray.nodes()  # type: ignore[no-untyped-call]
            alive = [n["NodeID"] for n in nodes if n.get("Alive") and n["NodeID"] in node_ids]
            task = ray.remote(num_cpus=0, max_retries=0)(sweep_node)
            refs = {
                node: task.options(
                    scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)
                ).remote()
                for node in alive
            }
            deadline = time.monotonic() + timeout
            for node, ref in refs.items():
                try:
                    ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
                except Exception as exc:
                    logger.warning(
                        "could not sweep node %s for dead workers' KV segments: %s", node[:12], exc
                    )
                    ray.cancel(ref, force=True)

        try:
            await asyncio.to_thread(sweep)
        except Exception as exc:
            logger.warning("could not sweep the Ray nodes for dead workers' KV segments: %s", exc)

    async def stop_worker(self, worker_id: str, *, graceful: bool = True, timeout: float = 15.0) -> None:
        import ray

        worker = self._workers.get(worker_id)
        if worker is None:
            return
        worker.stopping = True
        if worker.handle is None:  # still starting: its start sees `stopping` and cleans up
            await self._kill(worker)
            return
        try:
            async with asyncio.timeout(timeout + 20.0):
                await worker.actor.stop.remote(graceful, timeout)
        except (TimeoutError, ray.exceptions.RayError) as exc:
            logger.warning(
                "worker %s: its actor did not stop it cleanly (%s): killing the actor", worker_id, exc
            )
        finally:
            await self._kill(worker)  # the keeper goes; PDEATHSIG takes what is left
        if worker.watcher is not None:
            # Shielded: a cancelled stop must not cancel the watcher, which reports the exit.
            await asyncio.shield(worker.watcher)

    def workers(self) -> list[WorkerHandle]:
        return [w.handle for w in self._workers.values() if w.handle is not None]

    async def close(self, timeout: float = 15.0) -> None:
        await asyncio.gather(*(self.stop_worker(w, timeout=timeout) for w in list(self._workers)))
        # Leave no segment on any node that ran a worker: one killed with its process tree (a
        # lost node whose host lives on, an OOM kill) left its segment there.
        if self._keeper is not None:
            await self._sweep_nodes(self._nodes_used)
        if self._connected_here:
            import ray

            await asyncio.to_thread(ray.shutdown)
            self._connected_here = False
