"""The `local` cluster backend: workers as child processes on this host. No torch.

Each worker is `python -m pdserve.worker`, given its `WorkerConfig` as JSON and its secrets in its
environment (`PDSERVE_WORKER_CONFIG`, `PDSERVE_WORKER_SECRETS`: the environment of a process is
readable by its owner only, its command line by everyone). It binds its own RPC socket (any free port), then writes its `Ready` (with the
address it got) as one JSON line to a pipe whose fd is in `PDSERVE_READY_FD`: no port is picked
here and bound there later, so no other process can take it in between.

Workers are pinned one per CPU where the OS allows (the least used CPU first), so that two
workers on two cores do not fight. They die with the process that started them (each asks for
PR_SET_PDEATHSIG first thing, see `pdserve.worker.main`), so even a SIGKILLed `pdserve serve`
leaves no orphan; `stop_worker`
sends SIGTERM (the worker then removes its shared-memory segment) and kills what does not stop in
time. Nothing here blocks the event loop: processes are watched with `asyncio` subprocesses.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

import msgspec

from pdserve import wire
from pdserve.cluster.base import ClusterError, ExitCallback, WorkerExit, WorkerHandle, WorkerStartError
from pdserve.config import WORKER_CONFIG_ENV, WORKER_PARENT_ENV, WORKER_READY_FD_ENV, WorkerConfig
from pdserve.devices import sm_share_env, visible_devices
from pdserve.security import WorkerSecrets, worker_env
from pdserve.transfer.segments import sweep_dead_segments

logger = logging.getLogger(__name__)
ROUTER_KEY_ENV = ("PDSERVE_API_KEY", "PDSERVE_ADMIN_KEY", "PDSERVE_METRICS_KEY")


def worker_command(
    config: WorkerConfig, secrets: WorkerSecrets, python: str = sys.executable
) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of a worker process (without the ready fd). The worker id
    on the command line is only a label for `ps`; the configuration and the secrets are in the
    environment."""
    # Not the router's HTTP keys: a worker needs none of them, and nothing it starts should see them.
    env = {k: v for k, v in os.environ.items() if k not in ROUTER_KEY_ENV}
    env.update(worker_env(secrets))
    env[WORKER_CONFIG_ENV] = msgspec.json.encode(config).decode()
    env[WORKER_PARENT_ENV] = str(os.getpid())
    env.update(visible_devices(config.gpu))  # confined to its GPU (where it has one)
    env.update(sm_share_env(config.sm_share))  # and to its share of the GPU's multiprocessors
    return [python, "-m", "pdserve.worker", "--worker-id", config.worker_id], env


def decode_ready(line: bytes) -> wire.Ready:
    """The line a worker writes to its ready fd."""
    try:
        return msgspec.json.decode(line, type=wire.Ready)
    except msgspec.DecodeError as exc:
        raise WorkerStartError(f"a worker reported something that is not a Ready message: {exc}") from exc


def start_worker_process(
    config: WorkerConfig, secrets: WorkerSecrets, timeout: float = 120.0, **popen: Any
) -> tuple[subprocess.Popen[bytes], wire.Ready]:
    """Start one worker and wait (blocking) for its Ready: for scripts and tests that talk to a
    worker directly (as a router whose key is in `secrets`: see pdserve.security.curve_client).
    Serving uses `LocalCluster`, which never blocks its event loop."""
    argv, env = worker_command(config, secrets)
    read_fd, write_fd = os.pipe()
    env[WORKER_READY_FD_ENV] = str(write_fd)
    try:
        process = subprocess.Popen(argv, env=env, pass_fds=(write_fd,), **popen)
    finally:
        os.close(write_fd)
    with os.fdopen(read_fd, "rb") as pipe:
        ready, _, _ = select.select([pipe], [], [], timeout)
        line = pipe.readline() if ready else b""
    if not line:
        process.kill()
        code = process.wait()
        raise WorkerStartError(f"worker {config.worker_id} {exit_reason(code)} before it was ready")
    return process, decode_ready(line)


def exit_reason(returncode: int) -> str:
    if returncode < 0:
        return f"killed by signal {-returncode} ({signal.Signals(-returncode).name})"
    return f"exited with code {returncode}"


@dataclass(eq=False)
class _LocalWorker:
    config: WorkerConfig
    process: asyncio.subprocess.Process
    handle: WorkerHandle | None = None
    stopping: bool = False
    watcher: asyncio.Task[None] | None = field(default=None, repr=False)


class LocalCluster:
    name = "local"

    def __init__(
        self, secrets: WorkerSecrets, *, pin_cpus: bool = True, python: str = sys.executable
    ) -> None:
        """`secrets`: what every worker is handed (the router keys it obeys, the KV secret)."""
        self._secrets = secrets
        self.pin_cpus = pin_cpus and hasattr(os, "sched_getaffinity")
        self.python = python
        self._workers: dict[str, _LocalWorker] = {}
        self._cpus: dict[str, str | None] = {}  # worker id -> its CPUs, from the start of its start
        self._on_exit: ExitCallback | None = None
        self.node = socket.gethostname()

    def set_exit_callback(self, callback: ExitCallback) -> None:
        self._on_exit = callback

    def _pick_cpu(self) -> str | None:
        """The allowed CPU with the fewest of our workers on it (the lowest number on a tie)."""
        if not self.pin_cpus:
            return None
        allowed = sorted(os.sched_getaffinity(0))
        used = Counter(self._cpus.values())
        return str(min(allowed, key=lambda cpu: (used[str(cpu)], cpu)))

    async def start_worker(self, config: WorkerConfig, timeout: float) -> WorkerHandle:
        if config.worker_id in self._cpus:
            raise ClusterError(f"worker {config.worker_id} is already running")
        config = replace(config, cpus=config.cpus or self._pick_cpu(), node_id=config.node_id or self.node)
        self._cpus[config.worker_id] = config.cpus  # before any await: the next start sees it
        try:
            return await self._start(config, timeout)
        except BaseException:
            if config.worker_id not in self._workers:
                self._cpus.pop(config.worker_id, None)
            raise

    async def _start(self, config: WorkerConfig, timeout: float) -> WorkerHandle:
        argv, env = worker_command(config, self._secrets, self.python)
        read_fd, write_fd = os.pipe()
        env[WORKER_READY_FD_ENV] = str(write_fd)
        logger.info(
            "starting worker %s (%s)%s",
            config.worker_id,
            config.pool,
            f" on cpu {config.cpus}" * bool(config.cpus),
        )
        try:
            # A session of its own: Ctrl-C in the terminal reaches `pdserve serve` alone, which
            # lets running streams finish before it stops the workers itself.
            process = await asyncio.create_subprocess_exec(
                *argv, env=env, pass_fds=(write_fd,), start_new_session=True
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)  # the child has its own copy; EOF here once the child is gone
        worker = _LocalWorker(config, process)
        self._workers[config.worker_id] = worker
        worker.watcher = asyncio.create_task(self._watch(worker), name=f"watch-{config.worker_id}")
        try:
            ready = await self._read_ready(worker, read_fd, timeout)
        except BaseException:  # failed, timed out or cancelled: nothing may be left running
            await self.stop_worker(config.worker_id, graceful=False)
            raise
        worker.handle = WorkerHandle(
            worker_id=config.worker_id,
            pool=config.pool,
            rpc_address=ready.rpc_address,
            kv_address=ready.kv_address,
            node=self.node,
            rpc_public_key=ready.rpc_public_key,
            details={"pid": process.pid, **({"cpus": config.cpus} if config.cpus else {})},
        )
        logger.info("worker %s is ready on %s (pid %d)", config.worker_id, ready.rpc_address, process.pid)
        return worker.handle

    async def _read_ready(self, worker: _LocalWorker, read_fd: int, timeout: float) -> wire.Ready:
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        pipe = os.fdopen(read_fd, "rb", buffering=0)
        transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
        try:
            async with asyncio.timeout(timeout):
                line = await reader.readline()
                if not line:  # EOF: the process ended (or closed the fd) without reporting
                    code = await worker.process.wait()
                    raise WorkerStartError(
                        f"worker {worker.config.worker_id} {exit_reason(code)} while starting "
                        "(its log above says why)"
                    )
        except TimeoutError:
            raise WorkerStartError(
                f"worker {worker.config.worker_id} did not report ready within {timeout:g} s"
            ) from None
        finally:
            transport.close()
        return decode_ready(line)

    async def _watch(self, worker: _LocalWorker) -> None:
        code = await worker.process.wait()
        worker_id = worker.config.worker_id
        if self._workers.get(worker_id) is worker:
            del self._workers[worker_id]
            self._cpus.pop(worker_id, None)
        reason = exit_reason(code)
        if worker.stopping:
            logger.info("worker %s stopped (%s)", worker_id, reason)
        elif worker.handle is not None:  # a start that fails says so through start_worker
            logger.error("worker %s (pid %d) %s", worker_id, worker.process.pid, reason)
        if self._on_exit is not None and worker.handle is not None:
            self._on_exit(WorkerExit(worker_id, expected=worker.stopping, reason=reason))

    async def stop_worker(self, worker_id: str, *, graceful: bool = True, timeout: float = 15.0) -> None:
        worker = self._workers.get(worker_id)
        if worker is None:
            return
        worker.stopping = True
        process = worker.process
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM if graceful else signal.SIGKILL)
        try:
            async with asyncio.timeout(timeout if graceful else 10.0):
                await process.wait()
        except TimeoutError:
            logger.error(
                "worker %s (pid %d) did not stop within %g s: killing it", worker_id, process.pid, timeout
            )
            with contextlib.suppress(ProcessLookupError):
                process.kill()
            await process.wait()
        if worker.watcher is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await worker.watcher  # the exit is reported before this returns

    def workers(self) -> list[WorkerHandle]:
        return [w.handle for w in self._workers.values() if w.handle is not None]

    async def close(self, timeout: float = 15.0) -> None:
        await asyncio.gather(*(self.stop_worker(w, timeout=timeout) for w in list(self._workers)))
        # A worker killed together with its resource tracker (an OOM kill of the process group)
        # left its KV segment behind: remove what no live process owns.
        await asyncio.to_thread(sweep_dead_segments)
