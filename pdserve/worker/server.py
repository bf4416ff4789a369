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

What is done with each command and each output is decided by the thread-free core
(`pdserve.worker.core.WorkerCore`, one record per request); this module only moves them between
threads and sockets. Every timeout is explicit: the lease on held blocks (the core), the KV pull
timeout, the idle wait.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import zmq

from pdserve import wire
from pdserve.config import WorkerConfig
from pdserve.engine.core import EngineCore
from pdserve.engine.runner import ModelRunner
from pdserve.security import WorkerSecrets
from pdserve.transfer.base import ChecksumError, KVExporter, KVImporter, TransferError
from pdserve.transfer.checksum import checksum_enabled, kv_block_digests
from pdserve.worker.core import KVDone, PullOrder, WorkerCore
from pdserve.worker.rpc import FINAL, MORE, LoadWanted, RpcEndpoint

logger = logging.getLogger(__name__)


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
        self._last_step_ended = 0.0  # perf_counter when the last recorded step's outputs were sent
        self._idled = False  # the loop waited with no work since that step
        self._nested_seconds = 0.0  # steps run between the layers of the step in progress
        self._pull_wait = 0.0  # seconds the loop waited on KV pulls since the last recorded step
        self._pulled_blocks = 0  # the blocks of the pulls it waited on, since then
        self.config = config
        self._on_bound = on_bound
        # The pulls run here, on the pool; the core keeps the addresses and tells the exporter of
        # each lease (so it never serves a block after it was freed). All are closed here.
        self.importer = importer
        self.same_node_importer = same_node_importer
        self.exporter = exporter
        self._inbox: queue.Queue[wire.Message | KVDone | LoadWanted] = queue.Queue()
        # Prefill role: short prompts may run between two layers of a long step (_between_layers);
        # the other messages that arrive meanwhile wait here for the step to end.
        self._interrupts = config.prefill_interrupts and engine.interrupts_steps
        self._deferred: list[wire.Message | KVDone | LoadWanted] = []
        self._load_wanted = False  # the RPC thread asked for a load report (a peer awaits Ready)
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
        self._pulls = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-pull") if importer else None
        # Digest what this worker holds for another, check what it pulls (transfer/checksum.py).
        kv_cache = engine.runner.kv_cache
        self._checksum = checksum_enabled(config.kv_checksum, kv_cache)
        if config.kv_corrupt_rate > 0 and not self._checksum:  # "auto" on a GPU cache: off
            raise ValueError("kv_corrupt_rate needs the KV checksum, which is off for this cache")
        self._warned_no_digest = False
        self.core = WorkerCore(
            engine,
            config,
            send=self._send,
            forget=self._forget,
            kv_address=kv_address,
            shm_address=shm_address,
            exporter=exporter,
            importer=importer,
            same_node_importer=same_node_importer,
            digest=(lambda block_ids: kv_block_digests(kv_cache, block_ids)) if self._checksum else None,
        )

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
        return self.core.ready(rpc_address, self.rpc.keypair.public, self._interrupts)

    def _engine_loop(self) -> None:
        engine, core = self.engine, self.core
        last_load = 0.0
        while not self._stop.is_set():
            if self._stop_requested:
                logger.info("worker %s: stopping (signal)", self.config.worker_id)
                self._stop.set()
                break
            busy = engine.has_unfinished
            self._idled = self._idled or not busy
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
            blocks = self._start_pulls()
            if blocks:
                waiting = time.perf_counter()
                self._await_pulls(time.monotonic() + self.config.kv_join_wait)
                self._pull_wait += time.perf_counter() - waiting
                self._pulled_blocks += blocks
            core.hand_over()
            if engine.has_unfinished:
                step_started = time.perf_counter()
                for out in engine.step(self._between_layers if self._interrupts else None):
                    core.emit(out)
                self._record_step(step_started)
                core.hand_over()  # right after their tokens: the next step would not wait
            core.expire_leases(time.monotonic())
            now = time.monotonic()
            if self._load_wanted or core.load_due(now - last_load):
                self._send(core.load(self.rpc.refused, self.rpc.dropped_frames))
                last_load, self._load_wanted = now, False

    def _apply(self, item: wire.Message | KVDone | LoadWanted) -> None:
        if isinstance(item, LoadWanted):
            self._load_wanted = True
            return
        if isinstance(item, wire.AddRequest):  # when it came off the socket: its wait counts from there
            self.core.add(item, self.rpc.received_at.pop(item.request_id, None))
        else:
            self.core.apply(item)
        if self.core.stop_asked:
            self._stop.set()

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
                    self._apply(item)
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
            self.core.emit(out)
        if outputs:
            self._record_step(started, nested=True)

    # -- KV pulls (decode side) -------------------------------------------------------------------------
    def _start_pulls(self) -> int:
        """Submits the pulls the engine asks for to the pool; returns the blocks they move (0: no
        pull started)."""
        orders = self.core.pulls_to_start()
        assert self._pulls is not None or not orders, "a pull ordered on a worker without an importer"
        for order in orders:
            assert self._pulls is not None
            self._pulls.submit(self._pull, order)
        return sum(len(order.dst_blocks) for order in orders)

    def _await_pulls(self, deadline: float) -> None:
        """Apply messages until no pull is in flight or the deadline passes (see kv_join_wait)."""
        while self.core.pulls_in_flight and not self._stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            try:
                self._apply(self._inbox.get(timeout=remaining))
            except queue.Empty:
                return

    def _pull(self, order: PullOrder) -> None:
        """On the pull pool: the blocks in, the outcome back to the engine thread, whatever
        happens (a pull that never reported would hold its request, and its blocks, for ever)."""
        try:
            self._pull_blocks(order)
        except Exception as exc:  # a bug, not a transfer error: said, and the request fails
            logger.exception("worker %s: the pull of %s failed", self.config.worker_id, order.request_id)
            self._inbox.put(
                KVDone(order.request_id, False, f"the pull failed: {exc!r}", transport=order.transport)
            )

    def _pull_blocks(self, order: PullOrder) -> None:
        handle, transport, request_id = order.handle, order.transport, order.request_id
        importer = self.importer if transport == handle.transport else self.same_node_importer
        assert importer is not None
        # The shm copy reads the other cache without a lease check of its own: start it only
        # with time to finish well before the blocks may be freed and reused over there.
        if order.lease_ends - time.monotonic() < min(self.config.kv_pull_timeout, 5.0):
            error = f"the lease on worker {handle.worker_id} expires too soon"
            self._inbox.put(KVDone(request_id, False, error, transport=transport))
            return
        if self._checksum and not handle.kv_block_digests and not self._warned_no_digest:
            self._warned_no_digest = True  # once: a holder with --kv-checksum off, or a GPU one
            logger.warning(
                "worker %s: KV from worker %s comes without a digest: it is not checked",
                self.config.worker_id,
                handle.worker_id,
            )
        started = time.perf_counter()
        try:
            nbytes = importer.pull(
                order.address,
                order.src_blocks,  # the handle's blocks this engine lacks (a delta)
                order.dst_blocks,
                self.config.kv_pull_timeout,
                request_id=handle.lease_id,  # names the holder's lease (tcp, nixl check it) ...
                lease_token=bytes.fromhex(handle.lease_token),  # ... and proves the right to it
                block_digests=order.block_digests if self._checksum else (),
            )
        except TransferError as exc:
            bad_sum = isinstance(exc, ChecksumError)
            seconds = time.perf_counter() - started
            self._inbox.put(KVDone(request_id, False, str(exc), 0, seconds, bad_sum, transport))
            return
        self._inbox.put(
            KVDone(request_id, True, None, nbytes, time.perf_counter() - started, False, transport)
        )

    # -- outputs --------------------------------------------------------------------------------------
    def _record_step(self, started: float, nested: bool = False) -> None:
        """After a step's outputs left: its sample, with the loop's time around it. `nested`: a
        step run between two layers of another (its own emit only; the outer step's loop time
        leaves the nested steps out)."""
        ended = time.perf_counter()
        last = self.engine.last_step
        seconds = last.step_seconds if last is not None else 0.0
        emit = ended - started - seconds
        if nested:
            self._nested_seconds += ended - started
            since_last = 0.0
        else:
            emit -= self._nested_seconds
            self._nested_seconds = 0.0
            # The loop's work since the last step (messages, KV pulls it waited for, hand-overs),
            # unless it waited idle meanwhile: that is no cost of serving.
            since_last = started - self._last_step_ended if self._last_step_ended and not self._idled else 0.0
        pull_wait, pull_blocks = (self._pull_wait, self._pulled_blocks) if since_last > 0 else (0.0, 0)
        step = self.core.record_step(emit + since_last, pull_wait, pull_blocks)
        if not nested:
            self._last_step_ended = ended
            self._idled = False
            self._pull_wait, self._pulled_blocks = 0.0, 0
        if step is None or not logger.isEnabledFor(logging.DEBUG):
            return
        # A stream's gap is this step plus the loop's work since the last one: both, to tell a
        # slow step from a slow loop.
        logger.debug(
            "step %.1f ms (prompt tokens %d, attention %d, streams %d, context %d; "
            "emit %.1f ms), %.1f ms since the last step",
            step.seconds * 1000,
            step.prefill_tokens,
            step.prefill_attention,
            step.decode_streams,
            step.decode_context,
            emit * 1000,
            since_last * 1000,
        )

    def _send(self, message: wire.Message, final: bool = False) -> None:
        """To the peer that owns the message's request (every peer for a load report). `final`:
        the request is over on this worker, so its owner can be forgotten."""
        assert self._outbox is not None, "only the engine thread sends, while serving"
        request_id = getattr(message, "request_id", "")
        self._outbox.send_multipart([request_id.encode(), FINAL if final else MORE, wire.encode(message)])

    def _forget(self, request_id: str) -> None:
        """The request is over here without a last message (its lease ran out)."""
        assert self._outbox is not None
        self._outbox.send_multipart([request_id.encode(), FINAL, b""])
