"""The router's worker links against a scripted worker (a real ZeroMQ ROUTER socket speaking the
wire protocol): liveness from load reports, and aborts for what was abandoned."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from pdserve import wire
from pdserve.router.workers import WorkerDown, WorkerSet

READY = wire.Ready("w0", "decode", "m", 1024, 320, "shm", "")


def load() -> wire.Load:
    return wire.Load("w0", 0, 0, 0, 0, 100, 0, 0.0)


async def recv(sock: zmq.asyncio.Socket, timeout: float = 5.0) -> tuple[bytes, bytes]:
    identity, payload = await asyncio.wait_for(sock.recv_multipart(), timeout)
    return identity, payload


async def recv_message(sock: zmq.asyncio.Socket, timeout: float = 5.0) -> wire.Message:
    """The next message, past any hellos (empty frames; the router may greet more than once)."""
    while True:
        _, payload = await recv(sock, timeout)
        if payload:
            return wire.decode(payload)


def test_a_worker_that_stops_reporting_is_taken_out_and_its_legs_aborted_when_it_returns() -> None:
    async def scenario() -> None:
        context = zmq.asyncio.Context()
        worker = context.socket(zmq.ROUTER)
        port = worker.bind_to_random_port("tcp://127.0.0.1")
        workers = WorkerSet(stall_timeout=0.6)
        try:
            link = workers.add("w0", f"tcp://127.0.0.1:{port}")
            identity, hello = await recv(worker)
            assert hello == b""
            await worker.send_multipart([identity, wire.encode(READY)])
            await workers.wait_ready(5)
            leg = link.open_leg("r.0", prompt_tokens=5)
            assert link.send(wire.AddRequest("r.0", [1, 2, 3], wire.WireSamplingParams(max_tokens=4)))
            assert isinstance(await recv_message(worker), wire.AddRequest)

            # Silence (the connection stays up, as with a hung engine thread): out of service.
            event = await asyncio.wait_for(leg.events.get(), 5)
            assert isinstance(event, WorkerDown) and "stalled" in event.reason
            assert not link.up and link.abandoned == {"r.0"}

            # It reports again: back in service, and told to drop what the router gave up on.
            await worker.send_multipart([identity, wire.encode(load())])
            abort = await recv_message(worker)
            assert abort == wire.Abort("r.0") and link.up and not link.abandoned
        finally:
            await workers.close()
            worker.close(linger=0)
            context.term()

    asyncio.run(scenario())


def test_a_worker_that_restarts_at_the_same_address_is_greeted_and_used_again() -> None:
    async def scenario() -> None:
        context = zmq.asyncio.Context()
        workers = WorkerSet()
        first = context.socket(zmq.ROUTER)
        port = first.bind_to_random_port("tcp://127.0.0.1")
        try:
            link = workers.add("w0", f"tcp://127.0.0.1:{port}")
            identity, _ = await recv(first)
            await first.send_multipart([identity, wire.encode(READY)])
            await workers.wait_ready(5)
            first.close(linger=0)  # the process goes away ...
            for _ in range(50):
                if not link.up:
                    break
                await asyncio.sleep(0.1)
            assert not link.up
            second = context.socket(zmq.ROUTER)  # ... and a new one binds the same address
            second.bind(f"tcp://127.0.0.1:{port}")
            try:
                identity, hello = await recv(second, timeout=10)
                assert hello == b""  # greeted again after the reconnect
                await second.send_multipart([identity, wire.encode(READY)])
                for _ in range(50):
                    if link.up:
                        break
                    await asyncio.sleep(0.1)
                assert link.up
            finally:
                second.close(linger=0)
        finally:
            await workers.close()
            context.term()

    asyncio.run(scenario())
