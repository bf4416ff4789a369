"""How long an engine step takes, as a profile holds it (pdserve/sim/profile.py): `linear`, fitted
to measured steps (with how they spread around the fit, the stream GEMV's passes on a CPU, and the
scales a speed check or a served trace sets), or `roofline`, from a hardware's peak rates. No torch.

A step's time is a function of what the step computes (`pdserve.costmodel.Step`: prompt tokens,
prompt attention, decode streams, decode context).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from pdserve import slo
from pdserve.costmodel import Step, fit_step_time
from pdserve.errors import PdserveError


class ProfileError(PdserveError):
    """A profile file that cannot be read, or lacks what the simulation needs."""


@dataclass(frozen=True)
class Spread:
    """How measured steps spread around their fit: measured / fitted seconds at the quantiles
    (i + 0.5) / len, for the steps the fit put below `below_s` seconds (None: every longer one)
    and at or above the band before's."""

    below_s: float | None
    quantiles: tuple[float, ...]

    def __post_init__(self) -> None:
        ratios = self.quantiles
        if (
            not ratios
            or any(not (math.isfinite(r) and r > 0) for r in ratios)
            or list(ratios) != sorted(ratios)
        ):
            raise ProfileError("a step time's spread must be ascending ratios > 0")


@dataclass(frozen=True)
class StreamPasses:
    """How the CPU engine's linear layers run a step of prompt tokens + decode streams rows
    (pdserve/ops/cpu/linear.py): up to `stream_rows` rows by the stream GEMV, which computes
    `rows_per_pass` rows at a time over each tile of the weights it reads (cpu_gemv*.cpp's
    kMaxRows); wider steps by a GEMM. The logits (a row per decode stream) take the stream GEMV
    up to `logits_rows` streams. So a decode step's time is not one line in its streams: it climbs
    by a pass's arithmetic every `rows_per_pass` streams and jumps where a GEMM takes over, the
    layers' past `stream_rows` rows and the logits' past `logits_rows` streams. An AVX2-only
    EPYC's served decode steps (fp32, 4 rows a pass, the GEMV up to 32 rows, the logits' too):
    22-31 ms at 1-4 streams, 43-54 at 5-8, 67-88 at 9-12, 208 at 32, 298 at 35; a 31-token prompt
    124-172 ms, 37 tokens beside one stream 167 (its logits still on the GEMV)."""

    rows_per_pass: int
    stream_rows: int
    logits_rows: int

    def __post_init__(self) -> None:
        if self.rows_per_pass < 1 or self.stream_rows < 1 or self.logits_rows < 0:
            raise ProfileError("stream_passes needs rows_per_pass >= 1, stream_rows >= 1, logits_rows >= 0")

    def features(self, step: Step) -> tuple[int, int, int]:
        """(the stream GEMV's passes over the weights past the first: every step makes one, or a
        GEMM instead, and the line's base holds it; 1 if a GEMM runs the layers; 1 if one runs
        the logits: more decode streams than the logits' stream GEMV takes)."""
        rows = step.prefill_tokens + step.decode_streams
        logits = 1 if step.decode_streams > self.logits_rows else 0
        if rows > self.stream_rows:
            return 0, 1, logits
        return max(0, -(-rows // self.rows_per_pass) - 1), 0, logits

    def line(self, step: Step) -> tuple[float, float, float, float, float]:
        """The line's features under the GEMV: (1, rows on the GEMM, prompt attention, streams,
        context). A row's share of the layers is the GEMV's passes up to `stream_rows` rows and
        the GEMM's cost a row past them, a prompt token's or a stream's alike; so c1 is per row
        on the GEMM, not per prompt token (one would count a narrow step's prompt rows twice)."""
        rows = step.prefill_tokens + step.decode_streams
        on_gemm = rows if rows > self.stream_rows else 0
        return (1.0, on_gemm, step.prefill_attention, step.decode_streams, step.decode_context)

    def on_stream(self, step: Step) -> bool:
        """Whether the stream GEMV runs the step's layers."""
        return 0 < step.prefill_tokens + step.decode_streams <= self.stream_rows

    def to_json(self) -> dict[str, int]:
        return asdict(self)

    @classmethod
    def from_json(cls, body: Any, where: str) -> StreamPasses:
        keys = {"rows_per_pass", "stream_rows", "logits_rows"}
        shape = f'{where} must be {{"rows_per_pass": n, "stream_rows": n, "logits_rows": n}}'
        if not isinstance(body, dict) or set(body) != keys:
            raise ProfileError(shape)
        if not all(isinstance(body[k], int) and not isinstance(body[k], bool) for k in keys):
            raise ProfileError(shape)
        return cls(body["rows_per_pass"], body["stream_rows"], body["logits_rows"])


def line_features(step: Step, passes: StreamPasses | None) -> tuple[float, float, float, float, float]:
    """What a linear step time's c0..c4 multiply: (1, prompt tokens, prompt attention, streams,
    context), or under the stream GEMV (1, rows on the GEMM, ...) (`StreamPasses.line`). The fit
    (calibrate.py) and the simulation read them from here, so that they cannot part."""
    if passes is not None:
        return passes.line(step)
    return (1.0, step.prefill_tokens, step.prefill_attention, step.decode_streams, step.decode_context)


@dataclass(frozen=True)
class LinearStep:
    """c0 + c1 * prompt tokens + c2 * prompt attention + c3 * decode streams + c4 * decode context;
    where `passes` is known, c1 is per row on the GEMM instead (`StreamPasses.line`), plus p0 * the
    stream GEMV's passes past the first + p1 * (a GEMM runs the layers) + p2 * (a GEMM runs the
    logits)."""

    coefficients: tuple[float, float, float, float, float]
    # How well the fit matches the steps it was fitted to (relative error, |fit - measured| / measured).
    samples: int = 0
    median_error: float | None = None
    p90_error: float | None = None
    # How the steps spread around the fit, by their fitted length, shortest first (served steps:
    # a right tail, so their mean is above the fit's, the short steps' tail the longest). Empty:
    # a lognormal spread of the median error instead.
    spread: tuple[Spread, ...] = ()
    # Steps with prompt tokens beside decode streams (a decode worker's local prefills, a
    # colocated worker's chunks): measured / fitted quantiles of their own, where the served steps
    # had enough of them; `spread` is then the other steps'. One line fits both kinds, and on a
    # decode worker the mixed ones ran over it (its prompt cost is another pool's, from long
    # chunks): 1.09x at the median against 1.02x for its decode steps. Empty: they
    # spread as steps of their length.
    mixed_spread: tuple[float, ...] = ()
    # The same two for a worker on a host with a CPU no worker is on (`free_spread`,
    # `free_mixed_spread`; empty: such a worker's steps spread as the others'; measured with the
    # workers pinned): the router's and the client's CPU then runs there, and a lone worker's steps
    # keep tight around the fit where a host every CPU of which has a worker gives them a right
    # tail (colocated 1 on an AVX512 EPYC's two CPUs: p90 1.03-1.2x the median at 1-3 streams in
    # three runs of four, 1.2-1.3x in the fourth; colocated 2 and 1P+1D at the same load 1.2-1.6x,
    # even while the other worker idled).
    free_spread: tuple[Spread, ...] = ()
    free_mixed_spread: tuple[float, ...] = ()
    # The engine's stream GEMV, and seconds per pass over the weights, for the layers' GEMM past
    # it and for the logits' GEMM past theirs; None: the step time is the line alone.
    passes: StreamPasses | None = None
    pass_coefficients: tuple[float, float, float] = (0.0, 0.0, 0.0)
    # What a step's prompt work takes against the fit, beside the rest of the step (a speed check's
    # prompt steps against its steps as a whole, pdserve/sim/speed.py): the time a step's prompt
    # tokens add to it, its whole time in a prompt-only step, runs this many times as fitted.
    prompt_scale: float = 1.0
    # What a step with prompt tokens beside decode streams takes against the fit, as a whole (a
    # served run's mixed steps against its steps as a whole, pdserve/sim/trace_speed.py): a decode
    # worker's short local chunks do not run at the pace of a prefill worker's prompts. None: such
    # a step's prompt part runs at prompt_scale instead.
    mixed_scale: float | None = None
    # The same as prompt_scale for a step whose rows run on the GEMM, past the stream GEMV (a served
    # run's prompt-only steps there against its steps as a whole, pdserve/sim/trace_speed.py): the
    # two kernels do not move alike with the host (a prefill worker's prompts at a DPD knee on the
    # AVX512 EPYC: on the GEMV 0.86-0.90 of the fit, on the GEMM 0.90-0.98). A step of prompt
    # tokens beside streams on the GEMM takes it for its prompt part too, where mixed_scale is
    # None. None: prompt_scale.
    gemm_prompt_scale: float | None = None

    def __post_init__(self) -> None:
        for name in ("prompt_scale", "mixed_scale", "gemm_prompt_scale"):
            value = getattr(self, name)
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ProfileError(f"a step time's {name} must be a finite number > 0, got {value}")
        if len(self.pass_coefficients) != 3 or not all(
            math.isfinite(c) and c >= 0 for c in self.pass_coefficients
        ):
            raise ProfileError("a step time's pass_coefficients must be 3 finite numbers >= 0")
        if self.free_mixed_spread and not self.free_spread:
            raise ProfileError("a step time's free_mixed_spread goes with a free_spread")
        for ratios in (self.mixed_spread, self.free_mixed_spread):
            if ratios:
                Spread(None, ratios)  # the same checks: ascending ratios > 0
        for bands in (self.spread, self.free_spread):
            ends = [band.below_s for band in bands]
            if any(end is None for end in ends[:-1]):
                raise ProfileError("only a step time's last spread band may have no end (below_s null)")
            bounded = [end for end in ends if end is not None]
            if any(not (math.isfinite(end) and end > 0) for end in bounded) or any(
                b <= a for a, b in itertools.pairwise(bounded)
            ):
                raise ProfileError("a step time's spread bands must end (below_s) at ascending seconds > 0")

    def spread_at(self, seconds: float, mixed: bool = False, free_cpu: bool = False) -> tuple[float, ...]:
        """The measured / fitted quantiles of steps the fit puts at `seconds` (empty: none known);
        `mixed`: of a step with prompt tokens beside decode streams (`mixed_spread` where known);
        `free_cpu`: of a worker on a host with a CPU no worker is on (`free_spread`, and
        `free_mixed_spread`, where known: without it, such a worker's mixed steps spread as its
        others, as those runs' steps were banded). Past the longest band's end (the longest step measured)
        only its mean: how such a step deviates was not seen, and the tail of shorter ones is not
        its own."""
        bands, mixed_ratios = self.spread, self.mixed_spread
        if free_cpu and self.free_spread:
            bands, mixed_ratios = self.free_spread, self.free_mixed_spread
        if mixed and mixed_ratios:
            return mixed_ratios
        for band in bands:
            if band.below_s is None or seconds < band.below_s:
                return band.quantiles
        if not bands:
            return ()
        last = bands[-1].quantiles
        return (sum(last) / len(last),)

    def seconds(self, step: Step) -> float:
        fitted = self._fitted(step)
        if self.mixed_scale is not None and step.prefill_tokens > 0 and step.decode_streams > 0:
            return fitted * self.mixed_scale
        scale = self.prompt_scale
        on_gemm = (
            self.passes is not None and step.prefill_tokens + step.decode_streams > self.passes.stream_rows
        )
        if self.gemm_prompt_scale is not None and on_gemm:
            scale = self.gemm_prompt_scale
        if scale == 1.0 or step.prefill_tokens == 0:
            return fitted
        # The step's decode part as fitted, the time its prompt adds scaled.
        rest = (
            self._fitted(Step(0, 0, step.decode_streams, step.decode_context)) if step.decode_streams else 0.0
        )
        return rest + max(0.0, fitted - rest) * scale

    def _fitted(self, step: Step) -> float:
        line = sum(c * x for c, x in zip(self.coefficients, line_features(step, self.passes), strict=True))
        if self.passes is None:
            return line
        kernel = self.passes.features(step)
        return line + sum(c * x for c, x in zip(self.pass_coefficients, kernel, strict=True))

    @classmethod
    def fitted(cls, samples: Sequence[tuple[Step, float]]) -> LinearStep:
        """Fitted to measured (step, seconds), with how well it fits them."""
        coefficients = fit_step_time(samples)
        model = cls(tuple(coefficients))  # type: ignore[arg-type]
        errors = [abs(model.seconds(step) - t) / t for step, t in samples if t > 0]
        return cls(
            model.coefficients,
            samples=len(samples),
            median_error=round(slo.quantile(errors, 0.5) or 0.0, 4),
            p90_error=round(slo.quantile(errors, 0.9) or 0.0, 4),
        )

    def to_json(self) -> dict[str, Any]:
        body = {"kind": "linear"} | asdict(self)
        for key in ("spread", "mixed_spread", "free_spread", "free_mixed_spread"):
            if not body[key]:
                del body[key]  # profiles without one read as before
        if self.passes is None:
            del body["passes"], body["pass_coefficients"]
        if self.prompt_scale == 1.0:
            del body["prompt_scale"]  # as fitted: profiles read as before
        for key in ("mixed_scale", "gemm_prompt_scale"):
            if body[key] is None:
                del body[key]
        return body


@dataclass(frozen=True)
class RooflineStep:
    """fixed + max(compute, memory): compute = (flops_per_token * tokens + flops_per_attended *
    attended positions) / flops; memory = (weight_bytes + kv_bytes_per_token * tokens read) /
    bandwidth. Rates are peak x efficiency, in FLOP/s and bytes/s."""

    fixed_s: float
    flops_per_token: float
    flops_per_attended: float
    weight_bytes: float
    kv_bytes_per_token: float
    flops: float
    bandwidth: float

    def seconds(self, step: Step) -> float:
        tokens = step.prefill_tokens + step.decode_streams
        if tokens == 0:
            return self.fixed_s
        attended = step.prefill_attention + step.decode_context
        compute = (self.flops_per_token * tokens + self.flops_per_attended * attended) / self.flops
        # A prompt chunk writes its KV and reads what it attends to once (flash attention); a
        # decode stream reads its whole context.
        kv_tokens = step.decode_context + step.prefill_tokens
        memory = (self.weight_bytes + self.kv_bytes_per_token * kv_tokens) / self.bandwidth
        return self.fixed_s + max(compute, memory)

    def to_json(self) -> dict[str, Any]:
        return {"kind": "roofline"} | asdict(self)


StepTime = LinearStep | RooflineStep
