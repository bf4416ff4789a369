"""The workers' reports into the router's metrics and the planner's signals, and, when asked, every
worker's steps into a trace file (`pdserve serve --step-trace`). No torch."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import IO

from pdserve import clock, wire
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers import WorkerSet, WorkerState, WorkerView
from pdserve.signals import Signals

# A step trace's line: when its load report came (seconds since the trace began), the worker, its
# pool, then wire.StepSample's fields by name.
STEP_TRACE_KEYS = (
    "t_s",
    "worker",
    "pool",
    "seconds",
    "prefill_tokens",
    "prefill_attention",
    "decode_streams",
    "decode_context",
    "loop_seconds",
    "pull_wait_seconds",
    "pull_blocks",
    "pull_seconds",
)


class WorkerRecorder:
    """Each worker's load reports and changes of state, into the metrics and the planner's signals
    (the step samples its cost model fits). The router keeps one; so does `pdserve sim`."""

    def __init__(
        self, workers: WorkerSet, metrics: RouterMetrics, signals: Signals, step_trace: Path | None = None
    ) -> None:
        """`step_trace`: a file to write each worker's steps to, one JSON line each (STEP_TRACE_KEYS),
        as their load reports bring them; written over if it exists."""
        self.workers = workers
        self.metrics = metrics
        self.signals = signals
        workers.on_load = self.load
        workers.on_state = self.state
        # Each worker's prefix-cache totals (queries, hits) at its last report: the pool's
        # counters grow by what each report adds.
        self._prefix_totals: dict[str, tuple[int, int]] = {}
        self._trace: IO[str] | None = None
        self._trace_start = clock.monotonic()
        if step_trace is not None:
            step_trace.parent.mkdir(parents=True, exist_ok=True)
            self._trace = step_trace.open("w", buffering=1)  # a line at a time: readable while serving

    def load(self, link: WorkerView) -> None:
        load = link.load
        if load is None or not link.connected:
            return
        m = self.metrics
        values = (
            load.num_running,
            load.num_waiting,
            load.kv_blocks_used,
            load.kv_blocks_free,
            load.queued_prompt_tokens,
            load.last_step_ms / 1000,
            load.rpc_refused,
            load.rpc_dropped,
            load.steps_between_layers,
            load.prefix_cached_blocks,
        )  # in the order of RouterMetrics.load_gauges
        for gauge, value in zip(m.worker_load(link.pool, link.worker_id), values, strict=True):
            gauge.set(value)
        queries, hits = self._prefix_totals.get(link.worker_id, (0, 0))
        m.prefix_queries.labels(link.pool).inc(max(0, load.prefix_queries - queries))
        m.prefix_hits.labels(link.pool).inc(max(0, load.prefix_hits - hits))
        self._prefix_totals[link.worker_id] = (load.prefix_queries, load.prefix_hits)
        if load.steps and link.up_at is not None:
            self.signals.steps(load.steps, clock.monotonic() - link.up_at)
        if load.steps and self._trace is not None:
            self._write_steps(link, load.steps)

    def _write_steps(self, link: WorkerView, steps: list[wire.StepSample]) -> None:
        assert self._trace is not None
        at = round(clock.monotonic() - self._trace_start, 3)  # when the report came, not the step
        for step in steps:
            row = {"t_s": at, "worker": link.worker_id, "pool": link.pool, "seconds": step.seconds}
            row |= {key: getattr(step, key) for key in STEP_TRACE_KEYS[4:]}
            self._trace.write(json.dumps(row) + "\n")

    def close(self) -> None:
        """Closes the step trace (flushing it), if any."""
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    def state(self, link: WorkerView) -> None:
        m = self.metrics
        if link.state is WorkerState.STOPPED:  # gone for good: so are its series
            m.remove_worker(link.pool, link.worker_id)
            self._prefix_totals.pop(link.worker_id, None)
        else:
            m.worker_up.labels(link.pool, link.worker_id).set(1 if link.connected else 0)
            if not link.connected:  # a dead worker's last load report says nothing about now
                m.remove_worker(link.pool, link.worker_id, keep_up=True)
        pools = {w.pool for w in self.workers.views()} | {link.pool}
        for pool in pools:
            counts = Counter(w.state for w in self.workers.views() if w.pool == pool)
            for state in WorkerState:
                if state is not WorkerState.STOPPED:
                    m.pool_workers.labels(pool, state.value).set(counts[state])
