"""A worker's logic, without threads or sockets: commands in, messages out, one record per request.

`WorkerServer` (worker/server.py) owns the threads (the RPC thread, the KV pulls' pool) and the
sockets; it hands every command and every finished pull to this core on the engine thread, which
applies them to the engine between steps, and sends what comes out through the `send` it was
given. What the worker keeps for a request beside the engine's own state is one `OnWorker`
record: where its KV comes from and until when (decode side), whether a pull into its blocks is
in flight, whether it is asked to move, and until when its blocks are held for another worker
(the lease; a transport that serves reads, tcp or nixl, is told of each lease too, so it never
serves a block after it was freed).

Every timeout is explicit: the lease on held blocks, checked by `expire_leases` each loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pdserve import clock, wire
from pdserve.config import WorkerConfig
from pdserve.engine.core import EngineCore, EngineOutput
from pdserve.engine.sched_types import Handover
from pdserve.errors import InvalidRequestError

if TYPE_CHECKING:  # torch: only a worker with a transport has them
    from pdserve.transfer.base import KVExporter, KVImporter

logger = logging.getLogger(__name__)


@dataclass
class KVDone:
    """A pull's outcome, back on the engine thread."""

    request_id: str
    ok: bool
    error: str | None
    nbytes: int = 0
    seconds: float = 0.0
    checksum_failed: bool = False
    transport: str = ""  # the one the pull went over


@dataclass(frozen=True)
class PullOrder:
    """A pull for the server's pool to run: `src_blocks` of `handle`'s into `dst_blocks` over
    `transport` at `address`, to end before `lease_ends` (this host's monotonic clock). The
    source blocks are the handle's last ones: the first ones the engine found in its own prefix
    cache are not pulled (a delta); `block_digests` are the handle's digests of those pulled."""

    request_id: str
    handle: wire.KVHandle
    dst_blocks: list[int]
    lease_ends: float
    transport: str
    address: str
    src_blocks: list[int]
    block_digests: list[str]


@dataclass
class OnWorker:
    """What this worker keeps for one request beside the engine's own state."""

    source: wire.KVHandle | None = None  # decode side: where its KV comes from, until KVPulled
    source_lease_ends: float = 0.0  # ... and when that lease ends here (from the handle's arrival)
    pulling: bool = False  # a pull writes into its blocks: they may not be freed meanwhile
    abort_after_pull: bool = False  # aborted while pulling: freed once the pull is over
    moving: bool = False  # asked to move (Migrate) and not handed over yet
    lease_ends: float | None = None  # its blocks are held for another worker until then


Send = Callable[[wire.Message, bool], None]  # (message, final: the request is over here)


class WorkerCore:
    def __init__(
        self,
        engine: EngineCore[Any],  # over any runner: the model on a device, or a modelled one
        config: WorkerConfig,
        *,
        send: Send,
        forget: Callable[[str], None],
        kv_address: str,
        shm_address: str = "",
        exporter: KVExporter | None = None,
        importer: KVImporter | None = None,
        same_node_importer: KVImporter | None = None,
        digest: Callable[[list[int]], list[str]] | None = None,
        takes_kv: bool | None = None,
    ) -> None:
        """`send`: a message to the peer that owns its request (every peer for a load report);
        `forget`: a request is over here without a last message; `kv_address`/`shm_address`: where
        this worker's KV can be read; `exporter`: the transport that serves reads of leased blocks;
        `importer` (and `same_node_importer`, shm to the workers of this node): where pulls go;
        `digest`: the checksum of blocks held for another worker (None: none is sent);
        `takes_kv`: whether it takes requests whose KV is elsewhere (default: it has an importer)."""
        self.engine = engine
        self.config = config
        # Its load reports tell the router which prefixes it has cached (KV-aware routing).
        engine.kv.record_events = engine.kv.prefix_cache
        self._send = send
        self._forget = forget
        self.kv_address = kv_address
        self.shm_address = shm_address
        self.exporter = exporter
        self.importer = importer
        self.same_node_importer = same_node_importer
        self.digest = digest
        self.takes_kv = importer is not None if takes_kv is None else takes_kv
        self.requests: dict[str, OnWorker] = {}
        self.stop_asked = False  # a Shutdown came
        self.lease_expiries = 0
        self.kv_failures = 0
        self._steps: list[wire.StepSample] = []  # since the last load report
        self._last_recorded: object = None
        self._pull_seconds = 0.0  # the copies of the pulls done since the last recorded step

    def ready(self, rpc_address: str, rpc_public_key: str, prefill_interrupts: bool) -> wire.Ready:
        """This worker's greeting: its role, its engine's limits, where it is reached."""
        engine = self.engine
        return wire.Ready(
            worker_id=self.config.worker_id,
            role=engine.config.role.value,
            model=engine.config.model,
            max_model_len=engine.max_model_len,
            vocab_size=engine.limits.vocab_size,
            kv_transport=self.config.transport,
            kv_address=self.kv_address,
            rpc_address=rpc_address,
            chunk_size=engine.chunk_size,
            max_num_batched_tokens=engine.max_num_batched_tokens,
            max_num_seqs=engine.config.max_num_seqs,
            rpc_public_key=rpc_public_key,
            node_id=self.config.node_id,
            kv_shm_address=self.shm_address,
            prefill_interrupts=prefill_interrupts,
            prefix_salt=engine.kv.salt.decode() if engine.kv.prefix_cache else "",
        )

    def _record(self, request_id: str) -> OnWorker:
        return self.requests.setdefault(request_id, OnWorker())

    def _drop(self, request_id: str) -> None:
        """The record goes once nothing of it is left to track."""
        record = self.requests.get(request_id)
        if record is not None and not (
            record.source or record.pulling or record.moving or record.lease_ends is not None
        ):
            del self.requests[request_id]

    @property
    def pulls_in_flight(self) -> bool:
        return any(r.pulling for r in self.requests.values())

    # -- commands -------------------------------------------------------------------------------------
    def apply(self, item: wire.Message | KVDone) -> None:
        engine = self.engine
        if isinstance(item, KVDone):
            self._pull_done(item)
        elif isinstance(item, wire.AddRequest):
            self.add(item)
        elif isinstance(item, wire.Migrate):
            for request_id in item.request_ids:
                self._record(request_id).moving = True
        elif isinstance(item, wire.Abort):
            record = self.requests.get(item.request_id)
            if record is not None:
                record.source, record.moving = None, False
                if record.pulling:  # its blocks go once the pull is over
                    record.abort_after_pull = True
                    return
                if record.lease_ends is not None:
                    self._end_lease(item.request_id)
                self._drop(item.request_id)
            engine.abort(item.request_id)
            engine.release(item.request_id)
        elif isinstance(item, wire.Release):
            if item.request_id in self.requests and self.requests[item.request_id].lease_ends is not None:
                self._end_lease(item.request_id)
                self._drop(item.request_id)
            engine.release(item.request_id)
        elif isinstance(item, wire.Forget):
            if item.kv_address in (self.kv_address, self.shm_address):
                return
            for importer in (self.importer, self.same_node_importer):
                if importer is not None:
                    importer.forget(item.kv_address)
        elif isinstance(item, wire.Shutdown):
            self.stop_asked = True

    def add(self, msg: wire.AddRequest, arrived_at: float | None = None) -> None:
        try:
            params = msg.params.to_params()
            if msg.kv is not None:
                if not self.takes_kv:
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
            self._send(wire.Tokens(msg.request_id, [], "error", error=error, invalid=True), True)
            return
        if msg.kv is not None:
            record = self._record(msg.request_id)
            record.source = msg.kv
            record.source_lease_ends = clock.monotonic() + msg.kv.lease_seconds

    # -- KV pulls (decode side) -------------------------------------------------------------------------
    def pulls_to_start(self) -> list[PullOrder]:
        """The pulls the engine asks for now, each marked in flight (the server runs them)."""
        orders, failed = [], []
        done_already = []
        for request_id, dst_blocks in self.engine.take_kv_to_receive():
            record = self.requests.get(request_id)
            handle = record.source if record is not None else None
            if record is None or handle is None or not self.takes_kv:
                failed.append(KVDone(request_id, False, "no KV source for this request"))
                continue
            # The engine gave blocks for what it lacks: the handle's first blocks it has cached.
            first = len(handle.block_ids) - len(dst_blocks)
            if first < 0:
                failed.append(
                    KVDone(request_id, False, "the KV handle holds fewer blocks than the request needs")
                )
                continue
            transport, address = self._route(handle)
            if not dst_blocks:  # every block was cached here: nothing to pull
                done_already.append(KVDone(request_id, True, None, 0, 0.0, False, transport))
                continue
            record.pulling = True
            # shm: the holder is on this host, its deadline is exact here; else another host's
            # clock: its lease's length, from the handle's arrival here.
            lease_ends = handle.lease_ends_monotonic if transport == "shm" else record.source_lease_ends
            src, digests = handle.block_ids[first:], handle.kv_block_digests[first:]
            orders.append(
                PullOrder(request_id, handle, dst_blocks, lease_ends, transport, address, src, digests)
            )
        for done in failed + done_already:
            self._pull_done(done)
        return orders

    def _route(self, handle: wire.KVHandle) -> tuple[str, str]:
        """The transport and address of a pull, per pair of workers: the holder's shared-memory
        segment when it is on this node and has one, else its own transport (tcp, nixl)."""
        same_node = bool(handle.node_id) and handle.node_id == self.config.node_id
        if same_node and handle.shm_address and self.same_node_importer is not None:
            return "shm", handle.shm_address
        return handle.transport, handle.address

    def _pull_done(self, done: KVDone) -> None:
        engine = self.engine
        self._pull_seconds += done.seconds if done.ok else 0.0
        record = self.requests.get(done.request_id)
        if record is not None:
            record.pulling = False
            if record.abort_after_pull:
                del self.requests[done.request_id]
                engine.abort(done.request_id)  # the pull is over: now its blocks can go
                return
            source, record.source = record.source, None
            self._drop(done.request_id)
            if source is not None:  # else aborted meanwhile
                self._send(
                    wire.KVPulled(
                        done.request_id, done.ok, done.nbytes, done.seconds, done.error,
                        done.checksum_failed, done.transport,
                    ),
                    False,
                )  # fmt: skip
        failed = engine.kv_received(done.request_id, done.ok)
        if failed is not None:
            self.kv_failures += 1
            logger.error(
                "worker %s: KV for %s failed: %s", self.config.worker_id, done.request_id, done.error
            )
            self._send(
                wire.Tokens(done.request_id, [], "error", error=f"KV transfer failed: {done.error}"), True
            )

    # -- handing streams over -------------------------------------------------------------------------
    def hand_over(self) -> None:
        """The requests asked to move that now can: each is answered with Migrated."""
        for request_id in [r for r, record in self.requests.items() if record.moving]:
            outcome, request, sampler_state = self.engine.hand_over(request_id)
            if outcome is Handover.NOT_YET:
                continue
            self.requests[request_id].moving = False
            self._drop(request_id)
            if request is None:  # finished, aborted or already held: its own messages say so
                continue
            outputs = list(request.output_token_ids)
            if outcome is Handover.NO_KV:
                self._send(wire.Migrated(request_id, outputs), True)
                continue
            kv = self._hold(request_id, request.num_tokens - 1)
            self._send(wire.Migrated(request_id, outputs, kv, sampler_state), False)

    def _hold(self, request_id: str, num_tokens: int) -> wire.KVHandle:
        """Keep a request's blocks for another worker to pull, under a lease."""
        now = clock.monotonic()
        self._record(request_id).lease_ends = now + self.config.lease_seconds
        block_ids = self.engine.held_blocks(request_id, num_tokens)
        # The lease's token: a pull must show it (b"" with shm, whose reads have no server).
        token = self.exporter.register(request_id, block_ids) if self.exporter is not None else b""
        # On the engine thread, between steps: for 90 MiB (2k tokens of SmolLM2 in fp32) ~4 ms
        # if the blocks are contiguous, ~17 ms if scattered (docs/performance.md); a drain that
        # hands over many streams pays it once per stream.
        digests = self.digest(block_ids) if self.digest is not None else []
        return wire.KVHandle(
            worker_id=self.config.worker_id,
            transport=self.config.transport,
            address=self.kv_address,
            block_ids=block_ids,
            num_tokens=num_tokens,
            lease_seconds=self.config.lease_seconds,
            lease_ends_monotonic=now + self.config.lease_seconds,
            lease_id=request_id,
            lease_token=token.hex(),
            kv_block_digests=digests,
            node_id=self.config.node_id,
            shm_address=self.shm_address,
        )

    def _end_lease(self, request_id: str) -> None:
        """Before the blocks are freed: the exporter stops serving them (it waits for, or cuts, a
        read in flight), so a late pull can never read blocks another request reuses."""
        self.requests[request_id].lease_ends = None
        if self.exporter is not None:
            self.exporter.unregister(request_id)

    def expire_leases(self, now: float) -> None:
        for request_id, record in list(self.requests.items()):
            if record.lease_ends is None or record.lease_ends >= now:
                continue
            self._end_lease(request_id)
            self._drop(request_id)
            self._forget(request_id)
            if self.engine.release(request_id):
                self.lease_expiries += 1
                logger.warning(
                    "worker %s: lease of %s expired; its KV blocks are freed",
                    self.config.worker_id,
                    request_id,
                )

    # -- outputs --------------------------------------------------------------------------------------
    def emit(self, out: EngineOutput) -> None:
        kv = None
        if out.finish_reason == "prefilled":
            # Every token but the one just sampled: the prompt, and the outputs of a resumed stream.
            kv = self._hold(out.request_id, self.engine.held_tokens(out.request_id) - 1)
        logprobs = None
        if out.new_logprobs is not None:
            logprobs = [(lp.token_id, lp.logprob, lp.top) for lp in out.new_logprobs]
        stop_reason = out.stop_reason if isinstance(out.stop_reason, int) else None
        message = wire.Tokens(
            out.request_id,
            out.new_token_ids,
            out.finish_reason,
            stop_reason,
            logprobs,
            kv,
            queue_seconds=out.queue_seconds,
        )
        # A prefilled request stays until its blocks are released (the owner sends Release).
        self._send(message, out.finished and kv is None)

    def record_step(
        self, loop_seconds: float = 0.0, pull_wait_seconds: float = 0.0, pull_blocks: int = 0
    ) -> wire.StepSample | None:
        """The engine's last step as a sample for the next load report (None: no new step), with
        the loop's time around it, the part of it spent waiting on pulls and the blocks those
        pulls moved (wire.StepSample.loop_seconds, pull_wait_seconds, pull_blocks; with blocks,
        the time the pulls done since the last step took to copy, pull_seconds)."""
        step = self.engine.last_step
        if step is None or step is self._last_recorded:  # an empty step leaves the last one
            return None
        self._last_recorded = step
        pull_seconds, self._pull_seconds = (self._pull_seconds if pull_blocks > 0 else 0.0), 0.0
        sample = wire.StepSample(
            step.step_seconds,
            step.num_prefill_tokens,
            step.prefill_attention,
            step.num_decode_tokens,
            step.decode_context,
            max(0.0, loop_seconds),
            min(max(0.0, pull_wait_seconds), max(0.0, loop_seconds)),
            max(0, pull_blocks),
            max(0.0, pull_seconds),
        )
        self._steps.append(sample)
        if len(self._steps) > wire.MAX_STEP_SAMPLES:
            del self._steps[0]
        return sample

    def load_due(self, since_last_s: float) -> bool:
        """A load report is due: every `load_interval`, and after `prefix_report_interval` when
        the prefix cache stored or evicted blocks since the last (the router's view of what each
        worker has cached lags by that much, not by a whole interval)."""
        if since_last_s >= self.config.load_interval:
            return True
        return self.engine.kv.has_events and since_last_s >= self.config.prefix_report_interval

    def load(self, rpc_refused: int = 0, rpc_dropped: int = 0) -> wire.Load:
        stats = self.engine.stats()
        step = self.engine.last_step
        steps, self._steps = self._steps, []
        stored, evicted = self.engine.kv.take_events()
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
            rpc_refused=rpc_refused,
            rpc_dropped=rpc_dropped,
            steps_between_layers=self.engine.steps_between_layers,
            prefix_queries=stats.prefix_queries,
            prefix_hits=stats.prefix_hits,
            prefix_cached_blocks=stats.cached_blocks,
            prefix_stored=stored,
            prefix_evicted=evicted,
        )
