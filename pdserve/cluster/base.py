"""The cluster backend protocol: start, stop, list and watch workers. No torch.

A backend places worker processes somewhere (`local`: child processes on this host; `ray`: actors
on a Ray cluster) and knows nothing of requests. Everything above it (the pool manager, the
planner, `pdserve serve`) talks to workers through this protocol and through the addresses a
worker reports, never through a process object, so a backend can run workers anywhere.

- `start_worker(config)` returns once the worker has loaded its model, bound its own sockets and
  reported its addresses (`WorkerHandle`); a worker that dies or hangs on the way raises
  `WorkerStartError` with the reason, and leaves nothing behind.
- `stop_worker(id)` stops it (gracefully: the worker frees its resources; or killed).
- `on_exit` hears of every worker that ends, whether asked to or not.
Every method is async and none blocks the event loop.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from pdserve.config import WorkerConfig
from pdserve.errors import PdserveError


class ClusterError(PdserveError):
    """The backend could not do what was asked (no such worker, the cluster is gone)."""


class WorkerStartError(ClusterError):
    """A worker died, or did not report, while starting. The message says why."""


@dataclass(frozen=True)
class WorkerHandle:
    """A worker that has started: what it is and where the router reaches it."""

    worker_id: str
    pool: str
    rpc_address: str  # ZeroMQ address the worker bound, e.g. tcp://127.0.0.1:40123
    kv_address: str  # where its KV blocks can be read (shm segment, host:port), "" if nowhere
    node: str  # the host it runs on, as the backend names it
    rpc_public_key: str = ""  # its CURVE key, from its Ready: the router connects to no one else
    # Backend-specific facts for people (a pid, an actor id); shown by GET /pools, not relied on.
    details: dict[str, str | int] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerExit:
    worker_id: str
    expected: bool  # stopped through stop_worker (or close), not a crash
    reason: str  # "exited with code 1", "killed by signal 9", ...


ExitCallback = Callable[[WorkerExit], None]


class ClusterBackend(Protocol):
    name: str

    def set_exit_callback(self, callback: ExitCallback) -> None:
        """Called on the event loop for each worker that ends, once."""

    async def start_worker(self, config: WorkerConfig, timeout: float) -> WorkerHandle:
        """Start a worker and return once it is ready to serve, or raise WorkerStartError (also
        after `timeout` seconds). A cancelled start stops what it had started."""
        ...

    async def stop_worker(self, worker_id: str, *, graceful: bool = True, timeout: float = 15.0) -> None:
        """Stop a worker: asked to stop (graceful) and killed after `timeout`, or killed now.
        Unknown ids (already gone) are not an error."""
        ...

    def workers(self) -> list[WorkerHandle]:
        """The workers started and not yet ended."""
        ...

    async def close(self) -> None:
        """Stop every worker; nothing of them is left when this returns."""
        ...
