"""The worker set: views out, commands in. No torch.

Each worker has one `WorkerLink` (pdserve.router.link), over a `Channel` (pdserve.router.channel: ZeroMQ in production,
a scripted worker in tests), in one state (`pdserve.router.views.WorkerState`). The set changes
while serving: `add_worker`, `connect`, `drain`, `remove_worker`.

The control plane (pool manager, planner, placement, admission) reads `WorkerView` snapshots
(`views`, `view`) and acts through the set's commands (`drain`, `move_streams`, `forget_kv`);
`wait_for_change` wakes whoever waits on an outcome (a drain, a start) at the next change of any
worker instead of a poll. The data plane (the dispatcher) opens `Leg`s on links.

A worker is up from its `Ready` until the connection drops or it goes silent. A process whose
engine thread hangs (its ZeroMQ I/O thread still answers heartbeats) stops sending load reports
and is taken out after `stall_timeout`. Everything waiting on a dropped worker is told
(`WorkerDown`) straight away, so no stream hangs on a dead process; the legs it held are aborted
there if it answers again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable

from pdserve import wire
from pdserve.router.channel import Connector
from pdserve.router.link import Leg, LegEvent, WorkerDown, WorkerLink
from pdserve.router.views import DownCause, WorkerState, WorkerView

__all__ = [
    "DownCause",
    "Leg",
    "LegEvent",
    "WorkerDown",
    "WorkerLink",
    "WorkerSet",
    "WorkerState",
    "WorkerView",
]

logger = logging.getLogger(__name__)

STALL_TIMEOUT_S = 60.0  # no load report from a worker this long: taken out of service


class WorkerSet:
    """Every worker the router knows, by id. Workers are added, drained and removed while serving."""

    def __init__(self, connector: Connector, *, stall_timeout: float = STALL_TIMEOUT_S) -> None:
        self.connector = connector
        self.router_id = uuid.uuid4().hex  # this router, as its workers know it
        self.links: dict[str, WorkerLink] = {}
        self.stall_timeout = stall_timeout
        self._keeper: asyncio.Task[None] | None = None
        # Whoever records the workers (the router's metrics and signals): each load report, each
        # change of state, as the worker's view then.
        self.on_load: Callable[[WorkerView], None] | None = None
        self.on_state: Callable[[WorkerView], None] | None = None
        self._changed = asyncio.Event()

    # -- views ----------------------------------------------------------------------------------------
    def views(self, *pools: str) -> list[WorkerView]:
        """Every worker's view (of these pools, if any are named)."""
        return [w.view() for w in self.links.values() if not pools or w.pool in pools]

    def view(self, worker_id: str) -> WorkerView | None:
        link = self.links.get(worker_id)
        return link.view() if link is not None else None

    def up(self, *pools: str) -> list[WorkerView]:
        """The views of the workers of these pools that take new requests."""
        return [w.view() for w in self.links.values() if w.up and w.pool in pools]

    def count_up(self, *pools: str) -> int:
        """How many workers of these pools take new requests (no view taken)."""
        return sum(1 for w in self.links.values() if w.up and w.pool in pools)

    def link(self, worker_id: str) -> WorkerLink:
        """The data plane's way to a worker (the dispatcher opens legs on it)."""
        return self.links[worker_id]

    async def wait_for_change(self, timeout: float) -> None:
        """Until any worker changes (its state, a load report, a leg that ends), or `timeout`."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), timeout)

    def _change(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    def _on_load(self, link: WorkerLink) -> None:
        try:
            if self.on_load is not None:
                self.on_load(link.view())
        finally:  # a recorder that fails must not leave a waiter to its timeout
            self._change()

    def _on_state(self, link: WorkerLink) -> None:
        try:
            if self.on_state is not None:
                self.on_state(link.view())
        finally:
            self._change()

    # -- commands -------------------------------------------------------------------------------------
    def add_worker(
        self, worker_id: str, pool: str, address: str | None = None, server_key: str = ""
    ) -> WorkerView:
        """A new worker, `starting` until it says Ready (connected now if `address` is known, with
        `server_key` its CURVE public key)."""
        if worker_id in self.links:
            raise ValueError(f"worker id {worker_id!r} is already known")
        link = WorkerLink(
            worker_id,
            pool,
            self.connector,
            routing_id=f"{self.router_id}/{worker_id}".encode()[:255],
            on_load=self._on_load,
            on_change=self._change,
            on_state=self._on_state,
        )
        self.links[worker_id] = link
        link._notify_state()
        if address is not None:
            link.connect(address, server_key)
        if self._keeper is None:
            self._keeper = asyncio.create_task(self._keep(), name="worker-keeper")
        return link.view()

    def connect(self, worker_id: str, address: str, server_key: str) -> None:
        self.links[worker_id].connect(address, server_key)

    def set_detail(self, worker_id: str, detail: str) -> None:
        """Say why a worker is as it is (GET /pools shows it)."""
        self.links[worker_id].detail = detail

    def drain(self, worker_id: str) -> None:
        """No new requests for this worker from now on; what it holds carries on."""
        self.links[worker_id].drain()

    def move_streams(self, worker_id: str, reason: str) -> int:
        """Ask the worker to hand over every stream it holds, to be continued on other workers of
        its pool (the dispatcher does it as each answers with Migrated). Returns how many."""
        link = self.links.get(worker_id)
        return self._ask_to_move(link, link.streams(), reason) if link is not None else 0

    def move_newest(self, worker_id: str, count: int, reason: str) -> int:
        """Ask the worker to hand over its `count` newest streams: they have the most tokens still
        to come and the least KV to move; one whose KV is still arriving (it just came here)
        stays. Returns how many were asked."""
        link = self.links.get(worker_id)
        if link is None:
            return 0
        settled = [leg for leg in link.streams() if not leg.receiving]
        newest = sorted(settled, key=lambda leg: leg.request_started, reverse=True)[:count]
        return self._ask_to_move(link, newest, reason)

    @staticmethod
    def _ask_to_move(link: WorkerLink, legs: list[Leg], reason: str) -> int:
        if not legs or not link.send(wire.Migrate([leg.leg_id for leg in legs])):
            return 0  # nothing to move, or not connected: nothing was asked
        for leg in legs:
            leg.move_reason = reason
        return len(legs)

    async def remove_worker(self, worker_id: str, reason: str = "stopped", *, forget: bool = True) -> None:
        """Close the link for good (`stopped`) and forget the worker. With `forget` (its process is
        gone), the others drop what they keep to read its KV; else call `forget_kv` once it is."""
        link = self.links.pop(worker_id, None)
        if link is None:
            return
        await link.close(reason)
        if forget:
            self.forget_kv(link.ready)

    def forget_kv(self, ready: wire.Ready | None) -> None:
        """Every worker drops what it keeps to read the KV of the worker that sent `ready` (an shm
        mapping would keep a gone worker's whole cache in memory): at its address, and at its
        shared-memory segment when it had one besides (same-node shm)."""
        if ready is None:
            return
        for kv_address in {ready.kv_address, ready.kv_shm_address} - {""}:
            for other in self.links.values():
                if other.connected:
                    other.send(wire.Forget(kv_address))

    async def _keep(self) -> None:
        """Every 0.5 s: greet the workers that are down (a hello lost in a reconnect would leave
        one out of service for good) and take out those that stopped reporting."""
        while True:
            await asyncio.sleep(0.5)
            for link in list(self.links.values()):
                if link.connected:
                    link.check_stalled(self.stall_timeout)
                elif link.address is not None and link.state is not WorkerState.STOPPED:
                    link.send_hello()

    async def close(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        for worker_id in list(self.links):
            await self.remove_worker(worker_id, "the router is shutting down")
        self.connector.close()
