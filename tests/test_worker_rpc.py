"""A worker's RPC: only peers holding a router key it was given get through (CURVE; everyone else
is refused at the handshake and counted); with more than one such peer (two routers) each
request's outputs go to the peer that added it, load reports to everyone, and only the owner may
abort it; frames that are not our protocol are dropped and counted, never fatal. A real worker
process and real ZeroMQ sockets."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import zmq

from pdserve import wire
from pdserve.cluster.local import start_worker_process, worker_command
from pdserve.config import EngineConfig, Role, WorkerConfig
from pdserve.security import CurveKeypair, DeploymentSecrets, WorkerSecrets, curve_client

SECRETS = DeploymentSecrets.generate()
SECOND_ROUTER = CurveKeypair.generate()
# The worker obeys two routers: this test's two peers.
WORKER_SECRETS = WorkerSecrets([SECRETS.router.public, SECOND_ROUTER.public], SECRETS.kv_secret.hex())


def start(model: Path) -> tuple[subprocess.Popen[bytes], wire.Ready]:
    engine = EngineConfig(model=str(model), dtype="float32", role=Role.MIXED, num_kv_blocks=64)
    return start_worker_process(
        WorkerConfig("m0", "colocated", engine), WORKER_SECRETS, stderr=subprocess.PIPE
    )


class Peer:
    def __init__(
        self,
        ready: wire.Ready,
        identity: bytes | None = None,
        keypair: CurveKeypair | None = SECRETS.router,
    ) -> None:
        """A DEALER to the worker: as a router with `keypair` (None: no CURVE at all)."""
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keypair is not None:
            curve_client(self.sock, keypair, ready.rpc_public_key)
        if identity is not None:
            self.sock.setsockopt(zmq.ROUTING_ID, identity)
        self.sock.connect(ready.rpc_address)
        self.sock.send(b"")  # hello

    def send(self, message: wire.Message) -> None:
        self.sock.send(wire.encode(message))

    def until(self, done: Callable[[list[wire.Message]], bool], bound: float = 60.0) -> list[wire.Message]:
        """What arrives until `done(what arrived)` holds. `bound` only ends a wait for something that
        never comes (then the caller's assertion says what was missing)."""
        got: list[wire.Message] = []
        deadline = time.monotonic() + bound
        while not done(got) and (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(int(left * 1000)):
                got.append(wire.decode(self.sock.recv()))
        return got

    def drain(self, seconds: float) -> list[wire.Message]:
        """Everything that arrives within `seconds` (for what must *not* arrive)."""
        got: list[wire.Message] = []
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.sock.poll(int(left * 1000)):
                got.append(wire.decode(self.sock.recv()))
        return got


def greeted(got: list[wire.Message]) -> bool:
    return any(isinstance(m, wire.Ready) for m in got)


def has_load(got: list[wire.Message]) -> bool:
    return any(isinstance(m, wire.Load) for m in got)


def has_tokens(request_id: str) -> Callable[[list[wire.Message]], bool]:
    return lambda got: any(isinstance(m, wire.Tokens) and m.request_id == request_id for m in got)


def finished(request_id: str) -> Callable[[list[wire.Message]], bool]:
    return lambda got: any(
        isinstance(m, wire.Tokens) and m.request_id == request_id and m.finish_reason is not None for m in got
    )


def idle(got: list[wire.Message]) -> bool:
    """A load report with nothing running and no KV block held."""
    return any(isinstance(m, wire.Load) and m.num_running == 0 and m.kv_blocks_used == 0 for m in got)


def idle_after(request_id: str) -> Callable[[list[wire.Message]], bool]:
    """The request has finished, and a load report after that says nothing runs or holds KV."""

    def done(got: list[wire.Message]) -> bool:
        ends = [i for i, m in enumerate(got) if finished(request_id)([m])]
        return bool(ends) and idle(got[ends[0] + 1 :])

    return done


def test_outputs_go_to_the_peer_that_added_the_request(tiny_llama: Path) -> None:
    process, ready = start(tiny_llama)
    owner, probe = Peer(ready), Peer(ready, keypair=SECOND_ROUTER)
    try:
        params = wire.WireSamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        owner_got, probe_got = owner.until(greeted), probe.until(greeted)  # both peers greeted
        owner.send(wire.AddRequest("a", [5, 6, 7, 8], params))
        owner_got += owner.until(has_tokens("a"))  # the worker has it: the probe's id is now taken
        probe.send(wire.Abort("a"))  # not its request: ignored
        probe.send(wire.AddRequest("a", [1, 2], params))  # the id is taken: refused, to the probe
        probe_got += probe.until(lambda got: has_tokens("a")(got) and has_load(got))
        owner_got += owner.until(lambda got: finished("a")(got) and has_load(got))

        tokens = [m for m in owner_got if isinstance(m, wire.Tokens)]
        assert sum(len(t.token_ids) for t in tokens) == 40 and tokens[-1].finish_reason == "length"
        assert any(isinstance(m, wire.Load) for m in owner_got)

        # Greeted after a load report, before anything else: a router never has the worker up
        # with its load unknown.
        first_ready = next(i for i, m in enumerate(probe_got) if isinstance(m, wire.Ready))
        assert [type(m) for m in probe_got[: first_ready + 1]] == [wire.Load, wire.Ready]
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
    process, ready = start(tiny_llama)
    first = Peer(ready, b"router-1/m0")
    try:
        params = wire.WireSamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True)
        first.until(greeted)
        first.send(wire.AddRequest("a", [5, 6, 7, 8], params))
        assert has_tokens("a")(first.until(has_tokens("a")))
        first.sock.close()  # the connection drops ...
        again = Peer(ready, b"router-1/m0")  # ... and comes back
        got = again.until(has_tokens("a"))
        assert has_tokens("a")(got) and not finished("a")(got)  # the stream goes on, to it
        again.send(wire.Abort("a"))  # accepted: the same peer
        assert idle(again.until(idle))
        again.send(wire.Shutdown())
        assert process.wait(timeout=30) == 0
        again.sock.close()
    finally:
        if process.poll() is None:
            process.kill()


def test_a_peer_without_a_router_key_is_refused_and_cannot_stop_the_worker(tiny_llama: Path) -> None:
    process, ready = start(tiny_llama)
    router = Peer(ready)
    try:
        got = router.until(greeted)
        assert [type(m) for m in got] == [wire.Load, wire.Ready]  # its load, then its greeting
        params = wire.WireSamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
        router.send(wire.AddRequest("r", [5, 6, 7, 8], params))
        # A stranger with a key of its own, one without CURVE, and one that knows the worker's
        # public key but not a router's secret: none gets a frame through, in or out.
        strangers = [Peer(ready, b"router-1/m0", CurveKeypair.generate()), Peer(ready, keypair=None)]
        for stranger in strangers:
            for message in (wire.Abort("r"), wire.Migrate(["r"]), wire.Shutdown()):
                stranger.send(message)
        # Until the request has run to its length and the worker reports every stranger refused.
        got += router.until(
            lambda got: (
                finished("r")(got)
                and any(isinstance(m, wire.Load) and m.rpc_refused >= 2 and m.num_running == 0 for m in got)
            )
        )
        assert [m for s in strangers for m in s.drain(0.5)] == []  # no Ready, no tokens, no loads
        tokens = [m for m in got if isinstance(m, wire.Tokens) and m.request_id == "r"]
        # The strangers' Abort did nothing: the request ran to its length.
        assert sum(len(t.token_ids) for t in tokens) == 200 and tokens[-1].finish_reason == "length"
        loads = [m for m in got if isinstance(m, wire.Load)]
        assert max(m.rpc_refused for m in loads) >= 2  # every stranger's attempt is counted
        assert process.poll() is None
        router.send(wire.Shutdown())
        assert process.wait(timeout=30) == 0
        _, err = process.communicate()
        assert b"refused a connection at the RPC handshake" in err
        for stranger in strangers:
            stranger.sock.close()
    finally:
        if process.poll() is None:
            process.kill()
        router.sock.close()


def test_frames_that_are_not_our_protocol_are_dropped_and_counted(tiny_llama: Path) -> None:
    """A router key holder that sends random bytes, mutated messages and wrong shapes: the worker
    drops each, counts it, and goes on serving."""
    process, ready = start(tiny_llama)
    router = Peer(ready)
    rng = random.Random(7)
    try:
        params = wire.WireSamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        valid = wire.encode(wire.AddRequest("ok", [5, 6, 7], params))
        bad: list[bytes] = [rng.randbytes(rng.randint(1, 300)) for _ in range(100)]
        for _ in range(100):  # flip, cut or extend a valid frame
            frame = bytearray(valid)
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
            bad.append(bytes(frame[: rng.randint(1, len(frame))]) if rng.random() < 0.3 else bytes(frame))
        bad.append(msgspec.msgpack.encode([wire.PROTOCOL_VERSION, {"type": "add", "request_id": 5}]))
        bad.append(msgspec.msgpack.encode([wire.PROTOCOL_VERSION + 1, {"type": "shutdown"}]))
        for frame in bad:
            router.sock.send(frame)
        router.sock.send_multipart([b"two", b"parts"])
        router.send(wire.AddRequest("after", [9, 10, 11], params))
        got = router.until(idle_after("after"))
        ended = {m.request_id for m in got if isinstance(m, wire.Tokens) and m.finish_reason == "length"}
        assert "after" in ended and process.poll() is None
        loads = [m for m in got if isinstance(m, wire.Load) and m.num_running == 0]
        # Most mutations break the frame; a few still decode (a changed token id) and are served.
        assert loads[-1].rpc_dropped >= 100 and loads[-1].num_running == 0 and loads[-1].kv_blocks_used == 0
        router.send(wire.Shutdown())
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()
        router.sock.close()


def test_a_worker_without_its_secrets_does_not_start(tiny_llama: Path) -> None:
    engine = EngineConfig(model=str(tiny_llama), dtype="float32", role=Role.MIXED, num_kv_blocks=64)
    argv, env = worker_command(WorkerConfig("m0", "colocated", engine), WORKER_SECRETS)
    del env["PDSERVE_WORKER_SECRETS"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "no PDSERVE_WORKER_SECRETS" in done.stderr
    env["PDSERVE_WORKER_SECRETS"] = '{"rpc_clients": [], "kv_secret": "00"}'
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "bad PDSERVE_WORKER_SECRETS" in done.stderr
    assert os.environ.get("PDSERVE_WORKER_SECRETS") is None and sys.executable in argv
