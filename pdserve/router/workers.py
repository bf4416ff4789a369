"""The router's links to its workers: one ZeroMQ DEALER socket each, on the router's event loop.

Each worker is in one state (`WorkerState`): `starting` (its backend is starting it; no Ready
yet), `up` (it takes new requests), `draining` (it finishes what it holds and takes nothing new),
`down` (its connection dropped or it went silent; it may come back) and `stopped` (it ended; the
link is closed and leaves the set). The set changes while serving: `add_worker`, `connect`,
`drain_worker`, `remove_worker`.

A worker is up from its `Ready` until the connection drops or it goes silent. A process killed with SIGKILL closes its sockets, so the drop is seen at
once (a socket monitor event); a frozen process stops answering ZeroMQ's heartbeats and is dropped
after `heartbeat_timeout`; a process whose engine thread hangs (its ZeroMQ I/O thread still
answers heartbeats) stops sending load reports and is taken out after `stall_timeout`. Everything
waiting on a dropped worker is told (`WorkerDown`) straight away, so no stream hangs on a dead
process; the legs it held are aborted there if it answers again.

Messages from a worker are routed by request id to the `Leg` (one request on one worker) that
waits for them. No torch here.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve import wire
from pdserve.security import CurveKeypair, curve_client

logger = logging.getLogger(__name__)

STEP_MEMORY_S = 60.0  # how far back a worker's longest step is remembered


class WorkerState(enum.StrEnum):
    STARTING = "starting"
    UP = "up"
    DRAINING = "draining"
    DOWN = "down"
    STOPPED = "stopped"


class DownCause(enum.StrEnum):
    """Why a worker is down: its connection dropped, or it stopped reporting (a stall; it may
    only have been slow, and comes back at its next report)."""

    DROPPED = "dropped"
    STALLED = "stalled"


@dataclass(frozen=True)
class WorkerDown:
    worker_id: str
    reason: str


LegEvent = wire.Tokens | wire.KVPulled | wire.Migrated | WorkerDown


@dataclass(eq=False)
class Leg:
    """One request (under one leg id) on one worker: the events that worker sends for it."""

    leg_id: str
    link: WorkerLink
    events: asyncio.Queue[LegEvent] = field(default_factory=asyncio.Queue)
    prompt_tokens: int = 0  # counted in the link's queued prompt tokens until the first token
    done: bool = False  # the worker holds nothing for it any more (finished, released, aborted)
    move_reason: str | None = None  # asked to move (drain, rebalance): the Migrate is sent
    receiving: bool = False  # its KV is on its way to this worker (until KVPulled)
    request_started: float = field(default_factory=time.monotonic)  # the request's, not the leg's

    def close(self, abort: bool) -> None:
        """Stop listening; with `abort`, tell the worker to drop the request and free its blocks."""
        if abort and not self.done and self.link.connected:
            self.link.send(wire.Abort(self.leg_id))
        self.done = True
        self.link.forget(self)


class WorkerLink:
    def __init__(
        self,
        worker_id: str,
        pool: str,
        context: zmq.asyncio.Context,
        *,
        heartbeat_interval: float = 0.5,
        heartbeat_timeout: float = 3.0,
        on_load: Callable[[WorkerLink], None] | None = None,
        on_state: Callable[[WorkerLink], None] | None = None,
        router_id: str = "",
        keypair: CurveKeypair,
    ) -> None:
        self.worker_id = worker_id
        self.pool = pool
        self.routing_id = f"{router_id or uuid.uuid4().hex}/{worker_id}".encode()[:255]
        self.address: str | None = None  # known once the backend has started the worker
        self.ready: wire.Ready | None = None
        self.load: wire.Load | None = None
        self.state = WorkerState.STARTING
        self.opened_at = self.state_since = time.monotonic()
        self.up_at: float | None = None  # when it first said Ready: its cold start counts from here
        # Its measured prefill throughput: prompt tokens per second of the steps that had prompt
        # tokens (an average weighted toward the recent, from its load reports' steps).
        self.prefill_tokens_per_s: float | None = None
        self.detail = "starting"  # why it is in its state, for people (GET /pools, /health, logs)
        self.down_cause: DownCause | None = None  # why it went down last (while DOWN: why it is)
        self.draining = False  # asked to drain: it stays out of service even if it reconnects
        self.legs: dict[str, Leg] = {}
        self.queued_prompt_tokens = 0  # prompt tokens sent here that have not produced a token yet
        self._on_load = on_load
        self._on_state = on_state
        self._context = context
        self._keypair = keypair  # the router's CURVE keypair: how the worker knows it is us
        self._heartbeat = (heartbeat_interval, heartbeat_timeout)
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self.last_message_at = time.monotonic()
        self.load_at = 0.0  # when the last load report came
        # (when, seconds) of the longest step in each recent load report: a worker reports only
        # between steps, so the longest recent step says how long a silence is still just work.
        self._recent_steps: deque[tuple[float, float]] = deque()
        # Legs dropped when the link went down: aborted on the worker once it answers again, in
        # case the process is the same one and still holds them.
        self.abandoned: set[str] = set()
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def role(self) -> str | None:
        return self.ready.role if self.ready else None

    @property
    def up(self) -> bool:
        """Takes new requests."""
        return self.state is WorkerState.UP

    @property
    def connected(self) -> bool:
        """Answers for the requests it holds (up or draining)."""
        return self.state in (WorkerState.UP, WorkerState.DRAINING)

    def connect(self, address: str, server_key: str) -> None:
        """Connect to the worker at `address` whose CURVE public key is `server_key` (from its
        Ready, through the cluster backend); it is up once it answers with Ready."""
        if self._sock is not None:
            raise RuntimeError(f"worker {self.worker_id} is already connected to {self.address}")
        if not server_key:
            raise ValueError(f"worker {self.worker_id} reported no RPC key: it cannot be connected to")
        self.address = address
        sock = self._context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        curve_client(sock, self._keypair, server_key)
        # The same identity across reconnects: the worker routes outputs, and accepts Abort and
        # Release, by the identity of the peer that added a request, so after a dropped
        # connection the router must still be that peer (the worker hands it over).
        sock.setsockopt(zmq.ROUTING_ID, self.routing_id)
        # Queue nothing for a worker that is not connected: a send fails at once instead of
        # waiting for a process that may never come back.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        interval, timeout = self._heartbeat
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(interval * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(timeout * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL, 200)
        # The hello must follow the ZeroMQ handshake: at EVENT_CONNECTED there is no pipe yet and,
        # with IMMEDIATE, a send is refused and the hello lost.
        self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._sock = sock
        sock.connect(address)
        self.detail = "connecting"
        self._tasks = [
            asyncio.create_task(self._read_loop(), name=f"read-{self.worker_id}"),
            asyncio.create_task(self._monitor_loop(), name=f"monitor-{self.worker_id}"),
        ]

    async def close(self, reason: str = "stopped") -> None:
        """Stop listening for good: the link ends in `stopped`."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        self._end_legs(reason)
        was = self.state
        self.state, self.detail, self.load = WorkerState.STOPPED, reason, None
        if self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sock.disable_monitor()
            assert self._monitor is not None
            self._monitor.close(linger=0)
            self._sock.close(linger=0)
            self._sock = None
        if was is not WorkerState.STOPPED:
            self._notify_state()

    def drain(self) -> None:
        """No new requests from now on; what it holds carries on."""
        self.draining = True
        if self.state in (WorkerState.UP, WorkerState.STARTING):
            self._set_state(WorkerState.DRAINING, "draining")

    # -- sending --------------------------------------------------------------------------------------
    def send(self, message: wire.Message) -> bool:
        """Send without waiting. False if the worker is not connected (nothing is queued for it)."""
        return self._send_now(wire.encode(message))

    def _send_now(self, data: bytes) -> bool:
        if self._sock is None:
            return False
        # zmq.asyncio reports a NOBLOCK send's outcome through an already-finished future.
        sent = self._sock.send(data, zmq.NOBLOCK)
        assert isinstance(sent, asyncio.Future)
        error = sent.exception() if sent.done() else None
        if isinstance(error, zmq.Again):
            return False
        if error is not None:
            raise error
        return True

    def streams(self) -> list[Leg]:
        """The legs streaming here that have not been asked to move."""
        return [leg for leg in self.legs.values() if not leg.done and leg.move_reason is None]

    def idle_since(self, moment: float) -> bool:
        """A load report after `moment` says the worker holds nothing: no request, no block."""
        load = self.load
        return (
            load is not None
            and self.load_at > moment
            and load.num_running == load.num_waiting == load.num_held == load.kv_blocks_used == 0
        )

    def open_leg(
        self,
        leg_id: str,
        prompt_tokens: int = 0,
        *,
        receiving: bool = False,
        request_started: float | None = None,
    ) -> Leg:
        leg = Leg(leg_id, self, prompt_tokens=prompt_tokens, receiving=receiving)
        if request_started is not None:
            leg.request_started = request_started
        self.legs[leg_id] = leg
        self.queued_prompt_tokens += prompt_tokens
        return leg

    def forget(self, leg: Leg) -> None:
        if self.legs.pop(leg.leg_id, None) is not None:
            self._settle_prompt(leg)

    def _settle_prompt(self, leg: Leg) -> None:
        self.queued_prompt_tokens -= leg.prompt_tokens
        leg.prompt_tokens = 0

    # -- receiving ------------------------------------------------------------------------------------
    async def _read_loop(self) -> None:
        assert self._sock is not None
        while True:
            data = await self._sock.recv()
            try:
                self._handle(wire.decode(data))
            except wire.WireError as exc:
                logger.error("worker %s sent a bad frame: %s", self.worker_id, exc)
            except Exception:  # one bad message must not end this link's reading for good
                logger.exception("worker %s: failed to handle a message", self.worker_id)

    def _handle(self, message: wire.Message) -> None:
        self.last_message_at = time.monotonic()
        if isinstance(message, wire.Ready):
            self.ready = message
            self._come_back(message.role)
        elif isinstance(message, wire.Load):
            if (
                self.state is WorkerState.DOWN
                and self.ready is not None
                and self.down_cause is DownCause.STALLED
            ):
                self._come_back(self.ready.role)  # it was only slow: it reports again
            self.load = message
            self.load_at = time.monotonic()
            self._measure_prefill(message.steps)
            self._note_steps(message, self.load_at)
            if self._on_load is not None:
                self._on_load(self)
        elif isinstance(message, wire.Tokens | wire.KVPulled | wire.Migrated):
            leg = self.legs.get(message.request_id)
            if leg is None:
                return  # a leg the router already closed (aborted, timed out): nothing waits
            if isinstance(message, wire.Tokens) and (message.token_ids or message.finish_reason):
                self._settle_prompt(leg)
            elif isinstance(message, wire.KVPulled):
                leg.receiving = False
            leg.events.put_nowait(message)

    def _note_steps(self, load: wire.Load, now: float) -> None:
        longest = max([s.seconds for s in load.steps] + [load.last_step_ms / 1000])
        self._recent_steps.append((now, longest))
        while self._recent_steps and now - self._recent_steps[0][0] > STEP_MEMORY_S:
            self._recent_steps.popleft()

    def longest_recent_step_s(self) -> float:
        """The longest step this worker reported in the last STEP_MEMORY_S seconds (0 if none)."""
        return max((seconds for _, seconds in self._recent_steps), default=0.0)

    def _measure_prefill(self, steps: list[wire.StepSample]) -> None:
        tokens = sum(s.prefill_tokens for s in steps if s.prefill_tokens)
        seconds = sum(s.seconds for s in steps if s.prefill_tokens)
        if tokens and seconds > 0:
            rate = tokens / seconds
            old = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = rate if old is None else 0.8 * old + 0.2 * rate

    def _come_back(self, role: str) -> None:
        if self.state not in (WorkerState.STARTING, WorkerState.DOWN):
            return
        self._set_state(WorkerState.DRAINING if self.draining else WorkerState.UP, "")
        if self.up_at is None:
            self.up_at = time.monotonic()
        logger.info("worker %s is %s (%s, %s)", self.worker_id, self.state.value, role, self.address)
        for leg_id in self.abandoned:
            self.send(wire.Abort(leg_id))
        self.abandoned.clear()

    async def _monitor_loop(self) -> None:
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.send_hello()
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._mark_down(
                    DownCause.DROPPED, "its connection dropped (process gone or not answering heartbeats)"
                )

    def send_hello(self) -> None:
        # An empty frame: the worker answers with Ready (also after a reconnect to a new process).
        try:
            self._send_now(b"")
        except zmq.ZMQError as exc:
            logger.warning("worker %s: hello not sent: %s", self.worker_id, exc)

    def check_stalled(self, stall_timeout: float) -> None:
        """A worker's engine thread reports its load every 0.1 s; silence for `stall_timeout`
        means a hung process (ZeroMQ's own heartbeats are answered by its I/O thread even then)."""
        silent = time.monotonic() - self.last_message_at
        if self.connected and silent > stall_timeout:
            self._mark_down(DownCause.STALLED, f"stalled: no report for {silent:.0f} s")

    def _mark_down(self, cause: DownCause, reason: str) -> None:
        if not self.connected:
            return
        self.down_cause = cause
        self.load = None
        logger.error("worker %s is down: %s", self.worker_id, reason)
        self._end_legs(reason)
        self._set_state(WorkerState.DOWN, reason)

    def _end_legs(self, reason: str) -> None:
        """Everything waiting on this worker hears it now; the legs are dropped: a restarted
        process at the same address knows nothing of them."""
        legs, self.legs = list(self.legs.values()), {}
        self.queued_prompt_tokens = 0
        for leg in legs:
            if not leg.done:
                self.abandoned.add(leg.leg_id)
            leg.done = True
            leg.events.put_nowait(WorkerDown(self.worker_id, reason))

    def _set_state(self, state: WorkerState, detail: str) -> None:
        self.state, self.detail = state, detail
        self.state_since = time.monotonic()
        self._notify_state()

    def _notify_state(self) -> None:
        if self._on_state is not None:
            self._on_state(self)


class WorkerSet:
    """Every worker the router knows, by id. Workers are added, drained and removed while serving."""

    def __init__(
        self,
        heartbeat_interval: float = 0.5,
        heartbeat_timeout: float = 3.0,
        stall_timeout: float = 60.0,
        *,
        keypair: CurveKeypair,
    ) -> None:
        """`keypair`: the router's CURVE keypair, the one its workers were told to accept."""
        self.context = zmq.asyncio.Context()
        self.keypair = keypair
        self.router_id = uuid.uuid4().hex  # this router, as its workers know it
        self.links: dict[str, WorkerLink] = {}
        self._heartbeat = (heartbeat_interval, heartbeat_timeout)
        self.stall_timeout = stall_timeout
        self._keeper: asyncio.Task[None] | None = None
        self.on_load: Callable[[WorkerLink], None] | None = None
        self.on_state: Callable[[WorkerLink], None] | None = None

    def add_worker(
        self, worker_id: str, pool: str, address: str | None = None, server_key: str = ""
    ) -> WorkerLink:
        """A new worker, `starting` until it says Ready (connected now if `address` is known, with
        `server_key` its CURVE public key)."""
        if worker_id in self.links:
            raise ValueError(f"worker id {worker_id!r} is already known")
        link = WorkerLink(
            worker_id,
            pool,
            self.context,
            heartbeat_interval=self._heartbeat[0],
            heartbeat_timeout=self._heartbeat[1],
            on_load=self.on_load,
            on_state=self.on_state,
            router_id=self.router_id,
            keypair=self.keypair,
        )
        self.links[worker_id] = link
        link._notify_state()
        if address is not None:
            link.connect(address, server_key)
        if self._keeper is None:
            self._keeper = asyncio.create_task(self._keep(), name="worker-keeper")
        return link

    def drain_worker(self, worker_id: str) -> WorkerLink:
        link = self.links[worker_id]
        link.drain()
        return link

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

    def up(self, *pools: str) -> list[WorkerLink]:
        """The workers of these pools that take new requests."""
        return [w for w in self.links.values() if w.up and w.pool in pools]

    def in_pool(self, pool: str) -> list[WorkerLink]:
        return [w for w in self.links.values() if w.pool == pool]

    async def close(self) -> None:
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
        for worker_id in list(self.links):
            await self.remove_worker(worker_id, "the router is shutting down")
        self.context.term()
