"""A worker's side of the control RPC: the ZeroMQ ROUTER socket, on a thread of its own.

It binds the socket itself (any free port) and reports the address it got; it decodes each frame
into a `pdserve.wire` message for the engine thread, and sends what the engine thread produced.
It never waits for a step, so a router always gets through, even during a long prefill chunk.

The socket is a CURVE server (pdserve.security): its keypair is made here, its public half goes in
`Ready`, and a ZAP handler lets in only the router keys the worker was given. Anyone else fails the
handshake and never gets a frame through: such refusals are counted (`refused`) and logged, as
are frames from accepted peers that are not our protocol (`dropped_frames`). ZeroMQ itself cuts a
peer off that announces a message above MAX_RPC_MESSAGE_BYTES, before allocating it.

More than one authorised peer may speak to a worker (two routers). Each request's outputs go to
the peer that sent its `AddRequest`, and only that peer may abort, release or move it; load
reports go to every peer. A peer that is gone (ZeroMQ says it is unreachable) is forgotten. A
peer's hello is answered with `Ready` right after the engine thread's next load report, which
reaches the peer first.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import parse_monitor_message

from pdserve import wire
from pdserve.security import CurveKeypair, WorkerSecrets, curve_server

logger = logging.getLogger(__name__)

# Frames from the engine thread: [request id, flag, payload]. An empty request id: for every
# peer (a load report). FINAL: the request is over here, its owner can be forgotten; an empty
# payload with FINAL only forgets it (a lease that ran out).
FINAL = b"F"
MORE = b"-"
_MAX_PEERS = 64  # remembered peers for load reports; the oldest is dropped beyond this
_REFUSALS = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_LOGGED_REFUSALS = 10  # the first refusals are logged one by one, then one in every 100


class _AllowedKeys:
    """ZAP's CURVE check: the client's public key (Z85) must be one of the router keys given."""

    def __init__(self, keys: list[str]) -> None:
        self._keys = frozenset(k.encode() for k in keys)

    def callback(self, _domain: str, key: bytes) -> bool:
        return key in self._keys


class LoadWanted:
    """To the engine thread: send a load report now (a peer waits for Ready behind it)."""


LOAD_WANTED = LoadWanted()


class RpcEndpoint:
    def __init__(
        self,
        worker_id: str,
        bind: str,
        ready: Callable[[str], wire.Ready],
        inbox: queue.Queue[wire.Message | LoadWanted],
        outbox_address: str,
        stop: threading.Event,
        secrets: WorkerSecrets,
    ) -> None:
        """`ready(address)`: the Ready message, given the address bound; `outbox_address`: the
        inproc socket the engine thread pushes its frames to; `secrets`: whom to accept."""
        self.worker_id = worker_id
        self.keypair = CurveKeypair.generate()
        self._clients = list(secrets.rpc_clients)
        self.refused = 0
        self._bind = bind
        self._ready = ready
        self._inbox = inbox
        # request id -> when its AddRequest came off the socket (monotonic), for the engine thread,
        # which may be mid-step then: a stream whose first token came from a prefill worker has
        # been waiting for its next one since about this moment, not since the step ended.
        self.received_at: dict[str, float] = {}
        self._outbox_address = outbox_address
        self._stop = stop
        self.address: str | None = None
        self.bound = threading.Event()
        self.bind_error: BaseException | None = None
        self._owners: dict[str, bytes] = {}  # request id -> identity of the peer that added it
        self._peers: dict[bytes, None] = {}  # insertion-ordered set: who hears load reports
        # Peers that asked for Ready: greeted right after the load report the engine thread sends
        # when asked (at once, or at the end of the step under way), which reaches them first.
        # So a worker is up at the router only with its load known (GET /pools showed a fresh
        # worker's running and waiting as null until its first report), and only while its engine
        # thread runs (as a stalled worker comes back only by reporting).
        self._greet_after_load: dict[bytes, None] = {}
        self._ready_frame = b""  # the encoded Ready, once bound
        self.dropped_frames = 0

    def run(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        # The ZAP handler answers the handshakes of every socket of this context, on its own thread.
        auth = ThreadAuthenticator(context, log=logging.getLogger("pdserve.worker.zap"))
        auth.start()
        auth.configure_curve_callback("*", credentials_provider=_AllowedKeys(self._clients))
        try:
            self._run(context)
        finally:
            auth.stop()

    def _run(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        curve_server(sock, self.keypair)
        # Unreachable peers raise instead of swallowing frames silently; no high-water mark, so a
        # slow router delays its tokens but never loses them.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.SNDHWM, 0)
        # A peer that reconnects with the identity it had (a router after a dropped connection)
        # takes that identity over: it is still the owner of what it added.
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        try:
            sock.bind(self._bind)
            self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError as exc:
            self.bind_error = exc
            sock.close()
            self.bound.set()
            return
        self._ready_frame = wire.encode(self._ready(self.address))
        monitor = sock.get_monitor_socket(_REFUSALS)
        self.bound.set()
        outbox = context.socket(zmq.PULL)
        outbox.setsockopt(zmq.LINGER, 0)
        outbox.connect(self._outbox_address)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(outbox, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(timeout=100))  # the timeout only bounds the stop check
                if monitor in events:
                    self._refusals(monitor)
                if sock in events:
                    self._receive(sock)
                if outbox in events:
                    while True:
                        try:
                            frames = outbox.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._deliver(sock, frames)
        finally:
            sock.disable_monitor()
            monitor.close()
            outbox.close()
            sock.close()

    def _refusals(self, monitor: zmq.Socket[bytes]) -> None:
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            self.refused += 1
            if self.refused <= _LOGGED_REFUSALS or self.refused % 100 == 0:
                logger.warning(
                    "worker %s: refused a connection at the RPC handshake (no key or a wrong one; "
                    "ZeroMQ event %s, errno %s); %d so far",
                    self.worker_id,
                    event["event"],
                    event["value"],
                    self.refused,
                )

    # -- from peers -----------------------------------------------------------------------------------
    def _receive(self, sock: zmq.Socket[bytes]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 2:  # not our protocol: one identity frame and one payload
                self._drop(f"a {len(frames)}-part message")
                continue
            identity, payload = frames
            if identity not in self._peers:
                self._remember(identity)
                self._ask_greeting(identity)  # a new (or reconnected) peer: greet it
            else:
                self._peers[identity] = self._peers.pop(identity)  # most recently heard last
            if not payload:  # a hello: the peer wants Ready (again)
                self._ask_greeting(identity)
                continue
            try:
                message = wire.decode(payload)
            except wire.WireError as exc:
                self._drop(str(exc))
                continue
            if self._accept(sock, identity, message):
                self._inbox.put(message)

    def _accept(self, sock: zmq.Socket[bytes], identity: bytes, message: wire.Message) -> bool:
        """Whether the engine thread should see `message` from this peer."""
        if isinstance(message, wire.AddRequest):
            owner = self._owners.get(message.request_id)
            if owner is not None and owner != identity:
                error = wire.Tokens(message.request_id, [], "error", error="request id already in use here")
                self._send(sock, identity, wire.encode(error))
                return False
            self._owners[message.request_id] = identity
            self.received_at[message.request_id] = time.monotonic()
            return True
        if isinstance(message, wire.Migrate):
            mine = [r for r in message.request_ids if self._owners.get(r) == identity]
            if len(mine) < len(message.request_ids):
                logger.debug(
                    "worker %s: ignored moves of requests it does not hold for this peer", self.worker_id
                )
            if mine:
                self._inbox.put(wire.Migrate(mine))
            return False
        request_id = getattr(message, "request_id", None)
        if request_id is None:
            return True  # Shutdown
        owner = self._owners.get(request_id)
        if owner != identity:
            # Another peer's request (or one already over): a stray or a forged command.
            logger.debug("worker %s: ignored %s for %s from a peer that does not own it",
                           self.worker_id, type(message).__name__, request_id)  # fmt: skip
            return False
        if isinstance(message, wire.Abort | wire.Release):
            del self._owners[request_id]  # nothing more goes out for it
        return True

    def _ask_greeting(self, identity: bytes) -> None:
        if not self._greet_after_load:
            self._inbox.put(LOAD_WANTED)  # the engine thread reports now, not at its next interval
        self._greet_after_load[identity] = None

    # -- to peers -------------------------------------------------------------------------------------
    def _deliver(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        request_id, flag, payload = frames
        if not request_id:  # a load report: to every peer
            for identity in list(self._peers):
                self._send(sock, identity, payload)
            waiting, self._greet_after_load = self._greet_after_load, {}
            for identity in waiting:
                if identity in self._peers:
                    self._send(sock, identity, self._ready_frame)
            return
        rid = request_id.decode()
        owner = self._owners.pop(rid, None) if flag == FINAL else self._owners.get(rid)
        if owner is not None and payload:
            self._send(sock, owner, payload)

    def _send(self, sock: zmq.Socket[bytes], identity: bytes, payload: bytes) -> None:
        try:
            sock.send_multipart([identity, payload], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            self._peers.pop(identity, None)  # gone: whatever it owned has no one to go to

    def _remember(self, identity: bytes) -> None:
        self._peers[identity] = None
        while len(self._peers) > _MAX_PEERS:
            del self._peers[next(iter(self._peers))]

    def _drop(self, what: str) -> None:
        self.dropped_frames += 1
        logger.error("worker %s: dropped %s", self.worker_id, what)
