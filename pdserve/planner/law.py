"""The planner's control law: each pool's target from its own phase's pressure. Pure: no I/O, no
clock of its own (`now` is given), no torch; tests drive it with scripted views.

Per pool, every interval:

1. **Predictive.** Demand over capacity at the SLO, from the cost model. Prefill (and the prefill
   half of a colocated pool): prompts admitted per second, each with its own prefill time; the
   fewest workers whose queueing wait at the SLO percentile (M/M/1 per worker,
   `costmodel.pool_wait_quantile`) fits in what the TTFT SLO leaves after a typical prompt's own
   prefill. Decode: streams admitted and not ended, over the streams one worker decodes with a step
   within the ITL SLO (and within its KV cache).
2. **Reactive.** When the observed percentile breaks the SLO (prefill: the wait part of TTFT, which
   workers can shorten; decode: ITL) and no worker of the pool is starting, one more.
3. **Timing.** Up at once (pending workers count as supply, so a start is not asked for twice);
   down only after the pool has wanted fewer (with `down_headroom` of spare demand) for
   `downscale_window_s` without a break, one worker at a time, and never within `cooldown_s` of the
   pool's last change. Stale signals (a worker of the pool without a fresh load report): hold.
4. **Budget.** The pools share `max_workers`. When it is full and one pool needs a worker, a pool
   with slack (it would scale down, ignoring the window) gives one: a move.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from pdserve.costmodel import pool_wait_quantile, workers_for_wait
from pdserve.slo import SLO

PREFILL_PHASE = {"prefill": True, "decode": False, "colocated": True}
DECODE_PHASE = {"prefill": False, "decode": True, "colocated": True}


@dataclass(frozen=True)
class LawSettings:
    cooldown_s: float = 10.0  # no change to a pool sooner than this after its last one
    downscale_window_s: float = 30.0  # wanting fewer this long, without a break, before a scale-down
    down_headroom: float = 0.25  # scale down only if the pool would still have this spare demand
    max_utilisation: float = 0.85  # of a worker, in the predictive target (queues grow without bound at 1)
    default_utilisation: float = 0.7  # prefill target without a TTFT SLO


@dataclass(frozen=True)
class PoolView:
    """What the planner knows of one pool at a decision (built by the loop from the signals)."""

    name: str  # prefill | decode | colocated
    target: int  # the pool's current target (workers starting count: pending supply)
    up: int
    starting: int  # pending supply: starting, or to be started (after a failed start's pause)
    min: int
    max: int
    fresh: bool  # every worker that is up sent a load report recently
    slo: SLO
    draining: int = 0  # still running while they hand over: they count against the budget
    request_rate: float = 0.0  # prompts admitted to this pool's prefill, per second
    service_s: float | None = None  # their mean own prefill time (cost model)
    service_cv2: float = 1.0  # its squared coefficient of variation (queueing: 1 = exponential)
    observed_ttft: float | None = None  # at the SLO percentile, over the window
    observed_wait: float | None = None  # TTFT - own prefill time, at the SLO percentile
    streams: int = 0  # streams admitted to this pool, not ended
    stream_capacity: int | None = None  # streams one worker decodes within the ITL SLO and its KV
    observed_itl: float | None = None
    predicted_itl: float | None = None  # the step time at the current streams per worker
    model_ready: bool = False


@dataclass(frozen=True)
class Decision:
    pool: str
    old: int
    new: int
    reason: str  # predictive | reactive | move | idle
    detail: str

    @property
    def direction(self) -> str:
        return "up" if self.new > self.old else "down"


@dataclass(frozen=True)
class PoolPlan:
    """The planner's view of a pool after a decision (GET /pools, metrics)."""

    desired: int
    predicted_ttft: float | None
    predicted_itl: float | None
    reason: str


@dataclass
class LawMemory:
    last_change: dict[str, float] = field(default_factory=dict)
    down_since: dict[str, float] = field(default_factory=dict)


def wait_budget(slo: SLO, service_s: float) -> float | None:
    """What the TTFT SLO leaves for waiting after a typical prompt's own prefill; at least a fifth
    of the SLO (a pool can always be asked to keep its queue short), and at least half the prompt's
    own time (prompts that miss the SLO by themselves are not chased with workers that cannot help)."""
    if slo.ttft_s is None:
        return None
    return max(0.2 * slo.ttft_s, slo.ttft_s - service_s, 0.5 * service_s)


def needed_workers(view: PoolView, settings: LawSettings, demand_scale: float = 1.0) -> tuple[int, str]:
    """(workers the pool needs for its demand, why), before bounds and timing."""
    parts: list[str] = []
    load = 0.0  # colocated: the two phases' shares of a worker add up
    need = 0
    if PREFILL_PHASE[view.name] and view.request_rate > 0 and view.service_s:
        rate = view.request_rate * demand_scale
        budget = wait_budget(view.slo, view.service_s)
        if budget is None:
            k_prefill = math.ceil(rate * view.service_s / settings.default_utilisation)
            load += rate * view.service_s / settings.default_utilisation
        else:
            k_prefill = workers_for_wait(
                rate, view.service_s, view.slo.percentile, budget, settings.max_utilisation, view.service_cv2
            )
            load += k_prefill
        need = max(need, k_prefill)
        parts.append(f"{rate:.2f} prompts/s x {view.service_s * 1000:.0f} ms -> {k_prefill}")
    if DECODE_PHASE[view.name] and view.streams > 0:
        capacity = view.stream_capacity or 0
        streams = view.streams * demand_scale
        if capacity > 0:
            k_decode = math.ceil(streams / capacity)
            load += streams / capacity
            parts.append(f"{streams:.0f} streams / {capacity} per worker -> {k_decode}")
        else:
            k_decode = view.target  # capacity unknown (no model yet): no predictive change
            parts.append(f"{streams:.0f} streams, capacity unknown")
        need = max(need, k_decode)
    if view.name == "colocated":
        need = max(need, math.ceil(load - 1e-9))
    return need, "; ".join(parts) or "no demand"


def decide(
    views: Mapping[str, PoolView],
    max_workers: int,
    memory: LawMemory,
    now: float,
    settings: LawSettings | None = None,
) -> tuple[list[Decision], dict[str, PoolPlan]]:
    """The changes to make now, and each pool's plan."""
    settings = settings or LawSettings()
    wanted: dict[str, tuple[int, str, str]] = {}  # pool -> (new target, reason, detail)
    slack: dict[str, bool] = {}
    plans: dict[str, PoolPlan] = {}
    for name, view in views.items():
        new, reason, detail, has_slack = _one_pool(view, memory, now, settings)
        wanted[name] = (new, reason, detail)
        slack[name] = has_slack
        plans[name] = PoolPlan(new, _predicted_ttft(view), view.predicted_itl, f"{reason}: {detail}")

    decisions: list[Decision] = []
    # Scale-downs first: they free budget for what needs it.
    for name in sorted(wanted, key=lambda n: wanted[n][0] - views[n].target):
        view = views[name]
        new, reason, detail = wanted[name]
        if new == view.target:
            continue
        if new < view.target:
            decisions.append(Decision(name, view.target, new, reason, detail))
            continue
        in_use = (
            sum(d.new for d in decisions)
            + sum(views[n].target for n in views if n not in {d.pool for d in decisions})
            + sum(v.draining for v in views.values())
        )
        room = max_workers - in_use
        grant = min(new - view.target, room)
        if grant <= 0:
            donor = _donor(views, slack, decisions, memory, now, settings, exclude=name)
            if donor is None:
                plans[name] = PoolPlan(
                    view.target, plans[name].predicted_ttft, view.predicted_itl, f"budget full: {detail}"
                )
                continue
            donor_view = views[donor]
            decisions.append(
                Decision(donor, donor_view.target, donor_view.target - 1, "move", f"a worker to {name}")
            )
            grant = 1
            reason = "move"
            detail = f"from {donor}: {detail}"
        decisions.append(Decision(name, view.target, view.target + grant, reason, detail))
    for d in decisions:
        memory.last_change[d.pool] = now
        memory.down_since.pop(d.pool, None)
        plans[d.pool] = PoolPlan(
            d.new, plans[d.pool].predicted_ttft, views[d.pool].predicted_itl, plans[d.pool].reason
        )
    return decisions, plans


def _one_pool(
    view: PoolView, memory: LawMemory, now: float, settings: LawSettings
) -> tuple[int, str, str, bool]:
    """(the target this pool wants now, reason, detail, whether it has a worker to spare)."""
    target = view.target
    if not view.fresh:
        memory.down_since.pop(view.name, None)
        return target, "stale", "a worker's load reports are late: holding", False
    cooling = now - memory.last_change.get(view.name, -math.inf) < settings.cooldown_s
    idle = view.request_rate == 0 and view.streams == 0
    # A stream pool keeps a worker: with none up, requests get 503 before their demand is seen.
    floor = max(view.min, 1) if DECODE_PHASE[view.name] else view.min
    if idle:
        need, detail = floor, "no demand"
    elif view.model_ready:
        need, detail = needed_workers(view, settings)
    else:
        need, detail = target, "cost model not ready"
    need = min(max(need, view.min), view.max)
    reason = "idle" if idle else "predictive"

    breach = _breach(view)
    if breach and view.starting == 0 and need <= target and target < view.max:
        need, reason, detail = target + 1, "reactive", breach
    if need > target:
        memory.down_since.pop(view.name, None)
        if cooling and reason != "reactive":
            return target, "cooldown", detail, False
        return need, reason, detail, False

    # Down: only with headroom, after the window, one at a time.
    if idle:
        roomy = min(floor, view.max)
    elif view.model_ready:
        roomy = min(max(needed_workers(view, settings, 1 + settings.down_headroom)[0], view.min), view.max)
    else:
        roomy = target
    has_slack = roomy < target and not breach and view.starting == 0
    if not has_slack:
        memory.down_since.pop(view.name, None)
        return target, "hold", detail, False
    since = memory.down_since.setdefault(view.name, now)
    if now - since < settings.downscale_window_s or cooling:
        return target, "stabilising", f"{detail} (wants {roomy} for {now - since:.0f} s)", True
    return target - 1, reason, detail, True


def _breach(view: PoolView) -> str | None:
    """Why the observed percentile breaks the SLO in a way more workers can fix, or None.

    Prefill: TTFT above the SLO and its wait part above the wait budget (a prompt slow by itself
    is not a breach); before the cost model can split TTFT (no prompt's own time yet), TTFT alone."""
    slo = view.slo
    ttft = view.observed_ttft
    if PREFILL_PHASE[view.name] and slo.ttft_s is not None and ttft is not None and ttft > slo.ttft_s:
        p = f"p{slo.percentile * 100:.0f}"
        if view.observed_wait is None or view.service_s is None:
            return f"TTFT {p} {ttft * 1000:.0f} ms > SLO {slo.ttft_s * 1000:.0f} ms (no cost model yet)"
        budget = wait_budget(slo, view.service_s)
        if budget is not None and view.observed_wait > budget:
            return (
                f"TTFT {p} {ttft * 1000:.0f} ms > SLO {slo.ttft_s * 1000:.0f} ms "
                f"(wait {view.observed_wait * 1000:.0f} ms > {budget * 1000:.0f} ms)"
            )
    itl = view.observed_itl
    if DECODE_PHASE[view.name] and slo.itl_s is not None and itl is not None and itl > slo.itl_s:
        return f"ITL p{slo.percentile * 100:.0f} {itl * 1000:.0f} ms > SLO {slo.itl_s * 1000:.0f} ms"
    return None


def _predicted_ttft(view: PoolView) -> float | None:
    if not PREFILL_PHASE[view.name] or not view.service_s:
        return None
    wait = pool_wait_quantile(
        view.request_rate, view.service_s, max(view.target, 0), view.slo.percentile, view.service_cv2
    )
    return view.service_s + wait if math.isfinite(wait) else None


def _donor(
    views: Mapping[str, PoolView],
    slack: Mapping[str, bool],
    decisions: list[Decision],
    memory: LawMemory,
    now: float,
    settings: LawSettings,
    exclude: str,
) -> str | None:
    """A pool that can give a worker now: it has slack, is above its min, and is not cooling down."""
    changed = {d.pool for d in decisions}
    for name, view in views.items():
        if name == exclude or name in changed or not slack.get(name):
            continue
        if view.target - 1 < view.min:
            continue
        if now - memory.last_change.get(name, -math.inf) < settings.cooldown_s:
            continue
        return name
    return None
