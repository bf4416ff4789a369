"""A deployment's cost profile: how long an engine step takes (per pool role), how long a KV
transfer takes (per transport), what the serving path adds (the router's per-request work, the
worker loop's per-step work), how many KV blocks a worker has and how long a worker takes to start.
No torch.

`pdserve profile` writes one, measured on this machine (pdserve/measure) or derived from a
roofline (pdserve/sim/roofline.py); `pdserve sim` and `pdserve plan` read it. The JSON keeps what
it was made from (machine, model, versions, date, every assumption), so a number in a plan can be
traced to where it came from.

A step's time is a function of what the step computes (`pdserve.costmodel.Step`: prompt tokens,
prompt attention, decode streams, decode context), in one of two forms
(pdserve/sim/step_time.py):
- `linear`: c0 + c1 * prompt tokens + c2 * prompt attention + c3 * streams + c4 * context, the
  router's cost model's form, fitted to measured steps (non-negative coefficients); on a CPU whose
  engine runs narrow steps through the stream GEMV, plus a cost per pass of that kernel over the
  weights and a step each where a GEMM takes the layers and the logits (`StreamPasses`);
- `roofline`: fixed + max(FLOPs / compute rate, bytes / bandwidth), from a hardware's peak rates at
  stated efficiencies.
"""

from __future__ import annotations

import bisect
import json
import math
import operator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.modelfiles.config import ModelConfig
from pdserve.sim.step_time import (
    LinearStep,
    ProfileError,
    RooflineStep,
    Spread,
    StepTime,
    StreamPasses,
)

FORMAT = "pdserve-profile/1"
ROLES = ("prefill", "decode", "colocated")
STEPS_FROM = ("alone", "serving")
# A loop time between two traced stream counts further apart than this is the line's: the counts
# in between ran too few steps to be kept, so nothing says the two ends' times hold across them.
MAX_LOOP_GAP = 4


@dataclass(frozen=True)
class TransferTime:
    """A KV pull of n blocks takes base_s + per_block_s * n."""

    base_s: float
    per_block_s: float
    samples: list[tuple[int, float]] = field(default_factory=list)  # (blocks, median seconds) measured

    def seconds(self, blocks: float) -> float:
        return self.base_s + self.per_block_s * blocks


@dataclass(frozen=True)
class Overhead:
    """What serving adds to the engine's steps: the router's work before a request's first step
    (HTTP, tokenization, admission, dispatch), and the worker loop's work around each step
    (sending tokens, load reports), as measured end to end against the steps a probe's server
    traced (pdserve/measure/overhead.py)."""

    request_s: float = 0.0
    step_s: float = 0.0
    stream_s: float = 0.0  # per token the step samples (each goes out in a message of its own)


@dataclass(frozen=True)
class LoopTime:
    """The worker loop's time after a step, before the next: step_s + stream_s x tokens sampled,
    or where served steps were traced (pdserve/sim/loop_fit.py) the traces' own loop time at each
    stream count they ran often (`by_streams`: (count, seconds), ascending): at a count between two
    of them at most MAX_LOOP_GAP apart, the line between those two; below the first count, past the
    last and across a wider gap, the line. A trace counts a step's decode streams, the simulation
    the tokens it samples (a prompt that finishes in the step samples one too): the same but for
    those steps."""

    step_s: float = 0.0
    stream_s: float = 0.0
    by_streams: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        try:
            table = tuple((int(n), float(s)) for n, s in self.by_streams)
            whole = all(int(n) == n for n, _ in self.by_streams)
        except (TypeError, ValueError):
            table, whole = (), False
        counts = [n for n, _ in table]
        if (
            not whole
            or counts != sorted(set(counts))
            or any(n < 1 for n in counts)
            or not all(math.isfinite(s) and s >= 0 for _, s in table)
        ):
            raise ProfileError(
                "a loop's by_streams must be [count, seconds] pairs, whole counts ascending >= 1, seconds >= 0"
            )
        object.__setattr__(self, "by_streams", table)

    def seconds(self, sampled: int) -> float:
        table = self.by_streams
        line = self.step_s + self.stream_s * sampled
        index = bisect.bisect_left(table, sampled, key=operator.itemgetter(0))
        if index == len(table) or (index == 0 and table[0][0] != sampled):
            return line  # past the last count or below the first: the line
        if table[index][0] == sampled:
            return table[index][1]
        (n0, s0), (n1, s1) = table[index - 1], table[index]
        if n1 - n0 > MAX_LOOP_GAP:
            return line
        return s0 + (s1 - s0) * (sampled - n0) / (n1 - n0)

    def to_json(self) -> dict[str, Any]:
        """Without `by_streams` where there is none: older readers read it as before."""
        body = asdict(self)
        if not self.by_streams:
            del body["by_streams"]
        return body

    def scaled(self, factor: float) -> LoopTime:
        return LoopTime(
            self.step_s * factor, self.stream_s * factor, tuple((n, s * factor) for n, s in self.by_streams)
        )


@dataclass(frozen=True)
class ServedPull:
    """How long a decode worker's loop waited on a KV pull of n blocks in serving (`pdserve profile
    --from-trace`): alone + (busy - alone) x how busy the host's other workers were, each a line in
    the blocks. It holds what a pull between idle caches leaves out: the copy beside the other
    workers' memory traffic and the router's CPU, the pull thread's hand-over of its result.
    Fitted per step (the blocks of every pull one loop waited on; mostly one) and taken per pull:
    a simulated step's two pulls at once wait a little less than their served pair did."""

    transport: str  # the transport of the traced pulls; another deployment's keeps its idle line
    alone: TransferTime
    busy: TransferTime
    samples: int = 0  # steps that waited on pulls, fitted
    # The copy's own part of the wait (each pull's own time, as TTFT's transfer part counts it),
    # alone and beside busy neighbours; None: not traced (the whole wait counts as the copy).
    copy_alone: TransferTime | None = None
    copy_busy: TransferTime | None = None

    def seconds(self, blocks: float, others_busy: float) -> float:
        return _beside(self.alone, self.busy, blocks, others_busy)

    def copy_seconds(self, blocks: float, others_busy: float) -> float:
        """The pull's own time within its wait (never more than the wait)."""
        wait = self.seconds(blocks, others_busy)
        if self.copy_alone is None or self.copy_busy is None:
            return wait
        return min(wait, _beside(self.copy_alone, self.copy_busy, blocks, others_busy))


def _beside(alone: TransferTime, busy: TransferTime, blocks: float, others_busy: float) -> float:
    at_rest = alone.seconds(blocks)
    return at_rest + (busy.seconds(blocks) - at_rest) * others_busy


@dataclass(frozen=True)
class HostCpu:
    """The CPUs of the host the workers share with the router (and, in a benchmark, the client),
    and what those two spend per request and per token (pdserve/sim/host.py)."""

    cpus: int
    router_request_s: float = 0.0
    router_token_s: float = 0.0
    client_request_s: float = 0.0
    client_token_s: float = 0.0
    router_idle: float = 0.0  # CPU-seconds a second the router spends with no request (keepers, reports)


@dataclass(frozen=True)
class Profile:
    source: str  # measured | roofline
    model: str
    model_shape: dict[str, Any]  # the model's Hugging Face config (the keys ModelConfig reads)
    block_size: int
    kv_blocks: dict[str, int]  # per pool role: a worker's KV cache, in blocks
    steps: dict[str, StepTime]  # per pool role
    transfers: dict[str, TransferTime]  # per transport
    overhead: Overhead = Overhead()
    start_s: float = 0.0  # a worker's start, from asked to ready
    # A worker's start beside a busy worker on its CPU, the host serving past its knee, from asked
    # to ready (the planner's scale-up; `pdserve profile --served`). 0: not measured.
    start_busy_s: float = 0.0
    meta: dict[str, Any] = field(default_factory=dict)  # machine, versions, date, engine settings
    assumptions: list[str] = field(default_factory=list)
    host: HostCpu | None = None  # None: the workers' CPUs (or GPUs) are theirs alone
    # Per role, the step time measured beside a busy engine on another CPU of the host (empty:
    # not measured; the steps cost the same whatever the neighbours do).
    steps_busy: dict[str, StepTime] = field(default_factory=dict)
    # What the step times are of: "alone" (one engine by itself: a sweep, or a roofline; the
    # simulation adds what the host's other processes cost it) or "serving" (a served run's own
    # steps, fitted by `pdserve profile --from-trace`: that cost is in them; the simulation adds none).
    steps_from: str = "alone"
    # Per pool role, the worker loop's time as fitted to served steps (empty: the overhead's
    # step_s and stream_s for every role). A decode worker's loop also takes its KV pulls.
    loops: dict[str, LoopTime] = field(default_factory=dict)
    # The same, of runs that left a CPU free of workers (empty: such a worker's loop is `loops`'):
    # the router and the client ran on the free CPU, not on the worker's, and a lone colocated
    # worker's loop took 0.44-0.46 ms a step at one stream and 0.51-0.54 at two on the AVX512 EPYC
    # (decode-only steps), where colocated 2's and 1P+1D's took 0.62-0.94 at one stream and
    # 0.82-1.34 at two at the same load.
    free_loops: dict[str, LoopTime] = field(default_factory=dict)
    # Per pool role that pulls KV, its pulls' wait as fitted to served steps (empty: the transfer's
    # time between idle caches, slowed by the worker's CPU-mates).
    pulls: dict[str, ServedPull] = field(default_factory=dict)

    def served_pull(self, role: str, transport: str) -> ServedPull | None:
        """The role's served pull wait over `transport`, if the profile was fitted to one."""
        pull = self.pulls.get(role) or (self.pulls.get("decode") if role == "colocated" else None)
        return pull if pull is not None and pull.transport == transport else None

    def loop_time(self, role: str, free_cpu: bool = False) -> LoopTime:
        """The role's worker loop; `free_cpu`: on a host with a CPU no worker is on (`free_loops`
        where known). A colocated role without a loop of its own takes the decode pool's (as
        step_time: a mixed worker is a decode one), its own filled runs' before another's free."""
        kinds = (self.free_loops, self.loops) if free_cpu else (self.loops,)
        for name in (role, "decode") if role == "colocated" else (role,):
            for loops in kinds:
                if name in loops:
                    return loops[name]
        return LoopTime(self.overhead.step_s, self.overhead.stream_s)

    def model_config(self) -> ModelConfig:
        return ModelConfig.from_hf_dict(self.model_shape)

    def step_time(self, role: str) -> StepTime:
        if role in self.steps:
            return self.steps[role]
        if role == "colocated" and "decode" in self.steps:  # a mixed worker steps like a decode one
            return self.steps["decode"]
        raise ProfileError(f"the profile has no step time for the {role} role (it has {sorted(self.steps)})")

    def busy_step_time(self, role: str) -> StepTime | None:
        """The role's step time beside busy neighbours, if measured."""
        if role in self.steps_busy:
            return self.steps_busy[role]
        return self.steps_busy.get("decode") if role == "colocated" else None

    def transfer(self, transport: str) -> TransferTime:
        if transport not in self.transfers:
            raise ProfileError(
                f"the profile has no transfer time for --transport {transport} (it has {sorted(self.transfers)})"
            )
        return self.transfers[transport]

    def blocks(self, role: str) -> int:
        if role in self.kv_blocks:
            return self.kv_blocks[role]
        if self.kv_blocks:
            return min(self.kv_blocks.values())
        raise ProfileError("the profile says nothing of the workers' KV cache (kv_blocks)")

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "source": self.source,
            "model": self.model,
            "meta": self.meta,
            "assumptions": self.assumptions,
            "model_shape": self.model_shape,
            "block_size": self.block_size,
            "kv_blocks": self.kv_blocks,
            "start_s": self.start_s,
            "start_busy_s": self.start_busy_s,
            "overhead": asdict(self.overhead),
            "steps": {role: step.to_json() for role, step in self.steps.items()},
            "transfers": {name: asdict(t) for name, t in self.transfers.items()},
            "host": asdict(self.host) if self.host is not None else None,
            "steps_busy": {role: step.to_json() for role, step in self.steps_busy.items()},
            "steps_from": self.steps_from,
            "loops": {role: loop.to_json() for role, loop in self.loops.items()},
            "pulls": {role: asdict(pull) for role, pull in self.pulls.items()},
        } | (  # only where known: older readers read the rest as before
            {"free_loops": {role: loop.to_json() for role, loop in self.free_loops.items()}}
            if self.free_loops
            else {}
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


def _transfer(body: dict[str, Any], where: str) -> TransferTime:
    base, per_block = float(body["base_s"]), float(body["per_block_s"])
    if not all(math.isfinite(x) and x >= 0 for x in (base, per_block)):
        raise ProfileError(f"{where}: base_s and per_block_s must be finite numbers >= 0")
    return TransferTime(base, per_block, [tuple(x) for x in body.get("samples", [])])


def _served_pull(role: str, body: dict[str, Any]) -> ServedPull:
    where = f"pulls.{role}"
    copy = [
        _transfer(body[k], f"{where}.{k}") if body.get(k) is not None else None
        for k in ("copy_alone", "copy_busy")
    ]
    return ServedPull(
        str(body["transport"]),
        _transfer(body["alone"], f"{where}.alone"),
        _transfer(body["busy"], f"{where}.busy"),
        int(body.get("samples", 0)),
        *copy,
    )


def _listed(role: str, fields: dict[str, Any], key: str) -> list[Any]:
    spread = fields.pop(key, [])
    if not isinstance(spread, list):
        raise ProfileError(f"steps.{role}.{key} must be a list of bands")
    return spread


def _bands(role: str, fields: dict[str, Any], key: str) -> tuple[Spread, ...]:
    return tuple(_spread_band(role, i, band, key) for i, band in enumerate(_listed(role, fields, key)))


def _spread_band(role: str, index: int, band: Any, key: str) -> Spread:
    shape = f'steps.{role}.{key}[{index}] must be {{"below_s": seconds or null, "quantiles": [ratios]}}'
    if not isinstance(band, dict) or set(band) != {"below_s", "quantiles"}:
        raise ProfileError(shape)
    end, quantiles = band["below_s"], band["quantiles"]
    if not isinstance(quantiles, list) or not (end is None or isinstance(end, int | float)):
        raise ProfileError(shape)
    try:
        return Spread(None if end is None else float(end), tuple(float(q) for q in quantiles))
    except (TypeError, ValueError):
        raise ProfileError(shape) from None


def _mixed_spread(role: str, ratios: Any, key: str = "mixed_spread") -> tuple[float, ...]:
    if not isinstance(ratios, list) or not all(
        isinstance(r, int | float) and not isinstance(r, bool) for r in ratios
    ):
        raise ProfileError(f"steps.{role}.{key} must be a list of ratios (measured / fitted)")
    return tuple(float(r) for r in ratios)


def _loop(where: str, body: Any) -> LoopTime:
    keys = {"step_s", "stream_s", "by_streams"}
    if not isinstance(body, dict) or not set(body) <= keys:
        raise ProfileError(f"{where} must be an object of {sorted(keys)}, got {body!r}")
    return LoopTime(
        float(body.get("step_s", 0.0)), float(body.get("stream_s", 0.0)), tuple(body.get("by_streams", ()))
    )


def _step_from_json(role: str, body: Any) -> StepTime:
    if not isinstance(body, dict):
        raise ProfileError(f"steps.{role} must be an object")
    kind = body.get("kind")
    fields = {k: v for k, v in body.items() if k != "kind"}
    try:
        if kind == "linear":
            coefficients = tuple(float(c) for c in fields.pop("coefficients"))
            if len(coefficients) != 5 or not all(math.isfinite(c) and c >= 0 for c in coefficients):
                raise ProfileError(f"steps.{role}.coefficients must be 5 finite numbers >= 0")
            try:
                spread, free = _bands(role, fields, "spread"), _bands(role, fields, "free_spread")
                mixed = _mixed_spread(role, fields.pop("mixed_spread", []))
                free_mixed = _mixed_spread(role, fields.pop("free_mixed_spread", []), "free_mixed_spread")
                passes, kernel = fields.pop("passes", None), fields.pop("pass_coefficients", None)
                if passes is not None:
                    if kernel is None:
                        raise ProfileError("passes without pass_coefficients")
                    fields["passes"] = StreamPasses.from_json(passes, "passes")
                    fields["pass_coefficients"] = tuple(float(c) for c in kernel)
                elif kernel is not None:
                    raise ProfileError("pass_coefficients without passes")
                return LinearStep(
                    coefficients,
                    spread=spread,
                    mixed_spread=mixed,
                    free_spread=free,
                    free_mixed_spread=free_mixed,
                    **fields,
                )
            except ProfileError as exc:
                raise ProfileError(f"steps.{role}: {exc}") from None
        if kind == "roofline":
            return RooflineStep(**{k: float(v) for k, v in fields.items()})
    except (KeyError, TypeError, ValueError) as exc:
        raise ProfileError(f"steps.{role}: {exc}") from None
    raise ProfileError(f"steps.{role}.kind must be linear or roofline, got {kind!r}")


def load(path: Path) -> Profile:
    """Reads a profile; raises ProfileError with what is wrong."""
    try:
        body = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ProfileError(f"cannot read the profile {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"the profile {path} is not JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise ProfileError(f'{path} is not a pdserve profile (no "format": "{FORMAT}")')
    try:
        steps = {role: _step_from_json(role, s) for role, s in body["steps"].items()}
        transfers = {name: _transfer(t, f"transfers.{name}") for name, t in body.get("transfers", {}).items()}
        profile = Profile(
            source=str(body["source"]),
            model=str(body["model"]),
            model_shape=dict(body["model_shape"]),
            block_size=int(body["block_size"]),
            kv_blocks={str(k): int(v) for k, v in body["kv_blocks"].items()},
            steps=steps,
            transfers=transfers,
            overhead=Overhead(**body.get("overhead", {})),
            start_s=float(body.get("start_s", 0.0)),
            start_busy_s=float(body.get("start_busy_s", 0.0)),
            meta=dict(body.get("meta", {})),
            assumptions=list(body.get("assumptions", [])),
            host=HostCpu(**body["host"]) if body.get("host") else None,
            steps_busy={role: _step_from_json(role, s) for role, s in body.get("steps_busy", {}).items()},
            steps_from=str(body.get("steps_from", "alone")),
            loops={str(role): _loop(f"loops.{role}", loop) for role, loop in body.get("loops", {}).items()},
            free_loops={
                str(role): _loop(f"free_loops.{role}", loop)
                for role, loop in body.get("free_loops", {}).items()
            },
            pulls={str(role): _served_pull(str(role), pull) for role, pull in body.get("pulls", {}).items()},
        )
        for name in ("start_s", "start_busy_s"):
            if not (math.isfinite(getattr(profile, name)) and getattr(profile, name) >= 0):
                raise ProfileError(
                    f"{name} must be a finite number of seconds >= 0, got {getattr(profile, name)!r}"
                )
        if profile.steps_from not in STEPS_FROM:
            raise ProfileError(
                f"steps_from must be one of {', '.join(STEPS_FROM)}, got {profile.steps_from!r}"
            )
        profile.model_config()  # a shape the engine cannot take fails here
    except ProfileError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise ProfileError(
            f"the profile {path} is incomplete or malformed: {type(exc).__name__}: {exc}"
        ) from None
    if not steps:
        raise ProfileError(f"the profile {path} has no step times")
    return profile
