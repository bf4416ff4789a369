"""What this CPU runs best, decided by measurement once per machine and cached (torch).

Machines of one kind differ from one day to the next (AVX2 only, AVX512-BF16, AMX), and what is
fast on one is slow on another: bf16 matmuls are emulated, ~8x slower than fp32, without native bf16
instructions, and twice as fast as fp32 with them; oneDNN's prepacked weights pay off on some and
not others. So on first use a machine measures, in a second or two:
- the dtype `auto` means: bfloat16 when its matmul beats float32's, else float32;
- for each dtype, whether prepacked oneDNN weights (cpu/linear.py) beat plain `F.linear` for the
  few rows of a decode step and the hundreds of a prompt chunk;
- in bf16, with the C++ kernels built for AVX512-BF16, up to how many rows the stream GEMV
  (cpu_gemv.cpp) beats that choice over a decoder layer's projections, and apart over the logits'
  vocabulary-wide weight: a step of at most that many rows uses it there;
- in fp32, with the C++ kernels built for AVX2 and FMA, up to how many rows the fp32 stream GEMV
  over weights stored in bf16 (cpu_gemv_f32.cpp) beats that choice;
and keeps the answer in `$PDSERVE_CACHE_DIR` (default `~/.cache/pdserve`) under a key made of the
CPU's model, the flags in force, the `PDSERVE_CPU_ISA` cap (cpu/isa.py) and torch's version, so later
processes read it in microseconds. A cached file that is unreadable, or whose CPU, cap, torch or
plan version differs from this process's, is measured again.

No probe can take the engine down: each capability (a dtype's matmul, oneDNN's prepacking in each
dtype, each stream GEMV) is first checked against the flags in force, then measured inside a guard;
what cannot run here is recorded in `unavailable` with the reason, and the plan takes the portable
path. Engines log the plan in one line at start; `pdserve info` prints it (`--refresh` measures again).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import logging
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from pdserve.ops.cpu import isa as cpu_isa
from pdserve.ops.cpu.linear import (
    STREAM_F32_COLS,
    onednn_available,
    pack_weight,
    packed_linear,
    stream_linear,
    stream_linear_available,
    stream_linear_f32,
    stream_linear_f32_available,
    stream_pack,
)

logger = logging.getLogger(__name__)

# SmolLM2-sized projections: hidden 576 -> MLP 1536; M = 1 (decode), 32 (a batch), 512 (a chunk).
_SHAPE = (1536, 576)
_ROWS = (1, 32, 256)
_WEIGHTS = 12  # 42 MB in fp32, 21 MB in bf16: past most L3 caches
# The stream GEMVs are timed over a decoder layer's projections (SmolLM2-sized: qkv, o, gate+up,
# down), _STREAM_LAYERS layers in turn (21 MB in bf16), as a decode step runs them: the GEMV reads
# a weight again for each row, which costs little on a weight that stays in the core's cache and
# much on a wide one (gate+up). Timed on one 1536x576 weight it won up to 4 rows on an AMX Xeon,
# where a real step of 2 to 4 streams ran 7-21% slower with it than without.
_STREAM_LAYER = ((960, 576), (576, 576), (3072, 576), (576, 1536))
_STREAM_LAYERS = 3
# The logits' weight (a vocabulary's rows: SmolLM2's 49152), far past any cache: timed apart, and
# the stream used for it only up to the rows where it wins there (on an AMX Xeon: never).
_LOGITS_SHAPE = (49152, 576)
# A choice must win by this much to be taken: below it, the machine's noise decides.
_MARGIN = 1.05
# The stream GEMVs are tried at these row counts, in order; each is used up to the last that wins.
_STREAM_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Part of the cache key and of the file: a plan cached by an older version of this file is measured again.
_PLAN_VERSION = 7
# oneDNN's bf16 matmuls and reorders (and torch's use of them for bf16 F.linear) need these.
_ONEDNN_BF16 = "oneDNN needs AVX512-BW/VL/DQ or AVX-NE-CONVERT"
_NATIVE_BF16 = "not used where bf16 is native (dtype=float32 keeps the full fp32 weights there)"
_NO_KERNELS = "the C++ kernels are unavailable"


@dataclass
class CpuPlan:
    model: str
    flags: list[str]  # the tracked flags in force (the CPU's, less those above a cap)
    torch_version: str
    auto_dtype: str  # what dtype="auto" means here
    gflops: dict[str, dict[str, float]] = field(default_factory=dict)  # dtype -> rows -> GFLOP/s
    prepack: dict[str, bool] = field(default_factory=dict)  # dtype -> use prepacked oneDNN weights
    prepack_speedup: dict[str, dict[str, float]] = field(default_factory=dict)  # dtype -> rows -> x
    # dtype -> the most rows a step may have to use the stream GEMV (0: never), and its speedups
    # over the linear path chosen above (rows -> x)
    stream_rows: dict[str, int] = field(default_factory=dict)
    stream_speedup: dict[str, dict[str, float]] = field(default_factory=dict)
    # the same for the logits' weight (a vocabulary wide), measured apart
    logits_stream_rows: dict[str, int] = field(default_factory=dict)
    logits_stream_speedup: dict[str, dict[str, float]] = field(default_factory=dict)
    # what cannot run on this CPU (or under its cap) -> why, e.g. "bfloat16 prepack" -> _ONEDNN_BF16
    unavailable: dict[str, str] = field(default_factory=dict)
    isa: str = ""  # the level in force (cpu/isa.py), "" below AVX2
    isa_cap: str = ""  # PDSERVE_CPU_ISA as asked ("" unset)
    isa_capped: bool = False  # whether that cap took something away from this CPU
    plan_version: int = 0
    measured_at: float = 0.0

    def summary(self, dtype: torch.dtype | None = None, stream_rows: int | None = None) -> str:
        """One line for an engine's start: what it runs and, briefly, what is unavailable and why.
        `stream_rows`: what the engine uses, where it differs from the plan (PDSERVE_STREAM_GEMV=0)."""
        name = _dtype_name(dtype) if dtype is not None else self.auto_dtype
        linear = "oneDNN prepacked" if self.prepack.get(name) else "torch F.linear"
        rows = self.stream_rows.get(name, 0) if stream_rows is None else stream_rows
        if rows > 0:
            stored = ", weights stored in bf16" if name == "float32" else ""
            logits = min(rows, self.logits_stream_rows.get(name, 0))
            on_logits = f"up to {logits}" if logits else "never"
            linear += f", stream GEMV up to {rows} rows{stored} (the logits' {on_logits})"
        bf16, fp32 = self.gflops.get("bfloat16", {}), self.gflops.get("float32", {})
        rates = f"fp32 {fp32.get('32', 0):.0f}" + (f", bf16 {bf16['32']:.0f}" if "32" in bf16 else "")
        cap = f", capped by {cpu_isa.ISA_ENV}={self.isa_cap}" if self.isa_capped else ""
        missing = "; ".join(f"{what}: {why}" for what, why in self.unavailable.items())
        return (
            f"{self.model} [{self.isa or 'below AVX2'}{cap}]: auto dtype {self.auto_dtype} "
            f"(matmul M=32 GFLOP/s: {rates}); {name} linear layers: {linear}; "
            f"C++ kernels: {kernel_isa() or 'unavailable'}"
            + (f"; unavailable here: {missing}" if missing else "")
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _cache_file(isa: cpu_isa.CpuIsa) -> Path:
    base = os.environ.get("PDSERVE_CACHE_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "pdserve"
    key = repr(
        (isa.model, isa.flags, isa.cap or "native", torch.__version__, platform.machine(), _PLAN_VERSION)
    )
    key = hashlib.sha256(key.encode()).hexdigest()[:16]
    return root / f"cpu_plan_{key}.json"


def _times(fns: Sequence[Callable[[], object]], budget: float = 0.05, rounds: int = 5) -> list[float]:
    """Median seconds per call of each of `fns`, over `rounds` loops of about `budget` / `rounds`
    seconds each, the functions taking turns (a, b, a, b, ...): a burst of load from elsewhere on
    the machine then falls on both sides of a comparison, not on one of them."""
    calls = []
    for fn in fns:
        for _ in range(2):
            fn()
        started, count = time.perf_counter(), 0
        while time.perf_counter() - started < budget / rounds or count < 3:
            fn()
            count += 1
        calls.append(count)
    runs: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, count, times in zip(fns, calls, runs, strict=True):
            started = time.perf_counter()
            for _ in range(count):
                fn()
            times.append((time.perf_counter() - started) / count)
    return [statistics.median(times) for times in runs]


def _in_turn(
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], x: torch.Tensor, weights: list[torch.Tensor]
) -> None:
    for weight in weights:
        linear(x, weight)


def _packed(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return packed_linear(x, weight, None)


def _reason(error: BaseException) -> str:
    """One line from an exception: its type and the first line of its message."""
    lines = str(error).strip().splitlines()
    text = f"{type(error).__name__}: {lines[0] if lines else ''}"
    return text if len(text) <= 300 else text[:297] + "..."


def _guarded(plan: CpuPlan, what: str, probe: Callable[[], Any]) -> Any:
    """probe()'s result, or None with the reason recorded under `what` (logged once, no traceback)."""
    try:
        return probe()
    except Exception as error:  # any failure of a probe means: that path is unavailable here
        plan.unavailable[what] = _reason(error)
        logger.warning("CPU plan: %s unavailable on this CPU: %s", what, plan.unavailable[what])
        return None


def measure(isa: cpu_isa.CpuIsa | None = None) -> CpuPlan:
    isa = isa or cpu_isa.probe()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # each worker runs its own threads; one is what they share
    try:
        plan = CpuPlan(
            isa.model,
            list(isa.flags),
            torch.__version__,
            "float32",
            isa=isa.level or "",
            isa_cap=isa.cap or "",
            isa_capped=isa.capped,
            plan_version=_PLAN_VERSION,
            measured_at=time.time(),
        )
        for dtype in (torch.float32, torch.bfloat16):
            _measure_dtype(plan, isa, dtype)
        bf16 = plan.gflops.get("bfloat16", {}).get("32", 0.0)
        if bf16 > 0 and bf16 >= _MARGIN * plan.gflops.get("float32", {}).get("32", 0.0):
            plan.auto_dtype = "bfloat16"
        return plan
    finally:
        torch.set_num_threads(threads)


def _measure_dtype(plan: CpuPlan, isa: cpu_isa.CpuIsa, dtype: torch.dtype) -> None:
    name = _dtype_name(dtype)
    out_features, in_features = _SHAPE
    if dtype == torch.bfloat16 and not (
        isa.has("avx512bw", "avx512vl", "avx512dq") or isa.has("avx_ne_convert")
    ):
        # torch hands bf16 matmuls to oneDNN only on these CPUs and emulates them elsewhere, several
        # times slower than fp32 (docs/performance.md): not worth a measurement, never `auto`.
        plan.unavailable["bfloat16 matmul"] = (
            f"emulated by torch, several times slower than float32 ({_ONEDNN_BF16})"
        )
        plan.unavailable["bfloat16 prepack"] = _ONEDNN_BF16
        return
    # Several weights, used in turn, so that they come from memory as a model's layers do (one
    # weight would sit in the cache and flatter the few-rows case).
    weights = [torch.randn(out_features, in_features).to(dtype) for _ in range(_WEIGHTS)]
    packed = None
    if not onednn_available():
        plan.unavailable[f"{name} prepack"] = "torch was built without oneDNN"
    else:
        packed = _guarded(
            plan, f"{name} prepack", lambda: _check_packed([pack_weight(w) for w in weights], weights)
        )
    if _guarded(plan, f"{name} matmul", lambda: _time_rows(plan, name, weights, packed)) is None:
        plan.gflops.pop(name, None)
        plan.prepack_speedup.pop(name, None)
        return
    speedups = plan.prepack_speedup[name]
    # Decode rows must gain and prompt chunks must not lose: decodes are most of the steps.
    plan.prepack[name] = bool(speedups) and speedups["1"] >= _MARGIN and speedups["256"] >= 1 / _MARGIN
    stream = "bfloat16 stream GEMV" if dtype == torch.bfloat16 else "float32 stream GEMV (bf16 weights)"
    if dtype == torch.float32 and (isa.has("avx512_bf16") or isa.has("amx_bf16")):
        # bf16 is this CPU's fast path; whoever asks for float32 here wants the full fp32 weights.
        plan.unavailable[stream] = _NATIVE_BF16
        return
    available = stream_linear_available if dtype == torch.bfloat16 else stream_linear_f32_available
    if not _guarded(plan, stream, available):
        plan.unavailable.setdefault(stream, _no_stream_reason(dtype))
        return
    layers = [shape for _ in range(_STREAM_LAYERS) for shape in _STREAM_LAYER]
    speedups = _guarded(plan, stream, lambda: _stream_speedups(dtype, plan.prepack[name], layers))
    if speedups is not None:
        plan.stream_speedup[name] = speedups
        plan.stream_rows[name] = rows = _stream_rows(speedups)
        if rows == 0:
            return  # the logits take the stream for no more rows than the layers
        logits = _guarded(
            plan,
            f"{stream} on the logits' weight",
            lambda: _stream_speedups(dtype, plan.prepack[name], [_LOGITS_SHAPE], rows),
        )
        if logits is not None:
            plan.logits_stream_speedup[name] = logits
            plan.logits_stream_rows[name] = _stream_rows(logits)


def _time_rows(
    plan: CpuPlan, name: str, weights: list[torch.Tensor], packed: list[torch.Tensor] | None
) -> bool:
    """GFLOP/s of F.linear at each of _ROWS, and the prepacked weights' speedup over it."""
    out_features, in_features = weights[0].shape
    plan.gflops[name], plan.prepack_speedup[name] = {}, {}
    for rows in _ROWS:
        x = torch.randn(rows, in_features).to(weights[0].dtype)
        loops = [functools.partial(_in_turn, F.linear, x, weights)]
        if packed is not None:
            loops.append(functools.partial(_in_turn, _packed, x, packed))
        plain, *fast = (t / _WEIGHTS for t in _times(loops))
        plan.gflops[name][str(rows)] = 2 * rows * out_features * in_features / plain / 1e9
        if fast:
            plan.prepack_speedup[name][str(rows)] = plain / fast[0]
    return True


def _check_packed(packed: list[torch.Tensor], weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """The packed weights, once one of them has computed what F.linear does (a reorder that
    succeeds but computes garbage under some oneDNN ISA would otherwise be measured, and chosen)."""
    x = torch.randn(3, weights[0].shape[1]).to(weights[0].dtype)
    want, got = F.linear(x, weights[0]), packed_linear(x, packed[0], None)
    tolerance = 1e-3 if weights[0].dtype == torch.float32 else 5e-2
    if not torch.allclose(
        got.float(), want.float(), rtol=tolerance, atol=tolerance * float(want.abs().max())
    ):
        raise RuntimeError("a prepacked weight computed something else than F.linear")
    return packed


def _no_stream_reason(dtype: torch.dtype) -> str:
    from pdserve.ops.cpu.kernels import unavailable_reason

    isa = kernel_isa()
    if isa is None:
        return f"{_NO_KERNELS} ({unavailable_reason()})"
    needs = "AVX512-BF16" if dtype == torch.bfloat16 else "AVX2 and FMA"
    return f"the C++ kernels were built for {isa}, without {needs}"


def _stream_speedups(
    dtype: torch.dtype, prepacked: bool, shapes: Sequence[tuple[int, int]], max_rows: int | None = None
) -> dict[str, float]:
    """rows -> how much faster the stream GEMV runs weights of these shapes, in turn, than oneDNN's
    packed weights (`prepacked`) or F.linear, up to the first row count where it does not win (and
    to `max_rows` at most). In fp32 the stream's weights are the bf16-rounded ones, against the full
    fp32 ones."""
    weights = [torch.randn(*shape).to(dtype) for shape in shapes]
    packed = [pack_weight(w) for w in weights] if prepacked else None
    if dtype == torch.float32:
        streams = [stream_pack(w.to(torch.bfloat16), STREAM_F32_COLS) for w in weights]
        kernel = stream_linear_f32
    else:
        streams = [stream_pack(w) for w in weights]
        kernel = stream_linear
    in_features = {w.shape[1] for w in weights}
    speedups = {}
    for rows in _STREAM_ROWS:
        if max_rows is not None and rows > max_rows:
            break
        inputs = {n: torch.randn(rows, n).to(dtype) for n in in_features}

        def base(inputs: dict[int, torch.Tensor] = inputs) -> None:
            for weight, pack in zip(weights, packed or weights, strict=True):
                x = inputs[weight.shape[1]]
                if packed is not None:
                    packed_linear(x, pack, None)
                else:
                    F.linear(x, weight)

        def ours(inputs: dict[int, torch.Tensor] = inputs) -> None:
            for weight, stream in zip(weights, streams, strict=True):
                kernel(inputs[weight.shape[1]], stream, weight.shape[0], None)

        base_time, our_time = _times([base, ours])
        speedups[str(rows)] = base_time / our_time
        if speedups[str(rows)] < _MARGIN:
            break  # it is used only up to its first loss: wider steps need not be measured
    return speedups


def _stream_rows(speedups: dict[str, float]) -> int:
    """The most rows up to which every measured row count won by the margin (0: none did)."""
    best = 0
    for rows in _STREAM_ROWS:
        if speedups.get(str(rows), 0.0) < _MARGIN:
            break
        best = rows
    return best


def _read(path: Path, isa: cpu_isa.CpuIsa) -> CpuPlan | None:
    """The cached plan, or None to measure: there is none, it is unreadable or malformed, it is
    foreign (another CPU, cap, torch or plan version), or it was measured while the C++ kernels
    were off (`PDSERVE_CPU_KERNELS=0`) or failed to build, and they are on now, so it never tried
    the stream GEMVs."""
    try:
        plan = CpuPlan(**json.loads(path.read_text()))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, TypeError) as error:
        logger.warning("CPU plan: %s is unreadable (%s); measuring again", path, _reason(error))
        return None
    foreign = _foreign(plan, isa)
    if foreign:
        logger.warning("CPU plan: %s is %s; measuring again", path, foreign)
        return None
    for dtype, available in (("bfloat16", stream_linear_available), ("float32", stream_linear_f32_available)):
        stream = "bfloat16 stream GEMV" if dtype == "bfloat16" else "float32 stream GEMV (bf16 weights)"
        why = plan.unavailable.get(stream)
        # Measured again only if the stream was missing for want of the kernels, which are here now
        # (not when its probe failed: that would be measured, and fail, at every start).
        missing = dtype in plan.gflops and dtype not in plan.stream_speedup
        if missing and (why is None or why.startswith(_NO_KERNELS)) and available():
            return None
    return plan


def _foreign(plan: CpuPlan, isa: cpu_isa.CpuIsa) -> str:
    """Why a cached plan is not this process's (empty when it is): its key or its shape differs."""
    wants = {
        "model": isa.model,
        "flags": list(isa.flags),
        "isa_cap": isa.cap or "",
        "torch_version": torch.__version__,
        "plan_version": _PLAN_VERSION,
    }
    for key, value in wants.items():
        if getattr(plan, key) != value:
            return f"for another {key.replace('_', ' ')} ({getattr(plan, key)!r}, here {value!r})"
    try:
        shapes = (
            plan.auto_dtype in ("float32", "bfloat16")
            and ("float32" in plan.gflops or "float32 matmul" in plan.unavailable)
            and all(isinstance(d, dict) for d in plan.gflops.values())
            and all(isinstance(v, int | float) for d in plan.gflops.values() for v in d.values())
            and all(isinstance(v, bool) for v in plan.prepack.values())
            and all(isinstance(v, int) and v >= 0 for v in plan.stream_rows.values())
            and all(isinstance(v, int) and v >= 0 for v in plan.logits_stream_rows.values())
            and all(isinstance(d, dict) for d in plan.stream_speedup.values())
            and all(isinstance(d, dict) for d in plan.logits_stream_speedup.values())
            and all(isinstance(v, str) for v in plan.unavailable.values())
        )
    except (AttributeError, TypeError):  # a list or a number where a dict belongs
        shapes = False
    return "" if shapes else "malformed"


@functools.cache
def cpu_plan(refresh: bool = False) -> CpuPlan:
    """This machine's plan: from the cache, or measured now (and cached). Raises CpuIsaError for a
    PDSERVE_CPU_ISA that names no level."""
    isa = cpu_isa.probe()
    path = _cache_file(isa)
    if not refresh and (cached := _read(path, isa)) is not None:
        return cached
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "w")  # noqa: SIM115 - held across the measurement
    except OSError:
        return measure(isa)  # a read-only home: measured again next time
    with lock:
        # One process measures; the workers starting beside it wait, then read its result (and
        # the machine is not measured while they load it). The kernel drops the lock of a dead one.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not refresh and (cached := _read(path, isa)) is not None:
            return cached
        plan = measure(isa)
        try:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(asdict(plan), indent=1))
            tmp.replace(path)  # atomic: a reader sees the old plan or the new one
        except OSError:
            pass
        return plan


def cache_path() -> Path:
    return _cache_file(cpu_isa.probe())


def kernel_isa() -> str | None:
    """The instruction set the C++ kernels were built for, or None if they are unavailable."""
    from pdserve.ops.cpu.kernels import decode_attention_kernel

    if decode_attention_kernel() is None:
        return None
    isa: str = torch.ops.pdserve.kernel_isa()
    return isa
