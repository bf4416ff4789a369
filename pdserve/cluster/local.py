"""The `local` cluster backend: workers as child processes on this host. No torch.

Each worker is `python -m pdserve.worker` with its own RPC port on 127.0.0.1, one torch thread by
default, and (where the OS allows) pinned to its own CPU, so that two workers on two cores do not
fight. Workers die with the process that started them (PR_SET_PDEATHSIG on Linux), so even a
SIGKILLed `pdserve serve` leaves no orphan behind; `stop()` asks each to stop (SIGTERM: a worker
then removes its shared-memory segment) and kills what does not stop in time.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    worker_id: str
    role: str  # prefill | decode | mixed
    extra_args: tuple[str, ...] = ()  # more `python -m pdserve.worker` flags for this one


@dataclass
class LocalWorker:
    spec: WorkerSpec
    address: str
    process: subprocess.Popen[bytes]
    cpus: str | None = None
    exit_logged: bool = field(default=False, repr=False)

    @property
    def alive(self) -> bool:
        return self.process.poll() is None


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    """Runs in the child between fork and exec: ask the kernel for SIGTERM when the parent dies."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass  # not Linux: stop() still stops the workers on every normal exit


class LocalCluster:
    def __init__(
        self,
        model: str,
        specs: Sequence[WorkerSpec],
        common_args: Sequence[str] = (),
        pin_cpus: bool = True,
        python: str = sys.executable,
    ) -> None:
        ids = [s.worker_id for s in specs]
        if len(set(ids)) != len(ids):
            raise ValueError(f"worker ids must be unique, got {ids}")
        self.model = model
        self.specs = list(specs)
        self.common_args = list(common_args)
        self.pin_cpus = pin_cpus and hasattr(os, "sched_getaffinity")
        self.python = python
        self.workers: dict[str, LocalWorker] = {}

    def start(self) -> None:
        cpus = sorted(os.sched_getaffinity(0)) if self.pin_cpus else []
        for i, spec in enumerate(self.specs):
            self.start_worker(spec, str(cpus[i % len(cpus)]) if cpus else None)

    def start_worker(self, spec: WorkerSpec, cpus: str | None = None) -> LocalWorker:
        address = f"tcp://127.0.0.1:{free_port()}"
        cmd = [self.python, "-m", "pdserve.worker", "--model", self.model, "--role", spec.role]
        cmd += ["--worker-id", spec.worker_id, "--rpc", address, *self.common_args, *spec.extra_args]
        if cpus is not None:
            cmd += ["--cpus", cpus]
        logger.info(
            "starting worker %s (%s) on %s%s",
            spec.worker_id,
            spec.role,
            address,
            f", cpu {cpus}" if cpus else "",
        )
        # A session of its own: Ctrl-C in the terminal reaches `pdserve serve` alone, which lets
        # running streams finish before it stops the workers itself.
        process = subprocess.Popen(
            cmd, start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None
        )
        worker = LocalWorker(spec, address, process, cpus)
        self.workers[spec.worker_id] = worker
        return worker

    def addresses(self) -> list[tuple[str, str]]:
        return [(w.spec.worker_id, w.address) for w in self.workers.values()]

    def exited(self) -> list[LocalWorker]:
        """Workers whose process has ended (each is logged once)."""
        gone = [w for w in self.workers.values() if not w.alive]
        for w in gone:
            if not w.exit_logged:
                w.exit_logged = True
                logger.error(
                    "worker %s (pid %d) exited with code %s",
                    w.spec.worker_id,
                    w.process.pid,
                    w.process.returncode,
                )
        return gone

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM to every worker, then SIGKILL to any still running after `timeout` seconds."""
        for worker in self.workers.values():
            if worker.alive:
                worker.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for worker in self.workers.values():
            _stop(worker.process, max(0.0, deadline - time.monotonic()))
        self.workers.clear()


def _stop(process: subprocess.Popen[bytes], timeout: float) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        logger.error("worker pid %d did not stop within %.0f s: killing it", process.pid, timeout)
        process.kill()
        return process.wait()
