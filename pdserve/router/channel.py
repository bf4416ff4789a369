"""The router's channel to one worker: frames out, frames and connection events in. No torch.

A `WorkerLink` (pdserve.router.workers) speaks to its worker through a `Channel` made by the
worker set's `Connector`: ZeroMQ in production (`ZmqConnector`), an in-memory scripted worker in
tests (tests/fakes.py). The link never sees a socket.

The ZeroMQ channel is one DEALER socket, CURVE-authenticated, with ZeroMQ heartbeats: a process
killed with SIGKILL closes its sockets, so the drop is seen at once (a socket monitor event); a
frozen process stops answering heartbeats and is dropped after `heartbeat_timeout`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from pdserve.security import CurveKeypair, curve_client

logger = logging.getLogger(__name__)

HEARTBEAT_TIMEOUT_S = 3.0  # a connection silent this long (ZeroMQ heartbeats unanswered) drops


class ChannelEvents(Protocol):
    """What a channel tells its link (on the event loop)."""

    def on_frame(self, data: bytes) -> None: ...

    def on_handshake(self) -> None:
        """The connection is (again) established: the link greets the worker."""

    def on_disconnect(self) -> None:
        """The connection dropped (the process is gone or stopped answering heartbeats)."""


class Channel(Protocol):
    def send(self, data: bytes) -> bool:
        """Send without waiting. False if the worker is not connected (nothing is queued)."""
        ...

    async def close(self) -> None: ...


class Connector(Protocol):
    def connect(self, address: str, server_key: str, routing_id: bytes, events: ChannelEvents) -> Channel:
        """A channel to the worker at `address` whose public key is `server_key`; the worker knows
        this router by `routing_id` across reconnects."""
        ...

    def close(self) -> None: ...


class ZmqConnector:
    def __init__(
        self,
        keypair: CurveKeypair,
        *,
        heartbeat_interval: float = 0.5,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT_S,
    ) -> None:
        """`keypair`: the router's CURVE keypair, the one its workers were told to accept."""
        self.context = zmq.asyncio.Context()
        self.keypair = keypair
        self.heartbeat = (heartbeat_interval, heartbeat_timeout)

    def connect(self, address: str, server_key: str, routing_id: bytes, events: ChannelEvents) -> Channel:
        return ZmqChannel(self, address, server_key, routing_id, events)

    def close(self) -> None:
        self.context.term()


class ZmqChannel:
    def __init__(
        self, connector: ZmqConnector, address: str, server_key: str, routing_id: bytes, events: ChannelEvents
    ) -> None:
        sock = connector.context.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        curve_client(sock, connector.keypair, server_key)
        # The same identity across reconnects: the worker routes outputs, and accepts Abort and
        # Release, by the identity of the peer that added a request, so after a dropped
        # connection the router must still be that peer (the worker hands it over).
        sock.setsockopt(zmq.ROUTING_ID, routing_id)
        # Queue nothing for a worker that is not connected: a send fails at once instead of
        # waiting for a process that may never come back.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        interval, timeout = connector.heartbeat
        sock.setsockopt(zmq.HEARTBEAT_IVL, int(interval * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(timeout * 1000))
        sock.setsockopt(zmq.HEARTBEAT_TTL, int(timeout * 1000))
        sock.setsockopt(zmq.RECONNECT_IVL, 200)
        # The hello must follow the ZeroMQ handshake: at EVENT_CONNECTED there is no pipe yet and,
        # with IMMEDIATE, a send is refused and the hello lost.
        self._monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        self._sock = sock
        self._events = events
        self._address = address
        sock.connect(address)
        self._tasks = [
            asyncio.create_task(self._read_loop(), name=f"read-{address}"),
            asyncio.create_task(self._monitor_loop(), name=f"monitor-{address}"),
        ]

    def send(self, data: bytes) -> bool:
        # zmq.asyncio reports a NOBLOCK send's outcome through an already-finished future.
        sent = self._sock.send(data, zmq.NOBLOCK)
        assert isinstance(sent, asyncio.Future)
        error = sent.exception() if sent.done() else None
        if isinstance(error, zmq.Again):
            return False
        if error is not None:  # the socket refused it (closing, a bad state): not sent, said
            logger.warning("%s: send failed: %s", self._address, error)
            return False
        return True

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(zmq.ZMQError):
            self._sock.disable_monitor()
        self._monitor.close(linger=0)
        self._sock.close(linger=0)

    async def _read_loop(self) -> None:
        while True:
            data = await self._sock.recv()
            try:
                self._events.on_frame(data)
            except Exception:  # one bad message must not end this channel's reading for good
                logger.exception("%s: failed to handle a message", self._address)

    async def _monitor_loop(self) -> None:
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._events.on_handshake()
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                self._events.on_disconnect()
