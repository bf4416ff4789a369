"""The planner's loop: every `interval_s`, the pools' views from the signals, the control law's
decisions (pdserve.planner.law), and the pool manager told the new targets. No torch.

Every decision is logged with its reason and inputs and counted
(`pdserve_planner_decisions_total{pool,direction,reason}`); each pool's wanted size and the
predicted and observed SLO percentiles are gauges; the last decisions are in GET /pools.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from pdserve import clock
from pdserve.costmodel import Step, chunk_attention
from pdserve.planner.law import DECODE_PHASE, Decision, LawMemory, LawSettings, PoolPlan, PoolView, decide
from pdserve.router.metrics import RouterMetrics
from pdserve.router.workers import WorkerSet, WorkerState, WorkerView
from pdserve.signals import Signals
from pdserve.slo import SLO, ms_text, quantile

logger = logging.getLogger(__name__)

MODES = ("off", "slo")


class PoolTargets(Protocol):
    """What the planner needs of the pool manager."""

    def targets(self) -> dict[str, tuple[int, int, int]]:
        """pool -> (target, min, max)."""
        ...

    def set_planned_target(self, pool: str, replicas: int, reason: str) -> None: ...


@dataclass(frozen=True)
class PlannerSettings:
    mode: str = "off"
    slo: SLO = field(default_factory=SLO)
    pool_slos: Mapping[str, SLO] = field(default_factory=dict)  # [pools.X] overrides
    interval_s: float = 5.0
    max_workers: int = 2
    stale_after_s: float = 3.0  # a worker's load report older than this: hold
    law: LawSettings = field(default_factory=LawSettings)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"planner must be one of {MODES}, got {self.mode!r}")
        if self.interval_s <= 0:
            raise ValueError(f"planner interval must be > 0, got {self.interval_s}")
        if self.max_workers < 1:
            raise ValueError(f"max workers must be >= 1, got {self.max_workers}")

    def pool_slo(self, pool: str) -> SLO:
        return self.pool_slos.get(pool, self.slo)


@dataclass(frozen=True)
class DecisionRecord:
    at: float  # time.time()
    decision: Decision

    def describe(self) -> dict[str, Any]:
        d = self.decision
        return {
            "at": self.at,
            "pool": d.pool,
            "from": d.old,
            "to": d.new,
            "direction": d.direction,
            "reason": d.reason,
            "detail": d.detail,
        }


class Planner:
    def __init__(
        self,
        settings: PlannerSettings,
        signals: Signals,
        workers: WorkerSet,
        pools: PoolTargets,
        metrics: RouterMetrics,
    ) -> None:
        self.settings = settings
        self.signals = signals
        self.workers = workers
        self.pools = pools
        self.metrics = metrics
        self.memory = LawMemory()
        self.plans: dict[str, PoolPlan] = {}
        self.views: dict[str, PoolView] = {}
        self.history: deque[DecisionRecord] = deque(maxlen=50)
        self._planned: dict[str, int] = {}  # each pool's target as the planner last left it
        self._late: set[str] = set()  # workers whose load reports are late (logged once)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if self.settings.mode == "slo" and self._task is None:
            self._task = asyncio.create_task(self._run(), name="planner")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.settings.interval_s)
            try:
                self.step(clock.monotonic())
            except Exception:  # a bug in one decision must not end planning for good
                logger.exception("planner: a decision failed")

    # -- one decision ---------------------------------------------------------------------------------
    def step(self, now: float) -> list[Decision]:
        targets = self.pools.targets()
        for name, (target, _, _) in targets.items():
            if name in self._planned and self._planned[name] != target:
                # Someone else changed it (PUT /pools, a drain): a change like the planner's own,
                # so the cooldown and the scale-down window start again from here.
                self.memory.last_change[name] = now
                self.memory.down_since.pop(name, None)
            self._planned[name] = target
        self.views = {name: self._view(name, t, now) for name, t in targets.items()}
        decisions, self.plans = decide(
            self.views, self.settings.max_workers, self.memory, now, self.settings.law
        )
        for d in decisions:
            view = self.views[d.pool]
            logger.info(
                "planner: pool %s %d -> %d (%s: %s) [prompts %.2f/s, service %s, ttft %s, wait %s, streams %d, "
                "per worker %s, itl %s]",
                d.pool,
                d.old,
                d.new,
                d.reason,
                d.detail,
                view.request_rate,
                ms_text(view.service_s),
                ms_text(view.observed_ttft),
                ms_text(view.observed_wait),
                view.streams,
                view.stream_capacity,
                ms_text(view.observed_itl),
            )
            self.pools.set_planned_target(d.pool, d.new, f"planner: {d.reason}")
            self._planned[d.pool] = self.pools.targets()[d.pool][0]
            self.metrics.planner_decisions.labels(d.pool, d.direction, d.reason).inc()
            self.history.append(DecisionRecord(time.time(), d))
        for name, plan in self.plans.items():
            self._gauges(name, plan, self.views[name])
        return decisions

    def _gauges(self, name: str, plan: PoolPlan, view: PoolView) -> None:
        m = self.metrics
        m.planner_target.labels(name).set(plan.desired)
        for metric, predicted, observed in (
            ("ttft", plan.predicted_ttft, view.observed_ttft),
            ("itl", plan.predicted_itl, view.observed_itl),
        ):
            for gauge, value in ((m.planner_predicted, predicted), (m.planner_observed, observed)):
                if value is not None:
                    gauge.labels(name, metric).set(value)
                else:  # nothing to say now: no stale last value on a dashboard
                    with contextlib.suppress(KeyError):
                        gauge.remove(name, metric)

    def _view(self, name: str, bounds: tuple[int, int, int], now: float) -> PoolView:
        target, low, high = bounds
        views = [w for w in self.workers.views(name) if w.state is not WorkerState.STOPPED]
        up = [w for w in views if w.up]
        starting = [w for w in views if w.state is WorkerState.STARTING]
        draining = [w for w in views if w.state is WorkerState.DRAINING]
        # Supply not up yet: starting, or to be started (a failed start waits out its pause).
        pending = max(len(starting), target - len(up))
        fresh = self._fresh(up, now)
        slo = self.settings.pool_slo(name)
        p = slo.percentile
        span = max(10.0, 2 * self.settings.interval_s)  # demand: recent, so a step shows at once
        # Observed percentiles: the recent window, but nothing from before the pool last changed or
        # a worker of it came up (what it observed then is what the change answered).
        react = max(15.0, 3 * self.settings.interval_s)
        changed = max(
            [self.memory.last_change.get(name, -math.inf)] + [w.up_at for w in up if w.up_at is not None]
        )
        react = max(self.settings.interval_s, min(react, now - changed))
        sig = self.signals.pool(name)
        cost = self.signals.cost
        contexts = [w.context_per_stream() for w in up if w.load is not None and w.load.num_running]
        context = sum(contexts) / len(contexts) if contexts else 256.0
        capacity: int | None = None
        predicted_itl: float | None = None
        if DECODE_PHASE[name] and up:
            limit = min(w.max_num_seqs for w in up)
            kv_tokens = [
                w.load.kv_blocks_total * w.load.block_size for w in up if w.load and w.load.block_size
            ]
            if kv_tokens:
                limit = min(limit, int(0.9 * min(kv_tokens) / max(context, 1.0)))
            if cost.ready:
                capacity = cost.max_streams_within(slo.itl_s, context, limit) if slo.itl_s else limit
                per_worker = math.ceil(sig.streams / len(up)) if sig.streams else 0
                predicted_itl = cost.decode_step_seconds(per_worker, context) if per_worker else None
        ttfts, waits = sig.ttft_samples(now, react)  # with the prompts still waiting, at their age
        services = sig.service.values(now, span) or sig.service.values(now)
        mean = sum(services) / len(services) if services else None
        cv2 = 1.0
        if mean and len(services) >= 5:
            cv2 = min(4.0, sum((x - mean) ** 2 for x in services) / len(services) / mean**2)
        return PoolView(
            name=name,
            target=target,
            up=len(up),
            starting=pending,
            draining=len(draining),
            min=low,
            max=high,
            fresh=fresh,
            slo=slo,
            request_rate=sig.prompts.count_rate(now, span),
            service_s=mean,
            service_cv2=cv2,
            observed_ttft=_quantile(ttfts, p),
            observed_wait=_quantile(waits, p),
            streams=sig.streams,
            stream_capacity=capacity,
            observed_itl=_quantile(sig.itl.values(now, react), p),
            predicted_itl=predicted_itl,
            model_ready=cost.ready,
        )

    def _fresh(self, up: list[WorkerView], now: float) -> bool:
        """Every worker that is up reported recently; a change either way is logged (a pool held
        for late reports is otherwise silent)."""
        fresh = True
        for link in up:
            silent, limit = now - link.load_at, self._stale_after(link)
            late = silent > limit
            fresh = fresh and not late
            if late and link.worker_id not in self._late:
                logger.info(
                    "planner: holding pool %s: worker %s's last load report is %.1f s old (> %.1f s)",
                    link.pool, link.worker_id, silent, limit,
                )  # fmt: skip
                self._late.add(link.worker_id)
            elif not late and link.worker_id in self._late:
                logger.info("planner: worker %s reports again", link.worker_id)
                self._late.discard(link.worker_id)
        return fresh

    def _stale_after(self, link: WorkerView) -> float:
        """A worker reports between steps: one in a long step is busy, not stale. How long its
        step may take: its longest recent step, or (with prompts queued on it) the cost model's
        time for a full chunk of them with its streams, whichever is longer."""
        step = link.longest_recent_step_s
        cost = self.signals.cost
        queued = max(link.queued_prompt_tokens, link.load.queued_prompt_tokens if link.load else 0)
        if queued and cost.ready and link.ready is not None:
            budget = link.ready.max_num_batched_tokens or link.ready.chunk_size or queued
            tokens = min(queued, budget)
            streams = link.load.num_running if link.load else 0
            context = round(streams * link.context_per_stream())
            chunk = Step(tokens, chunk_attention(0, tokens), streams, context)
            step = max(step, cost.step_seconds(chunk))
        return max(self.settings.stale_after_s, 2 * step + 1.0)

    # -- what others ask ----------------------------------------------------------------------------------
    def at_bounds(self) -> bool:
        """No pool can grow: each is at its max, or the worker budget is spent (always, when off)."""
        if self.settings.mode == "off":
            return True
        targets = self.pools.targets()
        if sum(t for t, _, _ in targets.values()) >= self.settings.max_workers:
            return True
        return all(t >= high for t, _, high in targets.values())

    def describe(self) -> dict[str, Any]:
        pools = {}
        for name, plan in self.plans.items():
            view = self.views.get(name)
            pools[name] = {
                "desired": plan.desired,
                "predicted": {"ttft_s": plan.predicted_ttft, "itl_s": plan.predicted_itl},
                "observed": {
                    "ttft_s": view.observed_ttft if view else None,
                    "itl_s": view.observed_itl if view else None,
                },
                "reason": plan.reason,
                "stale": not view.fresh if view else False,
            }
        return {
            "mode": self.settings.mode,
            "interval_s": self.settings.interval_s,
            "max_workers": self.settings.max_workers,
            "slo": self.settings.slo.describe(),
            "pool_slos": {name: slo.describe() for name, slo in self.settings.pool_slos.items()},
            "pools": pools,
            "decisions": [r.describe() for r in reversed(self.history)],
        }


MIN_SAMPLES = 5  # an observed percentile of fewer samples is their max: not a breach yet


def _quantile(values: list[float], p: float) -> float | None:
    return quantile(values, p) if len(values) >= MIN_SAMPLES else None
