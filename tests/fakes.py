"""In-memory stand-ins for what lies below the control plane: a scripted worker behind the router's
channel interface, and a cluster backend that "starts" scripted workers. The router's own parts
(worker set, dispatcher, placement, admission, pool manager, planner) run for real on top of
them, in one event loop, with no process, socket or model: fast and deterministic.

A `ScriptedWorker` speaks the wire protocol as a worker does: it answers the router's hello with
its Ready, and runs a toy engine that a test steps by hand (`step`) or lets run (`FakeCluster`'s
`autostep`): a prefill worker answers a prompt with its first token and a KV lease it holds until
released; a decode worker pulls that KV (KVPulled), then emits one token a step until max_tokens;
asked to move a stream, it stops it and holds its KV (Migrated); every step sends a load report.
Token `i` of a request (counting its prompt) is `1000 + i`, so a stream's tokens show at once
whether one was lost, repeated or continued from the wrong place.

Only the channel is replaced: frames are encoded and decoded with `pdserve.wire`, exactly as they
cross a socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from pdserve import wire
from pdserve.cluster.base import ExitCallback, WorkerExit, WorkerHandle, WorkerStartError
from pdserve.config import POOL_ROLES, EngineConfig, WorkerConfig
from pdserve.errors import PdserveError
from pdserve.pools.manager import PoolManager, PoolSettings, PoolSpec
from pdserve.router.channel import Channel, ChannelEvents
from pdserve.router.config import RouterConfig
from pdserve.router.dispatch import Dispatcher
from pdserve.router.metrics import RouterMetrics
from pdserve.router.request_state import RequestState
from pdserve.router.workers import WorkerSet

BLOCK_SIZE = 16
STEP_SECONDS = 0.001  # how long a stepped engine step takes (virtual time under clock.run_virtual)
NUM_BLOCKS = 256


def token_at(position: int) -> int:
    """What every scripted engine samples at a position of the sequence: deterministic."""
    return 1000 + position


@dataclass
class _Request:
    request_id: str
    prompt: int  # prompt tokens
    outputs: list[int]
    max_tokens: int
    pulling: bool = False  # its KV is being pulled: KVPulled at the next step
    held: bool = False  # prefilled (or moved away): its blocks wait for a Release

    @property
    def blocks(self) -> int:
        return -(-(self.prompt + len(self.outputs)) // BLOCK_SIZE)


class ScriptedWorker:
    """One worker process, as the router's channel sees it (implements `Channel`)."""

    def __init__(self, worker_id: str, role: str, events: ChannelEvents) -> None:
        self.worker_id, self.role, self.events = worker_id, role, events
        self.received: list[wire.Message] = []  # every message from the router, in order
        self.requests: dict[str, _Request] = {}
        self.reachable = True  # the connection is up (a dropped one refuses sends)
        self.answers_hello = True
        self.reports = True  # sends a load report each step (False: a hung engine thread)
        self.refuse: str | None = None  # refuses every new request as invalid, saying this
        self.steps = 0
        self.hellos = 0  # the router's greetings (each answered with Ready if answers_hello)
        self.readies = 0  # Ready messages delivered to the router
        self.closed = False

    @property
    def ready(self) -> wire.Ready:
        return wire.Ready(
            self.worker_id, self.role, "scripted", 4096, 50000, "tcp", f"kv-{self.worker_id}",
            f"fake://{self.worker_id}", 512, 2048, 64,
        )  # fmt: skip

    # -- the channel ------------------------------------------------------------------------------
    def send(self, data: bytes) -> bool:
        if not self.reachable or self.closed:
            return False
        if data == b"":
            self.hellos += 1
            if self.answers_hello:
                asyncio.get_running_loop().call_soon(self.say, self.ready)
            return True
        message = wire.decode(data)
        self.received.append(message)
        self._take(message)
        return True

    async def close(self) -> None:
        self.closed = True

    # -- what a test does ---------------------------------------------------------------------------
    def say(self, message: wire.Message) -> None:
        """Send the router a message, as if it had crossed the socket."""
        if self.reachable and not self.closed:
            self.readies += isinstance(message, wire.Ready)
            self.events.on_frame(wire.encode(message))

    def drop(self) -> None:
        """The connection drops (the process died, or stopped answering heartbeats)."""
        if self.reachable:
            self.reachable = False
            self.events.on_disconnect()

    def reconnect(self) -> None:
        self.reachable = True
        self.events.on_handshake()

    def received_of(self, kind: type[wire.Message]) -> list[wire.Message]:
        return [m for m in self.received if isinstance(m, kind)]

    def step(self) -> None:
        """One engine step: every running request moves one token on; then a load report."""
        self.steps += 1
        for request in list(self.requests.values()):
            if request.held:
                continue
            if request.pulling:
                request.pulling = False
                self.say(
                    wire.KVPulled(request.request_id, True, request.blocks * 1024, 0.001, transport="tcp")
                )
                continue
            token = token_at(request.prompt + len(request.outputs))
            request.outputs.append(token)
            if self.role == "prefill":  # the first token, and the prompt's KV held for a pull
                request.held = True
                self.say(wire.Tokens(request.request_id, [token], "prefilled", kv=self._handle(request)))
            elif len(request.outputs) >= request.max_tokens:
                del self.requests[request.request_id]
                self.say(wire.Tokens(request.request_id, [token], "length"))
            else:
                self.say(wire.Tokens(request.request_id, [token]))
        if self.reports:
            self.report()

    def report(self) -> None:
        running = [r for r in self.requests.values() if not r.held]
        used = sum(r.blocks for r in self.requests.values())
        queued = sum(r.prompt for r in running if not r.outputs and self.role != "decode")
        sample = wire.StepSample(0.01, queued, 0, len(running), 0)
        self.say(
            wire.Load(
                self.worker_id, len(running), 0, queued, used, NUM_BLOCKS - used,
                sum(r.held for r in self.requests.values()), 10.0, [sample], NUM_BLOCKS, BLOCK_SIZE,
            )
        )  # fmt: skip

    # -- the toy engine -----------------------------------------------------------------------------
    def _handle(self, request: _Request) -> wire.KVHandle:
        return wire.KVHandle(
            self.worker_id, "tcp", f"kv-{self.worker_id}", list(range(request.blocks)),
            request.prompt + len(request.outputs) - 1, 30.0, request.request_id,
        )  # fmt: skip

    def _take(self, message: wire.Message) -> None:
        if isinstance(message, wire.AddRequest) and self.refuse is not None:
            refusal = wire.Tokens(message.request_id, [], "error", error=self.refuse, invalid=True)
            asyncio.get_running_loop().call_soon(self.say, refusal)
        elif isinstance(message, wire.AddRequest):
            prompt = len(message.prompt_token_ids)
            outputs = list(message.output_token_ids)
            if message.kv is not None:  # its prompt (and outputs) were computed elsewhere
                prompt = message.kv.num_tokens + 1 - len(outputs)
            self.requests[message.request_id] = _Request(
                message.request_id, prompt, outputs, message.params.max_tokens, pulling=message.kv is not None
            )
        elif isinstance(message, wire.Abort | wire.Release):
            self.requests.pop(message.request_id, None)
        elif isinstance(message, wire.Migrate):
            for request_id in message.request_ids:
                request = self.requests.get(request_id)
                if request is None or request.held:
                    continue
                kv = self._handle(request) if request.outputs else None
                if kv is None:
                    del self.requests[request_id]
                else:
                    request.held = True
                loop = asyncio.get_running_loop()
                loop.call_soon(self.say, wire.Migrated(request_id, list(request.outputs), kv))


class ScriptedConnector:
    """The router's connector to scripted workers: `fake://<pool>-<n>` reaches that worker, with
    its pool's engine role."""

    def __init__(self) -> None:
        self.workers: dict[str, ScriptedWorker] = {}  # by worker id, the latest connection

    def connect(self, address: str, server_key: str, routing_id: bytes, events: ChannelEvents) -> Channel:
        assert address.startswith("fake://") and server_key, (address, server_key)
        worker_id = address.removeprefix("fake://")
        pool = worker_id.rsplit("-", 1)[0]
        worker = ScriptedWorker(worker_id, POOL_ROLES[pool].value, events)
        self.workers[worker_id] = worker
        asyncio.get_running_loop().call_soon(events.on_handshake)
        return worker

    def close(self) -> None:
        pass


@dataclass
class FakeCluster:
    """A cluster backend whose workers are scripted (implements `ClusterBackend`). A start takes
    until `release_starts` (when `hold_starts`), or fails as `failures` says; `autostep` runs every
    worker's engine a step each `autostep` seconds."""

    connector: ScriptedConnector
    name: str = "fake"
    failures: dict[str, int] = field(default_factory=dict)  # pool -> starts to fail first
    hold_starts: bool = False
    autostep: float | None = None
    started: list[str] = field(default_factory=list)
    stopped: list[tuple[str, bool]] = field(default_factory=list)  # (worker id, graceful)
    held_at_stop: dict[str, int] = field(default_factory=dict)  # worker id -> requests it still had
    _alive: dict[str, WorkerHandle] = field(default_factory=dict)
    _on_exit: ExitCallback | None = None
    _gate: asyncio.Event = field(default_factory=asyncio.Event)
    _stepper: asyncio.Task[None] | None = None
    _ids: itertools.count[int] = field(default_factory=itertools.count)

    def set_exit_callback(self, callback: ExitCallback) -> None:
        self._on_exit = callback

    async def start_worker(self, config: WorkerConfig, timeout: float) -> WorkerHandle:
        if self.autostep is not None and self._stepper is None:
            self._stepper = asyncio.create_task(self._step_all(self.autostep))
        self.started.append(config.worker_id)
        if self.hold_starts:
            async with asyncio.timeout(timeout):
                await self._gate.wait()
        if self.failures.get(config.pool, 0) > 0:
            self.failures[config.pool] -= 1
            raise WorkerStartError(f"worker {config.worker_id} exited with code 1 while starting (scripted)")
        handle = WorkerHandle(
            config.worker_id, config.pool, f"fake://{config.worker_id}", f"kv-{config.worker_id}", "fake-node",
            rpc_public_key="fake-key", details={"fake": next(self._ids)},
        )  # fmt: skip
        self._alive[config.worker_id] = handle
        return handle

    def release_starts(self) -> None:
        self.hold_starts = False
        self._gate.set()

    async def stop_worker(self, worker_id: str, *, graceful: bool = True, timeout: float = 15.0) -> None:
        if worker_id in self._alive:
            self.stopped.append((worker_id, graceful))
            worker = self.connector.workers.get(worker_id)
            self.held_at_stop[worker_id] = len(worker.requests) if worker is not None else 0
            self._end(worker_id, WorkerExit(worker_id, True, "stopped"))

    def crash(self, worker_id: str, reason: str = "killed by signal 9") -> None:
        """The process dies on its own: its connection drops, the backend reports the exit."""
        self._end(worker_id, WorkerExit(worker_id, False, reason))

    def _end(self, worker_id: str, exit: WorkerExit) -> None:
        self._alive.pop(worker_id, None)
        worker = self.connector.workers.get(worker_id)
        if worker is not None:
            worker.drop()
            worker.closed = True
        if self._on_exit is not None:
            self._on_exit(exit)

    def workers(self) -> list[WorkerHandle]:
        return list(self._alive.values())

    async def close(self) -> None:
        if self._stepper is not None:
            self._stepper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._stepper
        for worker_id in list(self._alive):
            await self.stop_worker(worker_id)

    async def _step_all(self, every: float) -> None:
        while True:
            await asyncio.sleep(every)
            for worker_id in list(self._alive):
                worker = self.connector.workers.get(worker_id)
                if worker is not None and worker.reachable and not worker.closed:
                    worker.step()


async def until(condition: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    """Until `condition` holds, looking again at every turn of the event loop's timers; a generous
    bound only so that a bug fails the test instead of hanging it."""
    try:
        async with asyncio.timeout(timeout):
            while not condition():
                await asyncio.sleep(0.001)
    except TimeoutError:
        raise AssertionError(f"not reached in {timeout:g} s: {what}") from None


@dataclass
class ControlPlane:
    """The router's control plane and data plane over scripted workers: what `pdserve serve`
    wires, minus HTTP, processes and the model."""

    connector: ScriptedConnector
    cluster: FakeCluster
    workers: WorkerSet
    metrics: RouterMetrics
    dispatcher: Dispatcher
    pools: PoolManager

    def worker(self, worker_id: str) -> ScriptedWorker:
        return self.connector.workers[worker_id]

    def states(self, pool: str) -> dict[str, str]:
        return {w.worker_id: w.state.value for w in self.workers.views(pool)}

    def up(self, pool: str) -> list[str]:
        return [w.worker_id for w in self.workers.up(pool)]

    async def stream(self, request_id: str, prompt: int, max_tokens: int) -> list[int] | str:
        """A whole stream through the dispatcher: every token it produced, in order (or `error:
        ...` if it failed)."""
        params = wire.WireSamplingParams(max_tokens=max_tokens, temperature=0.0)
        state = RequestState(request_id)
        tokens: list[int] = []
        try:
            async for event in self.dispatcher.generate(state, list(range(prompt)), params):
                tokens += event.token_ids
        except PdserveError as exc:  # RequestFailed, or Unavailable once the stream has begun
            return f"error: {exc}"
        return tokens

    def step_all(self) -> None:
        """One step of every worker that is still connected."""
        for worker in list(self.connector.workers.values()):
            if worker.reachable and not worker.closed:
                worker.step()

    async def step_until(self, condition: Callable[[], bool], what: str, limit: int = 10000) -> None:
        """Step every worker, letting the router answer in between, until `condition` holds."""
        for _ in range(limit):
            if condition():
                return
            self.step_all()
            for _ in range(5):  # the router's answers to this step (a pull, a release, a move)
                await asyncio.sleep(0)
            await asyncio.sleep(STEP_SECONDS)  # a step takes time: timeouts and leases run on
        raise AssertionError(f"not reached in {limit} steps: {what}")

    @staticmethod
    def counter(metric: Any, *labels: str) -> float:
        value: float = metric.labels(*labels)._value.get()
        return value


def expected_stream(prompt: int, max_tokens: int) -> list[int]:
    """What a stream of `max_tokens` after `prompt` tokens is, wherever it ran."""
    return [token_at(prompt + i) for i in range(max_tokens)]


@contextlib.asynccontextmanager
async def control_plane(
    replicas: dict[str, int],
    *,
    bounds: dict[str, tuple[int, int]] | None = None,
    settings: PoolSettings | None = None,
    config: RouterConfig | None = None,
    autostep: float | None = 0.002,
    stall_timeout: float = 60.0,
    failures: dict[str, int] | None = None,
) -> AsyncIterator[ControlPlane]:
    """Pools of scripted workers (`replicas` per pool; `bounds` (min, max), by default 0 and 4),
    started and up; everything stopped after."""
    connector = ScriptedConnector()
    cluster = FakeCluster(connector, autostep=autostep, failures=dict(failures or {}))
    workers = WorkerSet(connector, stall_timeout=stall_timeout)
    metrics = RouterMetrics()
    dispatcher = Dispatcher(workers, config or RouterConfig(local_prefill_threshold=8), metrics)

    def spec(pool: str, n: int) -> PoolSpec:
        role = POOL_ROLES[pool]
        low, high = (bounds or {}).get(pool, (0, 4))
        return PoolSpec(
            pool,
            n,
            low,
            high,
            lambda worker_id: WorkerConfig(worker_id, pool, EngineConfig("scripted", role=role)),
        )

    manager = PoolManager(
        cluster, workers, metrics, [spec(p, n) for p, n in replicas.items()],
        settings or PoolSettings(start_timeout=10.0, drain_timeout=10.0, settle_seconds=0.0),
    )  # fmt: skip
    plane = ControlPlane(connector, cluster, workers, metrics, dispatcher, manager)
    try:
        await manager.start()
        yield plane
    finally:
        await manager.close()
        await workers.close()
