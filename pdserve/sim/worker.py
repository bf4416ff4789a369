"""A simulated worker: the real engine core and the real worker core over a modelled runner, in the
event loop's time, behind the router's channel interface. No torch, no process, no socket.

What runs for real: the scheduler (chunked prefill, the step budget, preemption, hand-over), the KV
cache's bookkeeping, the worker's handling of every command (leases, pulls, moves, refusals) and
its load reports. What is modelled: how long a step takes (`step_seconds`, from a profile), how
long a KV pull takes (`pull_seconds`: until the loop hears of it, and its copy's own part), and
the tokens (token `i` of a request, its prompt counted, is `1000 + i`). Under
`pdserve.clock.VirtualTimeLoop` an hour of serving runs in the time the Python takes.

The loop mirrors `WorkerServer._engine_loop`: commands applied between steps, pulls started and
awaited up to `kv_join_wait`, hand-overs, a step (its outputs leave when it ends), expired leases,
a load report every `load_interval` (sooner when the prefix cache has news, `WorkerCore.load_due`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Callable

from pdserve import clock, wire
from pdserve.config import WorkerConfig
from pdserve.engine.core import RunnerOutput, engine_core
from pdserve.engine.kv import KVCacheManager
from pdserve.engine.sched_types import SchedulerOutput
from pdserve.modelfiles.config import ModelConfig
from pdserve.router.channel import Channel, ChannelEvents
from pdserve.worker.core import KVDone, PullOrder, WorkerCore

logger = logging.getLogger("pdserve.sim.worker")

StepSeconds = Callable[[SchedulerOutput], float]  # a step's duration, from what it computes
# The worker loop's time around a step (sending its outputs, handling messages) before the next.
LoopSeconds = Callable[[SchedulerOutput], float]
# A pull, from the blocks it moves: (until the loop hears it is done, the copy's own part of that).
PullSeconds = Callable[[int], tuple[float, float]]


def token_at(position: int, vocab_size: int = 1 << 30) -> int:
    """What every modelled engine samples at a position of the sequence (in its vocabulary)."""
    return (1000 + position) % vocab_size


class ModelledRunner:
    """Runs no model: samples `token_at` and says how long the step would have taken."""

    def __init__(self, step_seconds: StepSeconds, vocab_size: int = 1 << 30) -> None:
        self.step_seconds = step_seconds
        self.vocab_size = vocab_size

    def execute(
        self, out: SchedulerOutput, kv: KVCacheManager, between_layers: Callable[[int], None] | None = None
    ) -> RunnerOutput:
        sampled = {
            c.request.request_id: token_at(c.start + c.num_tokens, self.vocab_size)
            for c in out.chunks
            if c.sample
        }
        return RunnerOutput(sampled, seconds=self.step_seconds(out))

    def release(self, request_id: str) -> None:
        pass

    def generator_state(self, request_id: str) -> bytes | None:
        return None


class SimWorker:
    """One simulated worker process, as the router's channel sees it (implements `Channel`)."""

    def __init__(
        self,
        config: WorkerConfig,
        model: ModelConfig,
        num_blocks: int,
        events: ChannelEvents,
        *,
        step_seconds: StepSeconds,
        pull_seconds: PullSeconds,
        loop_seconds: LoopSeconds = lambda _out: 0.0,
        device_type: str = "cuda",
    ) -> None:
        self.config = config
        self.events = events
        self.engine = engine_core(
            config.engine,
            model,
            ModelledRunner(step_seconds, model.vocab_size),
            (),
            num_blocks,
            device_type,
            clock.monotonic,
            # The workers' prefix caches key their blocks, and tell the router, as real ones do.
            cache_salt=f"{config.engine.model}|modelled",
        )
        self.core = WorkerCore(
            self.engine,
            config,
            send=self._send,
            forget=lambda _request_id: None,
            kv_address=f"sim://{config.worker_id}/kv",
            takes_kv=config.engine.role.value != "prefill",
        )
        self.pull_seconds = pull_seconds
        self.loop_seconds = loop_seconds
        self.closed = False
        self._inbox: list[tuple[wire.Message | KVDone, float]] = []  # with when it came
        # As the real worker: a prefill worker on a CPU runs short prompts between two layers of a
        # long step (the step's time is spread evenly over its layers).
        self.interrupts = config.prefill_interrupts and self.engine.interrupts_steps
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._loop(), name=f"sim-{config.worker_id}")

    # -- the channel (the router's side) --------------------------------------------------------------
    def send(self, data: bytes) -> bool:
        if self.closed:
            return False
        if data == b"":  # the router's hello: answered with Ready at once
            ready = self.core.ready(
                f"sim://{self.config.worker_id}", "sim", prefill_interrupts=self.interrupts
            )
            asyncio.get_running_loop().call_soon(self._send, ready, False)
            return True
        self._inbox.append((wire.decode(data), clock.monotonic()))  # its wait counts from here
        self._wake.set()
        return True

    async def close(self) -> None:
        self.closed = True
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task

    def _send(self, message: wire.Message, final: bool = False) -> None:
        if not self.closed:
            self.events.on_frame(wire.encode(message))

    # -- the engine loop ------------------------------------------------------------------------------
    async def _loop(self) -> None:
        engine, core = self.engine, self.core
        last_load = -float("inf")
        pull_wait, pull_blocks = 0.0, 0  # since the last step: the loop's wait on pulls, their blocks
        idled = False  # as the real worker's: it waited with no work since the last step
        while not self.closed:
            idled = idled or not engine.has_unfinished
            self._apply_inbox()
            if core.stop_asked:
                return
            if core.takes_kv:
                engine.admit_remote_kv()
            orders = core.pulls_to_start()
            for order in orders:
                self._start_pull(order)
            if orders:  # as the real worker: wait for them up to kv_join_wait, then step anyway
                waiting = clock.monotonic()
                await self._wait(self.config.kv_join_wait, until=lambda: not core.pulls_in_flight)
                pull_wait += clock.monotonic() - waiting
                pull_blocks += sum(len(order.dst_blocks) for order in orders)
                self._apply_inbox()
            core.hand_over()
            stepped = False
            if engine.has_unfinished:
                out = engine.begin_step()
                stepped = out is not None  # nothing to schedule (KV still arriving): no step
                if out is not None:
                    result = engine.runner.execute(out, engine.kv)
                    seconds = result.seconds or 0.0
                    if self.interrupts and engine.interruptible(out):
                        await self._layers(out, seconds)
                    elif seconds > 0:
                        await asyncio.sleep(seconds)  # the step takes its time; then its tokens leave
                    for output in engine.finish_step(out, result, seconds):
                        core.emit(output)
                    loop = self.loop_seconds(out)
                    # Traced as the real worker's: the loop's time with the pull waits in it
                    # (none counted after an idle wait).
                    waited, blocks = (0.0, 0) if idled else (pull_wait, pull_blocks)
                    self._log_step(core.record_step(loop + waited, waited, blocks))
                    pull_wait, pull_blocks, idled = 0.0, 0, False
                    core.hand_over()
                    if loop > 0:  # the loop's own work before the next step
                        await asyncio.sleep(loop)
            core.expire_leases(clock.monotonic())
            now = clock.monotonic()
            if core.load_due(now - last_load):
                self._send(core.load())
                last_load = now
            if not stepped and not self._inbox:  # idle, or waiting on a pull: until something comes
                # or a report is due (sooner when the prefix cache has news for the router)
                news = engine.kv.has_events
                await self._wait(self.config.prefix_report_interval if news else self.config.load_interval)

    def _log_step(self, step: wire.StepSample | None) -> None:
        # The real worker's DEBUG step line, word for word: a simulated run's steps and a served
        # run's are read by the same tools (their times against the profile's, under load).
        if step is not None and logger.isEnabledFor(logging.DEBUG):
            logger.debug(
                "worker %s: step %.1f ms (prompt tokens %d, attention %d, streams %d, context %d; "
                "emit %.1f ms), 0.0 ms since the last step",
                self.config.worker_id,
                step.seconds * 1000,
                step.prefill_tokens,
                step.prefill_attention,
                step.decode_streams,
                step.decode_context,
                step.loop_seconds * 1000,
            )

    def _apply_inbox(self, prompts_only: bool = False) -> bool:
        """Applies what came (with `prompts_only`, new requests only: the rest waits for the step's
        end, as on the real worker); returns whether a request was added."""
        items, self._inbox = self._inbox, []
        added = False
        for item, received_at in items:
            if isinstance(item, wire.AddRequest):
                self.core.add(item, received_at)
                added = True
            elif prompts_only:
                self._inbox.append((item, received_at))
            else:
                self.core.apply(item)
        return added

    async def _layers(self, out: SchedulerOutput, seconds: float) -> None:
        """A step's layers, one after another; between two of them, new prompts short enough run
        in a step of their own (`EngineCore.step_between_layers`), which the step waits for.

        As the real worker, prompts are looked for at each boundary between two layers; the loop
        sleeps from one boundary where a prompt is waiting to the next (or to the last), not layer
        by layer: a prompt that comes during a layer is taken at the end of that layer."""
        engine = self.engine
        loop = asyncio.get_running_loop()
        layers = engine.limits.num_layers
        per_layer = seconds / layers
        done, at = 0, loop.time()  # layers run, and when the last of them ended
        while done < layers - 1:
            if not self._prompt_waiting():
                await self._wait_for_prompt(at + (layers - 1 - done) * per_layer)
            # The first boundary from now (a prompt that came during a layer waits for its end).
            now = loop.time()
            ahead = min(layers - 1 - done, max(1, math.ceil((now - at) / per_layer - 1e-9)))
            if at + ahead * per_layer > now:
                await asyncio.sleep(at + ahead * per_layer - now)
            done, at = done + ahead, loop.time()
            if not self._apply_inbox(prompts_only=True):
                continue
            engine.at_layer(out, done)
            nested = engine.step_between_layers()
            step = engine.last_step
            if nested and step is not None:
                await asyncio.sleep(step.step_seconds)
                for output in nested:
                    self.core.emit(output)
                self.core.record_step()
                at = loop.time()  # the step's remaining layers run after the nested one
        await asyncio.sleep(per_layer)

    def _prompt_waiting(self) -> bool:
        return any(isinstance(item, wire.AddRequest) for item, _ in self._inbox)

    async def _wait_for_prompt(self, deadline: float) -> None:
        """Until a new request is in the inbox, or the loop's clock reaches `deadline`. Other
        messages wake it and stay in the inbox for the step's end."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout_at(deadline):
                while not self._prompt_waiting():
                    self._wake.clear()
                    await self._wake.wait()

    async def _wait(self, seconds: float, until: Callable[[], bool] | None = None) -> None:
        """Until a message comes (and `until` holds, if given), or `seconds` pass."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + seconds
        while until is None or not until():
            left = deadline - loop.time()
            if left <= 0:
                return
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)
            if until is None:
                return
            self._apply_inbox()

    def _start_pull(self, order: PullOrder) -> None:
        seconds, copy = self.pull_seconds(len(order.dst_blocks))
        done = KVDone(order.request_id, True, None, 0, copy, False, order.transport)

        def arrived() -> None:
            self._inbox.append((done, clock.monotonic()))
            self._wake.set()

        asyncio.get_running_loop().call_later(seconds, arrived)


WorkerFactory = Callable[[ChannelEvents], SimWorker]  # a worker, given its channel's events


class SimConnector:
    """The router's connector to simulated workers: `sim://<worker id>` reaches the worker made by
    `make(worker_id, events)` (a cluster backend's start registers it first)."""

    def __init__(self) -> None:
        self.factories: dict[str, WorkerFactory] = {}
        self.workers: dict[str, SimWorker] = {}

    def connect(self, address: str, server_key: str, routing_id: bytes, events: ChannelEvents) -> Channel:
        worker_id = address.removeprefix("sim://")
        worker = self.factories[worker_id](events)
        self.workers[worker_id] = worker
        asyncio.get_running_loop().call_soon(events.on_handshake)
        return worker

    def close(self) -> None:
        for worker in self.workers.values():
            worker.closed = True
