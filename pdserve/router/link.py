"""The router's link to one worker (no torch): its state, its last reports, the legs (requests)
open on it, and what it is told. `pdserve.router.workers.WorkerSet` keeps one per worker.

A worker is up from its `Ready` until the connection drops or it goes silent (`check_stalled`).
Everything waiting on a dropped worker is told (`WorkerDown`) straight away, so no stream hangs on
a dead process; the legs it held are aborted there if it answers again.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pdserve import clock, wire
from pdserve.router.channel import Channel, Connector
from pdserve.router.prefix import CachedPrefixes
from pdserve.router.views import DownCause, WorkerState, WorkerView

logger = logging.getLogger("pdserve.router.workers")  # one logger for the links and their set

STEP_MEMORY_S = 60.0  # how far back a worker's longest step is remembered
# A prefill worker's measured rate weighs its prompt steps of about the last this many seconds
# (an exponential average over the steps' own time, whatever the reports' cadence: a report may
# carry one step, or a tenth of a second of them).
PREFILL_RATE_MEMORY_S = 0.45


@dataclass(frozen=True)
class WorkerDown:
    worker_id: str
    reason: str


LegEvent = wire.Tokens | wire.KVPulled | wire.Migrated | WorkerDown


class Leg:
    """One request (under one leg id) on one worker: the events that worker sends for it.

    Its link counts its legs by what they are doing (`WorkerLink.view` is taken several times for
    every request placed, over a hundred legs on a busy decode worker): `prompt_tokens`, `done`
    and `move_reason` tell the link as they change."""

    def __init__(
        self,
        leg_id: str,
        link: WorkerLink,
        *,
        prompt_tokens: int = 0,
        receiving: bool = False,
        request_started: float | None = None,
    ) -> None:
        self.leg_id = leg_id
        self.link = link
        self.events: asyncio.Queue[LegEvent] = asyncio.Queue()
        # Counted in the link's queued prompt tokens until the first token.
        self._prompt_tokens = prompt_tokens
        self._done = False  # the worker holds nothing for it any more (finished, released, aborted)
        self._move_reason: str | None = None  # asked to move (drain, rebalance): the Migrate is sent
        self.receiving = receiving  # its KV is on its way to this worker (until KVPulled)
        # The request's start, not the leg's.
        self.request_started = clock.monotonic() if request_started is None else request_started

    @property
    def prompt_tokens(self) -> int:
        return self._prompt_tokens

    @prompt_tokens.setter
    def prompt_tokens(self, value: int) -> None:
        share = self.share()
        self._prompt_tokens = value
        self.link.recount(self, share)

    @property
    def done(self) -> bool:
        return self._done

    @done.setter
    def done(self, value: bool) -> None:
        share = self.share()
        self._done = value
        self.link.recount(self, share)

    @property
    def move_reason(self) -> str | None:
        return self._move_reason

    @move_reason.setter
    def move_reason(self, value: str | None) -> None:
        share = self.share()
        self._move_reason = value
        self.link.recount(self, share)

    def share(self) -> tuple[bool, bool, bool]:
        """What it counts for in its link's view: (decoding, staying, its prompt queued)."""
        live = not self._done
        return live and self._prompt_tokens == 0, live and self._move_reason is None, self._prompt_tokens > 0

    def close(self, abort: bool) -> None:
        """Stop listening; with `abort`, tell the worker to drop the request and free its blocks."""
        if abort and not self.done and self.link.connected:
            self.link.send(wire.Abort(self.leg_id))
        self.done = True
        self.link.forget(self)


class WorkerLink:
    def __init__(
        self,
        worker_id: str,
        pool: str,
        connector: Connector,
        *,
        routing_id: bytes,
        on_load: Callable[[WorkerLink], None] | None = None,
        on_state: Callable[[WorkerLink], None] | None = None,
        on_change: Callable[[], None] | None = None,
    ) -> None:
        """`on_load`: each load report; `on_state`: each change of state; `on_change`: anything
        else a waiter may care about (a request that ended here)."""
        self.worker_id = worker_id
        self.pool = pool
        self.routing_id = routing_id
        self.address: str | None = None  # known once the backend has started the worker
        self.ready: wire.Ready | None = None
        self.load: wire.Load | None = None
        self.state = WorkerState.STARTING
        self.opened_at = self.state_since = clock.monotonic()
        self.up_at: float | None = None  # when it first said Ready: its cold start counts from here
        # Its measured prefill throughput: prompt tokens per second of the steps that had prompt
        # tokens (an average weighted toward the recent, from its load reports' steps).
        self.prefill_tokens_per_s: float | None = None
        self.detail = "starting"  # why it is in its state, for people (GET /pools, /health, logs)
        self.down_cause: DownCause | None = None  # set while it is unreachable
        self._reachable = False  # said Ready, and has not dropped or gone silent since
        self.legs: dict[str, Leg] = {}
        # Its legs counted by their `Leg.share`: decoding (not done, past the prompt), staying (not
        # done, not asked to move), and the prompts queued (leg id -> tokens, oldest first).
        self._decoding = self._staying = 0
        self._queued: dict[str, int] = {}
        self.queued_prompt_tokens = 0  # prompt tokens sent here that have not produced a token yet
        self._on_load = on_load
        self._on_change = on_change
        self._on_state = on_state
        self._connector = connector
        self._channel: Channel | None = None
        self.last_message_at = clock.monotonic()
        self.load_at = 0.0  # when the last load report came
        # (when, seconds) of the longest step in each recent load report: a worker reports only
        # between steps, so the longest recent step says how long a silence is still just work.
        self._recent_steps: deque[tuple[float, float]] = deque()
        # Legs dropped when the link went down: aborted on the worker once it answers again, in
        # case the process is the same one and still holds them.
        self.abandoned: set[str] = set()
        self.prefixes = CachedPrefixes()  # the block keys it has cached (router/prefix.py)

    @property
    def role(self) -> str | None:
        return self.ready.role if self.ready else None

    @property
    def up(self) -> bool:
        """Takes new requests."""
        return self.state is WorkerState.UP

    @property
    def connected(self) -> bool:
        """Answers for the requests it holds (up or draining, and reachable)."""
        return self._reachable and self.state in (WorkerState.UP, WorkerState.DRAINING)

    def view(self) -> WorkerView:
        return WorkerView(
            worker_id=self.worker_id,
            pool=self.pool,
            state=self.state,
            detail=self.detail,
            down_cause=self.down_cause,
            connected=self.connected,
            opened_at=self.opened_at,
            state_since=self.state_since,
            up_at=self.up_at,
            ready=self.ready,
            load=self.load,
            load_at=self.load_at,
            streams=len(self.legs),
            decoding=self._decoding,
            staying=self._staying,
            queued_prompts=tuple(self._queued.values()),
            prefill_tokens_per_s=self.prefill_tokens_per_s,
            longest_recent_step_s=self.longest_recent_step_s(),
            prefixes=self.prefixes,
        )

    def connect(self, address: str, server_key: str) -> None:
        """Connect to the worker at `address` whose CURVE public key is `server_key` (from its
        Ready, through the cluster backend); it is up once it answers with Ready."""
        if self._channel is not None:
            raise RuntimeError(f"worker {self.worker_id} is already connected to {self.address}")
        if not server_key:
            raise ValueError(f"worker {self.worker_id} reported no RPC key: it cannot be connected to")
        self.address = address
        self.detail = "connecting"
        self._channel = self._connector.connect(address, server_key, self.routing_id, self)

    async def close(self, reason: str = "stopped") -> None:
        """Stop listening for good: the link ends in `stopped`."""
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel.close()
        self._end_legs(reason)
        was = self.state
        self.state, self.detail, self.load, self._reachable = WorkerState.STOPPED, reason, None, False
        if was is not WorkerState.STOPPED:
            self._notify_state()

    def drain(self) -> None:
        """No new requests from now on; what it holds carries on. It stays draining even if its
        connection drops and comes back."""
        if self.state in (WorkerState.UP, WorkerState.STARTING, WorkerState.DOWN):
            self._set_state(WorkerState.DRAINING, "draining")

    # -- sending --------------------------------------------------------------------------------------
    def send(self, message: wire.Message) -> bool:
        """Send without waiting. False if the worker is not connected (nothing is queued for it)."""
        return self._channel is not None and self._channel.send(wire.encode(message))

    def streams(self) -> list[Leg]:
        """The legs streaming here that have not been asked to move."""
        return [leg for leg in self.legs.values() if not leg.done and leg.move_reason is None]

    def open_leg(
        self,
        leg_id: str,
        prompt_tokens: int = 0,
        *,
        receiving: bool = False,
        request_started: float | None = None,
    ) -> Leg:
        leg = Leg(
            leg_id, self, prompt_tokens=prompt_tokens, receiving=receiving, request_started=request_started
        )
        self._drop(leg_id)  # a leg id opened again: the old leg is replaced (counted out), the new one last
        self.legs[leg_id] = leg
        self._count(leg.share(), 1, leg_id, prompt_tokens)
        self.queued_prompt_tokens += prompt_tokens
        return leg

    def forget(self, leg: Leg) -> None:
        if self._drop(leg.leg_id) is not None:
            self._settle_prompt(leg)
            if self._on_change is not None:
                self._on_change()  # a drain waits for the last leg to go

    def _drop(self, leg_id: str) -> Leg | None:
        leg = self.legs.pop(leg_id, None)
        if leg is not None:
            self._count(leg.share(), -1, leg_id, leg.prompt_tokens)
        return leg

    def recount(self, leg: Leg, before: tuple[bool, bool, bool]) -> None:
        """A leg's `share` was `before` and may have changed: counted again if it is still here
        (a prompt still queued keeps its place)."""
        if self.legs.get(leg.leg_id) is not leg:
            return
        after = leg.share()
        self._decoding += after[0] - before[0]
        self._staying += after[1] - before[1]
        if after[2]:
            self._queued[leg.leg_id] = leg.prompt_tokens
        elif before[2]:
            del self._queued[leg.leg_id]

    def _count(self, share: tuple[bool, bool, bool], sign: int, leg_id: str, prompt_tokens: int) -> None:
        decoding, staying, queued = share
        self._decoding += sign * decoding
        self._staying += sign * staying
        if queued and sign > 0:
            self._queued[leg_id] = prompt_tokens
        elif queued:
            self._queued.pop(leg_id, None)

    def _settle_prompt(self, leg: Leg) -> None:
        self.queued_prompt_tokens -= leg.prompt_tokens
        leg.prompt_tokens = 0

    # -- receiving (ChannelEvents) --------------------------------------------------------------------
    def on_frame(self, data: bytes) -> None:
        try:
            message = wire.decode(data)
        except wire.WireError as exc:
            logger.error("worker %s sent a bad frame: %s", self.worker_id, exc)
            return
        self._handle(message)

    def on_handshake(self) -> None:
        self.send_hello()

    def on_disconnect(self) -> None:
        self._mark_down(
            DownCause.DROPPED, "its connection dropped (process gone or not answering heartbeats)"
        )

    def _handle(self, message: wire.Message) -> None:
        self.last_message_at = clock.monotonic()
        if isinstance(message, wire.Ready):
            self.ready = message
            # A stalled worker's RPC thread answers a hello even while its engine thread hangs:
            # only a load report (from the engine thread) says it works again.
            if self.down_cause is not DownCause.STALLED:
                self._come_back(message.role)
        elif isinstance(message, wire.Load):
            if not self._reachable and self.ready is not None and self.down_cause is DownCause.STALLED:
                self._come_back(self.ready.role)  # it was only slow: it reports again
            self.load = message
            self.load_at = clock.monotonic()
            self.prefixes.apply(message.prefix_stored, message.prefix_evicted)
            self._measure_prefill(message.steps)
            self._note_steps(message, self.load_at)
            self._notify_load()
        elif isinstance(message, wire.Tokens | wire.KVPulled | wire.Migrated):
            leg = self.legs.get(message.request_id)
            if leg is None:
                return  # a leg the router already closed (aborted, timed out): nothing waits
            if isinstance(message, wire.Tokens) and (message.token_ids or message.finish_reason):
                self._settle_prompt(leg)
            elif isinstance(message, wire.KVPulled):
                leg.receiving = False
            leg.events.put_nowait(message)

    def _note_steps(self, load: wire.Load, now: float) -> None:
        longest = max([s.seconds for s in load.steps] + [load.last_step_ms / 1000])
        # A sliding-window maximum: each report's longest step, dropping those a longer, later
        # one outlasts; the front is then the window's longest (read per request placed).
        while self._recent_steps and self._recent_steps[-1][1] <= longest:
            self._recent_steps.pop()
        self._recent_steps.append((now, longest))
        while self._recent_steps and now - self._recent_steps[0][0] > STEP_MEMORY_S:
            self._recent_steps.popleft()

    def longest_recent_step_s(self) -> float:
        """The longest step this worker reported in the last STEP_MEMORY_S seconds (0 if none)."""
        return self._recent_steps[0][1] if self._recent_steps else 0.0

    def _measure_prefill(self, steps: list[wire.StepSample]) -> None:
        tokens = sum(s.prefill_tokens for s in steps if s.prefill_tokens)
        seconds = sum(s.seconds for s in steps if s.prefill_tokens)
        if tokens and seconds > 0:
            rate = tokens / seconds
            old = self.prefill_tokens_per_s
            weight = -math.expm1(-seconds / PREFILL_RATE_MEMORY_S)
            self.prefill_tokens_per_s = rate if old is None else old + weight * (rate - old)

    def _come_back(self, role: str) -> None:
        if self._reachable or self.state is WorkerState.STOPPED:
            return
        self._reachable, self.down_cause = True, None
        # A draining worker stays draining: it was asked to, whatever its connection did.
        state = WorkerState.DRAINING if self.state is WorkerState.DRAINING else WorkerState.UP
        self._set_state(state, "draining" if state is WorkerState.DRAINING else "")
        if self.up_at is None:
            self.up_at = clock.monotonic()
        logger.info("worker %s is %s (%s, %s)", self.worker_id, self.state.value, role, self.address)
        for leg_id in self.abandoned:
            self.send(wire.Abort(leg_id))
        self.abandoned.clear()

    def send_hello(self) -> None:
        # An empty frame: the worker answers with Ready (also after a reconnect to a new process).
        if self._channel is not None and not self._channel.send(b""):
            logger.debug("worker %s: hello not sent (not connected)", self.worker_id)

    def check_stalled(self, stall_timeout: float) -> None:
        """A worker's engine thread reports its load every 0.1 s; silence for `stall_timeout`
        means a hung process (ZeroMQ's own heartbeats are answered by its I/O thread even then)."""
        silent = clock.monotonic() - self.last_message_at
        if self.connected and silent > stall_timeout:
            self._mark_down(DownCause.STALLED, f"stalled: no report for {silent:.0f} s")

    def _mark_down(self, cause: DownCause, reason: str) -> None:
        if not self.connected:
            return
        self._reachable, self.down_cause, self.load = False, cause, None
        self.prefixes.clear()  # a process that comes back may be a new one, with nothing cached
        logger.error("worker %s is down: %s", self.worker_id, reason)
        self._end_legs(reason)
        # A draining worker stays draining (its drain sees it unreachable and ends).
        self._set_state(
            WorkerState.DRAINING if self.state is WorkerState.DRAINING else WorkerState.DOWN, reason
        )

    def _end_legs(self, reason: str) -> None:
        """Everything waiting on this worker hears it now; the legs are dropped: a restarted
        process at the same address knows nothing of them."""
        legs, self.legs = list(self.legs.values()), {}
        self.queued_prompt_tokens = self._decoding = self._staying = 0
        self._queued.clear()
        for leg in legs:
            if not leg.done:
                self.abandoned.add(leg.leg_id)
            leg.done = True
            leg.events.put_nowait(WorkerDown(self.worker_id, reason))

    def _set_state(self, state: WorkerState, detail: str) -> None:
        self.state, self.detail = state, detail
        self.state_since = clock.monotonic()
        self._notify_state()

    def _notify_state(self) -> None:
        if self._on_state is not None:
            self._on_state(self)

    def _notify_load(self) -> None:
        if self._on_load is not None:
            self._on_load(self)
