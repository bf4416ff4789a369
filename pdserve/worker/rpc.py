"""A worker's side of the control RPC: the ZeroMQ ROUTER socket, on a thread of its own.

It binds the socket itself (any free port) and reports the address it got; it decodes each frame
into a `pdserve.wire` message for the engine thread, and sends what the engine thread produced.
It never waits for a step, so a router always gets through, even during a long prefill chunk.

More than one peer may speak to a worker (two routers, a health probe). Each request's outputs go
to the peer that sent its `AddRequest`, and only that peer may abort, release or move it; load
reports go to every peer. A peer that is gone (ZeroMQ says it is unreachable) is forgotten.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

import zmq

from pdserve import wire

logger = logging.getLogger(__name__)

# Frames from the engine thread: [request id, flag, payload]. An empty request id: for every
# peer (a load report). FINAL: the request is over here, its owner can be forgotten; an empty
# payload with FINAL only forgets it (a lease that ran out).
FINAL = b"F"
MORE = b"-"
_MAX_PEERS = 64  # remembered peers for load reports; the oldest is dropped beyond this


class RpcEndpoint:
    def __init__(
        self,
        worker_id: str,
        bind: str,
        ready: Callable[[str], wire.Ready],
        inbox: queue.Queue[wire.Message],
        outbox_address: str,
        stop: threading.Event,
    ) -> None:
        """`ready(address)`: the Ready message, given the address bound; `outbox_address`: the
        inproc socket the engine thread pushes its frames to."""
        self.worker_id = worker_id
        self._bind = bind
        self._ready = ready
        self._inbox = inbox
        self._outbox_address = outbox_address
        self._stop = stop
        self.address: str | None = None
        self.bound = threading.Event()
        self.bind_error: BaseException | None = None
        self._owners: dict[str, bytes] = {}  # request id -> identity of the peer that added it
        self._peers: dict[bytes, None] = {}  # insertion-ordered set: who hears load reports
        self.dropped_frames = 0

    def run(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        sock = context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
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
        ready = wire.encode(self._ready(self.address))
        self.bound.set()
        outbox = context.socket(zmq.PULL)
        outbox.setsockopt(zmq.LINGER, 0)
        outbox.connect(self._outbox_address)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(outbox, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(timeout=100))  # the timeout only bounds the stop check
                if sock in events:
                    self._receive(sock, ready)
                if outbox in events:
                    while True:
                        try:
                            frames = outbox.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        self._deliver(sock, frames)
        finally:
            outbox.close()
            sock.close()

    # -- from peers -----------------------------------------------------------------------------------
    def _receive(self, sock: zmq.Socket[bytes], ready: bytes) -> None:
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
                self._send(sock, identity, ready)  # a new (or reconnected) peer: greet it first
            else:
                self._peers[identity] = self._peers.pop(identity)  # most recently heard last
            if not payload:  # a hello: the peer wants Ready (again)
                self._send(sock, identity, ready)
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

    # -- to peers -------------------------------------------------------------------------------------
    def _deliver(self, sock: zmq.Socket[bytes], frames: list[bytes]) -> None:
        request_id, flag, payload = frames
        if not request_id:
            for identity in list(self._peers):
                self._send(sock, identity, payload)
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
