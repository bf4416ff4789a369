"""A worker process's serving loop: the control RPC and the engine loop, on separate threads.

- The RPC thread (`pdserve.worker.rpc`) owns the ZeroMQ ROUTER socket: it hands each message to
  the engine thread through a queue and sends what the engine thread produced to the peer that
  owns the request.
- The engine thread owns the engine: it applies queued commands between steps, steps while there
  is work, and emits `Tokens` and periodic `Load` messages.
- Decode role: KV pulls run on a small thread pool (they copy into blocks the running batch does
  not touch); their outcome comes back to the engine thread through the same queue.
- Any role: blocks another worker will pull stay under a lease (a prefilled prompt; a stream that
  is moving away, `Migrate`) until that worker's router sends Release, or the lease runs out.

Every timeout is explicit: the lease on prefilled blocks, the KV pull timeout, the idle wait.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import zmq

from pdserve import wire
from pdserve.config import WorkerConfig
from pdserve.engine.core import EngineCore, EngineOutput
from pdserve.engine.runner import ModelRunner
from pdserve.engine.sched import Handover
from pdserve.errors import InvalidRequestError
from pdserve.security import WorkerSecrets
from pdserve.transfer.base import ChecksumError, KVExporter, KVImporter, TransferError
from pdserve.transfer.checksum import checksum_enabled, kv_digest
from pdserve.worker.rpc import FINAL, MORE, RpcEndpoint

logger = logging.getLogger(__name__)


@dataclass
class _KVDone:
    request_id: str
    ok: bool
    error: str | None
    nbytes: int = 0
    seconds: float = 0.0
    checksum_failed: bool = False
    transport: str = ""  # the one the pull went over


class WorkerServer:
    def __init__(
        self,
        engine: EngineCore[ModelRunner],
        config: WorkerConfig,
        kv_address: str,
        importer: KVImporter | None = None,
        *,
        secrets: WorkerSecrets,
        exporter: KVExporter | None = None,
        on_bound: Callable[[wire.Ready], None] | None = None,
        shm_address: str = "",
        same_node_importer: KVImporter | None = None,
    ) -> None:
        """`kv_address`: where this worker's KV can be read ("" if nowhere); `secrets`: the router
        keys it obeys (pdserve.security); `on_bound`: called with the Ready message once the RPC
        socket is bound (the cluster backend waits for it). Same-node shm (a tcp or nixl worker
        whose cache is in shared memory too): `shm_address` is its segment, for the workers on its
        node, and `same_node_importer` copies from theirs."""
        self.engine = engine
        self._steps: list[wire.StepSample] = []  # since the last load report
        self._last_recorded: object = None
        self._last_step_ended = 0.0  # perf_counter when the last recorded step's outputs were sent
        self.config = config
        self.kv_address = kv_address
        self._on_bound = on_bound
        self.importer = importer
        self.shm_address = shm_address
        self.same_node_importer = same_node_importer
        # Prefill role with a transport that serves reads (tcp, nixl): told which blocks are
        # leased, so it never serves a block after it was freed (see the lease hooks below).
        self.exporter = exporter
        self._inbox: queue.Queue[wire.Message | _KVDone] = queue.Queue()
        # Prefill role: short prompts may run between two layers of a long step (_between_layers);
        # the other messages that arrive meanwhile wait here for the step to end.
        self._interrupts = config.prefill_interrupts and engine.interrupts_steps
        self._deferred: list[wire.Message | _KVDone] = []
        self._stop = threading.Event()
        self._stop_requested = False  # set by a signal handler (stop_from_signal)
        # Engine thread -> RPC thread: an inproc PUSH/PULL pair, so a new token wakes the RPC
        # thread at once (no polling interval between a token and the router).
        self._outbox_address = f"inproc://pdserve-outbox-{id(self)}"
        self._outbox: zmq.Socket[bytes] | None = None  # created on the engine thread
        self.rpc = RpcEndpoint(
            config.worker_id,
            config.rpc_bind,
            self._ready,
            self._inbox,  # type: ignore[arg-type]  # the RPC thread puts messages only
            self._outbox_address,
            self._stop,
            secrets,
        )
        self._leases: dict[str, float] = {}  # prefill role: request id -> monotonic expiry
        self._pending_kv: dict[str, wire.KVHandle] = {}  # decode role: request id -> its source
        # ... and when its lease ends, on this host's monotonic clock (from the handle's arrival).
        self._lease_ends: dict[str, float] = {}
        self._to_move: set[str] = set()  # asked to move (Migrate) and not handed over yet
        # Decode role: pulls submitted and not yet reported back. An Abort for one of them waits
        # for the pull to end: freeing its blocks while the pull still writes into them could
        # corrupt the KV of whichever request gets those blocks next.
        self._pulls_in_flight: set[str] = set()
        self._abort_after_pull: set[str] = set()
        self._pulls = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-pull") if importer else None
        self.lease_expiries = 0
        self.kv_failures = 0
        # Digest what this worker holds for another, check what it pulls (transfer/checksum.py).
        self._checksum = checksum_enabled(config.kv_checksum, engine.runner.kv_cache)
        if config.kv_corrupt_rate > 0 and not self._checksum:  # "auto" on a GPU cache: off
            raise ValueError("kv_corrupt_rate needs the KV checksum, which is off for this cache")
        self._warned_no_digest = False

    # -- threads -------------------------------------------------------------------------------------
    def serve_forever(self) -> None:
        """Runs until a Shutdown message or `stop()`. The engine loop runs on this thread."""
        context: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._outbox = context.socket(zmq.PUSH)
        self._outbox.setsockopt(zmq.LINGER, 0)
        self._outbox.bind(self._outbox_address)
        rpc = threading.Thread(target=self.rpc.run, args=(context,), name="rpc", daemon=True)
        rpc.start()
        try:
            self.rpc.bound.wait()
            if self.rpc.bind_error is not None:
                raise RuntimeError(f"cannot bind {self.config.rpc_bind}: {self.rpc.bind_error}")
            assert self.rpc.address is not None
            logger.info("worker %s: RPC on %s", self.config.worker_id, self.rpc.address)
            if self._on_bound is not None:
                self._on_bound(self._ready(self.rpc.address))
            self._engine_loop()
        finally:
            self._stop.set()
            rpc.join(timeout=5.0)
            self._outbox.close()
            if self._pulls is not None:
                self._pulls.shutdown(wait=True, cancel_futures=True)
            for importer in (self.importer, self.same_node_importer):
                if importer is not None:
                    importer.close()
            if self.exporter is not None:
                self.exporter.close()

    def stop(self) -> None:
        self._stop.set()

    def stop_from_signal(self) -> None:
        """From a signal handler: only a flag, which the engine loop turns into `stop()` within a
        step. Event.set takes a lock, and a handler that runs while the main thread holds that
        lock (inside Event.set or Queue.get) would wait on itself for ever: a worker that ignored
        SIGTERM and outlived a SIGKILLed server."""
        self._stop_requested = True

    def _ready(self, rpc_address: str) -> wire.Ready:
        return wire.Ready(
            worker_id=self.config.worker_id,
            role=self.engine.config.role.value,
            model=self.engine.config.model,
            max_model_len=self.engine.max_model_len,
            vocab_size=self.engine.limits.vocab_size,
            kv_transport=self.config.transport,
            kv_address=self.kv_address,
            rpc_address=rpc_address,
            chunk_size=self.engine.chunk_size,
            max_num_batched_tokens=self.engine.max_num_batched_tokens,
            max_num_seqs=self.engine.config.max_num_seqs,
            rpc_public_key=self.rpc.keypair.public,
            node_id=self.config.node_id,
            kv_shm_address=self.shm_address,
            prefill_interrupts=self._interrupts,
        )

    def _engine_loop(self) -> None:
        engine = self.engine
        last_load = 0.0
        while not self._stop.is_set():
            if self._stop_requested:
                logger.info("worker %s: stopping (signal)", self.config.worker_id)
                self._stop.set()
                break
            busy = engine.has_unfinished
            deferred, self._deferred = self._deferred, []
            for item in deferred:  # what came during the last step, in the order it came
                self._apply(item)
            try:
                item = self._inbox.get(timeout=0 if busy else 0.02)
                self._apply(item)
                while True:  # everything else that is queued, before the next step
                    self._apply(self._inbox.get_nowait())
            except queue.Empty:
                pass
            if self._stop.is_set():
                break
            if self.importer is not None:
                engine.admit_remote_kv()
            if self._start_pulls():
                self._await_pulls(time.monotonic() + self.config.kv_join_wait)
            self._hand_over()
            if engine.has_unfinished:
                step_started = time.perf_counter()
                for out in engine.step(self._between_layers if self._interrupts else None):
                    self._emit(out)
                self._record_step(step_started)
                self._hand_over()  # right after their tokens: the next step would not wait
            self._expire_leases()
            now = time.monotonic()
            if now - last_load >= self.config.load_interval:
                self._send(self._load())
                last_load = now

    def _between_layers(self) -> None:
        """Prefill role, between two layers of a step (`EngineCore.step`): new prompts join the
        engine's queue now, and those short enough run at once, in a step of their own
        (`EngineCore.step_between_layers`), instead of waiting for the rest of this one. Every
        other message waits for the step to end (an Abort or Release of a request of that step
        must not free its blocks while its layers still write to them)."""
        if self._inbox.empty():
            return
        added = False
        try:
            while True:
                item = self._inbox.get_nowait()
                if isinstance(item, wire.AddRequest):
                    self._add(item)
                    added = True
                else:
                    self._deferred.append(item)
        except queue.Empty:
            pass
        if not added:
            return
        started = time.perf_counter()
        outputs = self.engine.step_between_layers()
        for out in outputs:
            self._emit(out)
        if outputs:
            self._record_step(started)

    # -- commands --------------------------------------------------------------------------------------
    def _apply(self, item: wire.Message | _KVDone) -> None:
        engine = self.engine
        if isinstance(item, _KVDone):
            self._pulls_in_flight.discard(item.request_id)
            if item.request_id in self._abort_after_pull:
                self._abort_after_pull.discard(item.request_id)
                engine.abort(item.request_id)  # the pull is over: now its blocks can go
                return
            self._lease_ends.pop(item.request_id, None)
            if self._pending_kv.pop(item.request_id, None) is not None:  # else aborted meanwhile
                self._send(
                    wire.KVPulled(
                        item.request_id,
                        item.ok,
                        item.nbytes,
                        item.seconds,
                        item.error,
                        item.checksum_failed,
                        item.transport,
                    )
                )
            failed = engine.kv_received(item.request_id, item.ok)
            if failed is not None:
                self.kv_failures += 1
                logger.error(
                    "worker %s: KV for %s failed: %s", self.config.worker_id, item.request_id, item.error
                )
                self._send(
                    wire.Tokens(item.request_id, [], "error", error=f"KV transfer failed: {item.error}"),
                    final=True,
                )
        elif isinstance(item, wire.AddRequest):
            self._add(item)
        elif isinstance(item, wire.Migrate):
            self._to_move.update(item.request_ids)
        elif isinstance(item, wire.Abort):
            self._pending_kv.pop(item.request_id, None)
            self._lease_ends.pop(item.request_id, None)
            self._to_move.discard(item.request_id)
            if item.request_id in self._pulls_in_flight:
                self._abort_after_pull.add(item.request_id)
                return
            self._leases.pop(item.request_id, None)
            self._lease_ended(item.request_id)
            engine.abort(item.request_id)
            engine.release(item.request_id)
        elif isinstance(item, wire.Release):
            self._leases.pop(item.request_id, None)
            self._lease_ended(item.request_id)
            engine.release(item.request_id)
        elif isinstance(item, wire.Forget):
            if item.kv_address in (self.kv_address, self.shm_address):
                return
            for importer in (self.importer, self.same_node_importer):
                if importer is not None:
                    importer.forget(item.kv_address)
        elif isinstance(item, wire.Shutdown):
            self._stop.set()

    def _add(self, msg: wire.AddRequest) -> None:
        arrived_at = self.rpc.received_at.pop(msg.request_id, None)
        try:
            params = msg.params.to_params()
            if msg.kv is not None:
                if self.importer is None:
                    raise InvalidRequestError("this worker does not take KV from other workers")
                if not msg.output_token_ids:
                    raise InvalidRequestError("a request with remote KV needs the tokens sampled so far")
                if msg.kv.num_tokens != len(msg.prompt_token_ids) + len(msg.output_token_ids) - 1:
                    raise InvalidRequestError(
                        f"the KV handle holds {msg.kv.num_tokens} tokens, the request needs "
                        f"{len(msg.prompt_token_ids) + len(msg.output_token_ids) - 1}"
                    )
            self.engine.add_request(
                msg.request_id,
                msg.prompt_token_ids,
                params,
                output_token_ids=msg.output_token_ids,
                kv_elsewhere=msg.kv is not None,
                sampler_state=msg.sampler_state,
                max_chunk_tokens=msg.max_chunk_tokens,
                max_step_seconds=msg.max_step_seconds,
                step_percentile=msg.step_percentile,
                arrived_at=arrived_at,
            )
        except (InvalidRequestError, ValueError) as exc:
            error = f"the worker refused the request: {exc}"
            self._send(wire.Tokens(msg.request_id, [], "error", error=error, invalid=True), final=True)
            return
        if msg.kv is not None:
            self._pending_kv[msg.request_id] = msg.kv
            self._lease_ends[msg.request_id] = time.monotonic() + msg.kv.lease_seconds

    def _start_pulls(self) -> bool:
        """Submits the pulls the engine asks for; True if any started."""
        started = False
        for request_id, dst_blocks in self.engine.take_kv_to_receive():
            handle = self._pending_kv.get(request_id)
            if handle is None or self._pulls is None:
                self._inbox.put(_KVDone(request_id, False, "no KV source for this request"))
                continue
            self._pulls_in_flight.add(request_id)
            transport, address = self._route(handle)
            if transport == "shm":  # the holder is on this host: its deadline is exact here
                lease_ends = handle.lease_ends_monotonic
            else:  # another host's clock: its lease's length, from the handle's arrival here
                lease_ends = self._lease_ends.get(request_id, 0.0)
            self._pulls.submit(self._pull, request_id, handle, dst_blocks, lease_ends, transport, address)
            started = True
        return started

    def _route(self, handle: wire.KVHandle) -> tuple[str, str]:
        """The transport and address of a pull, per pair of workers: the holder's shared-memory
        segment when it is on this node and has one, else its own transport (tcp, nixl)."""
        same_node = bool(handle.node_id) and handle.node_id == self.config.node_id
        if same_node and handle.shm_address and self.same_node_importer is not None:
            return "shm", handle.shm_address
        return handle.transport, handle.address

    def _await_pulls(self, deadline: float) -> None:
        """Apply messages until no pull is in flight or the deadline passes (see kv_join_wait)."""
        while self._pulls_in_flight and not self._stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                self._apply(self._inbox.get(timeout=remaining))
            except queue.Empty:
                return

    def _pull(
        self,
        request_id: str,
        handle: wire.KVHandle,
        dst_blocks: list[int],
        lease_ends: float,
        transport: str,
        address: str,
    ) -> None:
        importer = self.importer if transport == handle.transport else self.same_node_importer
        assert importer is not None
        # The shm copy reads the other cache without a lease check of its own: start it only
        # with time to finish well before the blocks may be freed and reused over there.
        if lease_ends - time.monotonic() < min(self.config.kv_pull_timeout, 5.0):
            error = f"the lease on worker {handle.worker_id} expires too soon"
            self._inbox.put(_KVDone(request_id, False, error, transport=transport))
            return
        if self._checksum and not handle.kv_digest and not self._warned_no_digest:
            self._warned_no_digest = True  # once: a holder with --kv-checksum off, or a GPU one
            logger.warning(
                "worker %s: KV from worker %s comes without a digest: it is not checked",
                self.config.worker_id,
                handle.worker_id,
            )
        started = time.perf_counter()
        try:
            nbytes = importer.pull(
                address,
                handle.block_ids,
                dst_blocks,
                self.config.kv_pull_timeout,
                request_id=handle.lease_id,  # names the holder's lease (tcp, nixl check it) ...
                lease_token=bytes.fromhex(handle.lease_token),  # ... and proves the right to it
                digest=handle.kv_digest if self._checksum else "",
            )
        except TransferError as exc:
            bad_sum = isinstance(exc, ChecksumError)
            seconds = time.perf_counter() - started
            self._inbox.put(_KVDone(request_id, False, str(exc), 0, seconds, bad_sum, transport))
            return
        self._inbox.put(
            _KVDone(request_id, True, None, nbytes, time.perf_counter() - started, False, transport)
        )

    # -- handing streams over -------------------------------------------------------------------------
    def _hand_over(self) -> None:
        """The requests asked to move that now can: each is answered with Migrated."""
        for request_id in list(self._to_move):
            outcome, request, sampler_state = self.engine.hand_over(request_id)
            if outcome is Handover.NOT_YET:
                continue
            self._to_move.discard(request_id)
            if request is None:  # finished, aborted or already held: its own messages say so
                continue
            outputs = list(request.output_token_ids)
            if outcome is Handover.NO_KV:
                self._send(wire.Migrated(request_id, outputs), final=True)
                continue
            kv = self._hold(request_id, request.num_tokens - 1)
            self._send(wire.Migrated(request_id, outputs, kv, sampler_state))

    def _hold(self, request_id: str, num_tokens: int) -> wire.KVHandle:
        """Keep a request's blocks for another worker to pull, under a lease."""
        self._leases[request_id] = time.monotonic() + self.config.lease_seconds
        table = self.engine.kv.block_table(request_id)
        block_ids = list(table[: self.engine.kv.blocks_for_tokens(num_tokens)])
        token = self._lease_started(request_id, block_ids)
        # On the engine thread, between steps: for 90 MiB (2k tokens of SmolLM2 in fp32) ~4 ms
        # if the blocks are contiguous, ~17 ms if scattered (docs/performance.md); a drain that
        # hands over many streams pays it once per stream.
        digest = kv_digest(self.engine.runner.kv_cache, block_ids) if self._checksum else ""
        return wire.KVHandle(
            worker_id=self.config.worker_id,
            transport=self.config.transport,
            address=self.kv_address,
            block_ids=block_ids,
            num_tokens=num_tokens,
            lease_seconds=self.config.lease_seconds,
            lease_ends_monotonic=time.monotonic() + self.config.lease_seconds,
            lease_id=request_id,
            lease_token=token.hex(),
            kv_digest=digest,
            node_id=self.config.node_id,
            shm_address=self.shm_address,
        )

    # -- outputs --------------------------------------------------------------------------------------
    def _emit(self, out: EngineOutput) -> None:
        kv = None
        if out.finish_reason == "prefilled":
            # Every token but the one just sampled: the prompt, and the outputs of a resumed stream.
            kv = self._hold(out.request_id, self.engine.scheduler.held[out.request_id].num_tokens - 1)
        logprobs = None
        if out.new_logprobs is not None:
            logprobs = [(lp.token_id, lp.logprob, lp.top) for lp in out.new_logprobs]
        stop_reason = out.stop_reason if isinstance(out.stop_reason, int) else None
        self._send(
            wire.Tokens(
                out.request_id,
                out.new_token_ids,
                out.finish_reason,
                stop_reason,
                logprobs,
                kv,
                queue_seconds=out.queue_seconds,
            ),
            # A prefilled request stays until its blocks are released (the owner sends Release).
            final=out.finished and kv is None,
        )

    def _expire_leases(self) -> None:
        if not self._leases:
            return
        now = time.monotonic()
        for request_id in [r for r, expiry in self._leases.items() if expiry < now]:
            del self._leases[request_id]
            self._lease_ended(request_id)
            self._forget(request_id)
            if self.engine.release(request_id):
                self.lease_expiries += 1
                logger.warning(
                    "worker %s: lease of %s expired; its KV blocks are freed",
                    self.config.worker_id,
                    request_id,
                )

    # -- lease hooks for the KV exporter ------------------------------------------------------------
    def _lease_started(self, request_id: str, block_ids: list[int]) -> bytes:
        """The lease's token: a pull must show it (b"" with shm, whose reads have no server)."""
        if self.exporter is not None:
            return self.exporter.register(request_id, block_ids)
        return b""

    def _lease_ended(self, request_id: str) -> None:
        """Before the blocks are freed: the exporter stops serving them (it waits for, or cuts, a
        read in flight), so a late pull can never read blocks another request reuses."""
        if self.exporter is not None:
            self.exporter.unregister(request_id)

    def _record_step(self, started: float) -> None:
        step = self.engine.last_step
        if step is None or step is self._last_recorded:  # an empty step leaves the last one
            return
        self._last_recorded = step
        if logger.isEnabledFor(logging.DEBUG):
            # A stream's gap is this step plus the loop's work since the last one (messages, KV
            # pulls it waited for, hand-overs, emitting): both, to tell a slow step from a slow loop.
            ended = time.perf_counter()
            since_last = (started - self._last_step_ended) * 1000 if self._last_step_ended else 0.0
            logger.debug(
                "step %.1f ms (prompt tokens %d, attention %d, streams %d, context %d; "
                "emit %.1f ms), %.1f ms since the last step",
                step.step_seconds * 1000,
                step.num_prefill_tokens,
                step.prefill_attention,
                step.num_decode_tokens,
                step.decode_context,
                (ended - started - step.step_seconds) * 1000,
                since_last,
            )
            self._last_step_ended = ended
        self._steps.append(
            wire.StepSample(
                step.step_seconds,
                step.num_prefill_tokens,
                step.prefill_attention,
                step.num_decode_tokens,
                step.decode_context,
            )
        )
        if len(self._steps) > wire.MAX_STEP_SAMPLES:
            del self._steps[0]

    def _load(self) -> wire.Load:
        stats = self.engine.stats()
        step = self.engine.last_step
        steps, self._steps = self._steps, []
        return wire.Load(
            worker_id=self.config.worker_id,
            num_running=stats.num_running,
            num_waiting=stats.num_waiting + stats.num_receiving_kv,
            queued_prompt_tokens=stats.queued_prompt_tokens,
            kv_blocks_used=stats.kv_blocks_used,
            kv_blocks_free=stats.kv_blocks_free,
            num_held=stats.num_held,
            last_step_ms=step.step_seconds * 1000 if step else 0.0,
            steps=steps,
            kv_blocks_total=stats.kv_blocks_used + stats.kv_blocks_free,
            block_size=self.engine.config.block_size,
            rpc_refused=self.rpc.refused,
            rpc_dropped=self.rpc.dropped_frames,
            steps_between_layers=self.engine.steps_between_layers,
        )

    def _send(self, message: wire.Message, *, final: bool = False) -> None:
        """To the peer that owns the message's request (every peer for a load report). `final`:
        the request is over on this worker, so its owner can be forgotten."""
        assert self._outbox is not None, "only the engine thread sends, while serving"
        request_id = getattr(message, "request_id", "")
        self._outbox.send_multipart([request_id.encode(), FINAL if final else MORE, wire.encode(message)])

    def _forget(self, request_id: str) -> None:
        """The request is over here without a last message (its lease ran out)."""
        assert self._outbox is not None
        self._outbox.send_multipart([request_id.encode(), FINAL, b""])
