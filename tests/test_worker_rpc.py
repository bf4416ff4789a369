"""A worker's RPC with more than one peer (a second router, a health probe): each request's
outputs go to the peer that added it, load reports to everyone, and only the owner may abort it.
A real worker process and real ZeroMQ sockets."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import zmq

from pdserve import wire
from pdserve.cluster.local import start_worker_process
from pdserve.config import EngineConfig, Role, WorkerConfig


class Peer:
    def __init__(self, address: str, identity: bytes | None = None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if identity is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.sock.connect(address)
        self.sock.send(b"")  # hello

    def send(self, message: wire.Message) -> None:
        self.sock.send(wire.encode(message))

    def drain(self, seconds: float) -> list[wire.Message]:
        """Everything that arrives within `seconds`."""
        got: list[wire.Message] = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(int(left * 1000)):
                got.append(wire.decode(self.sock.recv()))
        return got


def test_outputs_go_to_the_peer_that_added_the_request(tiny_llama: Path) -> None:
    engine = EngineConfig(model=str(tiny_llama), dtype="float32", role=Role.MIXED, num_kv_blocks=64)
    process, ready = start_worker_process(WorkerConfig("m0", "colocated", engine), stderr=subprocess.DEVNULL)
    owner, probe = Peer(ready.rpc_address), Peer(ready.rpc_address)
    try:
        params = wire.WireSamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        time.sleep(0.3)  # both peers greeted
        owner.send(wire.AddRequest("a", [5, 6, 7, 8], params))
        probe.send(wire.Abort("a"))  # not its request: ignored
        probe.send(wire.AddRequest("a", [1, 2], params))  # the id is taken: refused, to the probe
        owner_got, probe_got = owner.drain(3.0), probe.drain(0.5)

        tokens = [m for m in owner_got if isinstance(m, wire.Tokens)]
        assert sum(len(t.token_ids) for t in tokens) == 40 and tokens[-1].finish_reason == "length"
        assert any(isinstance(m, wire.Load) for m in owner_got)

        assert isinstance(probe_got[0], wire.Ready)  # greeted first
        probe_tokens = [m for m in probe_got if isinstance(m, wire.Tokens)]
        assert [(t.request_id, t.finish_reason, t.error) for t in probe_tokens] == [
            ("a", "error", "request id already in use here")
        ]
        assert any(isinstance(m, wire.Load) for m in probe_got)  # load reports reach every peer
    finally:
        owner.send(wire.Shutdown())
        assert process.wait(timeout=30) == 0
        owner.sock.close()
        probe.sock.close()


def test_a_peer_that_reconnects_with_its_identity_still_owns_its_requests(tiny_llama: Path) -> None:
    """A router whose connection dropped (a frozen worker, a network blip) reconnects with the same
    identity: it may then abort what it left there, and the stream's outputs come to it."""
    engine = EngineConfig(model=str(tiny_llama), dtype="float32", role=Role.MIXED, num_kv_blocks=64)
    process, ready = start_worker_process(WorkerConfig("m0", "colocated", engine), stderr=subprocess.DEVNULL)
    first = Peer(ready.rpc_address, b"router-1/m0")
    try:
        params = wire.WireSamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
        time.sleep(0.2)
        first.send(wire.AddRequest("a", [5, 6, 7, 8], params))
        assert any(isinstance(m, wire.Tokens) for m in first.drain(0.5))
        first.sock.close()  # the connection drops ...
        again = Peer(ready.rpc_address, b"router-1/m0")  # ... and comes back
        assert any(isinstance(m, wire.Tokens) and m.request_id == "a" for m in again.drain(0.5))
        again.send(wire.Abort("a"))  # accepted: the same peer
        loads = [m for m in again.drain(1.5) if isinstance(m, wire.Load)]
        assert loads and loads[-1].num_running == 0 and loads[-1].kv_blocks_used == 0
        again.send(wire.Shutdown())
        assert process.wait(timeout=30) == 0
        again.sock.close()
    finally:
        if process.poll() is None:
            process.kill()
