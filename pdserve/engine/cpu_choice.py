"""What this CPU runs best, decided by measurement once per machine and cached (torch).

Machines of one kind differ from one day to the next (AVX2 only, AVX512-BF16, AMX), and what is
fast on one is slow on another: bf16 matmuls are emulated, ~8x slower than fp32, without native bf16
instructions, and twice as fast as fp32 with them; oneDNN's prepacked weights pay off on some and
not others. So on first use a machine measures, in about a second:
- the dtype `auto` means: bfloat16 when its matmul beats float32's, else float32;
- for each dtype, whether prepacked oneDNN weights (cpu_linear.py) beat plain `F.linear` for the
  few rows of a decode step and the hundreds of a prompt chunk;
- in bf16, with the C++ kernels built for AVX512-BF16, up to how many rows the stream GEMV
  (cpu_gemv.cpp) beats that choice: a step of at most that many rows uses it;
and keeps the answer in `$PDSERVE_CACHE_DIR` (default `~/.cache/pdserve`) under a key made of the
CPU's model and flags and torch's version, so later processes read it in microseconds. The C++
kernels report the instruction set they were built for (`-march=native`). Engines log the plan at
start; `pdserve info` prints it (`--refresh` measures again).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from pdserve.engine.cpu_linear import (
    onednn_available,
    pack_weight,
    packed_linear,
    stream_linear,
    stream_linear_available,
    stream_pack,
)

# SmolLM2-sized projections: hidden 576 -> MLP 1536; M = 1 (decode), 32 (a batch), 512 (a chunk).
_SHAPE = (1536, 576)
_ROWS = (1, 32, 256)
_WEIGHTS = 12  # 42 MB in fp32, 21 MB in bf16: past most L3 caches
# A choice must win by this much to be taken: below it, the machine's noise decides.
_MARGIN = 1.05
_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16")
# The stream GEMV is tried at these row counts, in order; it is used up to the last that wins.
_STREAM_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
# Part of the cache key: a plan cached by an older version of this file is measured again.
_PLAN_VERSION = 5


@dataclass
class CpuPlan:
    model: str
    flags: list[str]
    torch_version: str
    auto_dtype: str  # what dtype="auto" means here
    gflops: dict[str, dict[str, float]] = field(default_factory=dict)  # dtype -> rows -> GFLOP/s
    prepack: dict[str, bool] = field(default_factory=dict)  # dtype -> use prepacked oneDNN weights
    prepack_speedup: dict[str, dict[str, float]] = field(default_factory=dict)  # dtype -> rows -> x
    # dtype -> the most rows a step may have to use the stream GEMV (0: never), and its speedups
    # over the linear path chosen above (rows -> x)
    stream_rows: dict[str, int] = field(default_factory=dict)
    stream_speedup: dict[str, dict[str, float]] = field(default_factory=dict)
    measured_at: float = 0.0

    def summary(self, dtype: torch.dtype | None = None) -> str:
        name = _dtype_name(dtype) if dtype is not None else self.auto_dtype
        linear = "oneDNN prepacked" if self.prepack.get(name) else "torch F.linear"
        if self.stream_rows.get(name, 0) > 0:
            linear += f", stream GEMV up to {self.stream_rows[name]} rows"
        bf16, fp32 = self.gflops.get("bfloat16", {}), self.gflops.get("float32", {})
        return (
            f"{self.model} [{' '.join(self.flags) or 'no AVX2'}]: auto dtype {self.auto_dtype} "
            f"(matmul M=32: bf16 {bf16.get('32', 0):.0f}, fp32 {fp32.get('32', 0):.0f} GFLOP/s); "
            f"{name} linear layers: {linear}; C++ kernels: {kernel_isa() or 'unavailable'}"
        )


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def cpu_model_and_flags() -> tuple[str, list[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), []
    model, flags = platform.machine(), set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == platform.machine():
            model = value.strip()
        elif key.strip() in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model, [f for f in _FLAGS if f in flags]


def _cache_file(model: str, flags: list[str]) -> Path:
    base = os.environ.get("PDSERVE_CACHE_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "pdserve"
    key = repr((model, flags, torch.__version__, platform.machine(), _PLAN_VERSION))
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


def measure() -> CpuPlan:
    model, flags = cpu_model_and_flags()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # each worker runs its own threads; one is what they share
    try:
        plan = CpuPlan(model, flags, torch.__version__, "float32", measured_at=time.time())
        out_features, in_features = _SHAPE
        for dtype in (torch.float32, torch.bfloat16):
            name = _dtype_name(dtype)
            # Several weights, used in turn, so that they come from memory as a model's layers do
            # (one weight would sit in the cache and flatter the few-rows case).
            weights = [torch.randn(out_features, in_features).to(dtype) for _ in range(_WEIGHTS)]
            packed = [pack_weight(w) for w in weights] if onednn_available() else None
            plan.gflops[name], plan.prepack_speedup[name] = {}, {}
            for rows in _ROWS:
                x = torch.randn(rows, in_features).to(dtype)
                loops = [functools.partial(_in_turn, F.linear, x, weights)]
                if packed is not None:
                    loops.append(functools.partial(_in_turn, _packed, x, packed))
                plain, *fast = (t / _WEIGHTS for t in _times(loops))
                plan.gflops[name][str(rows)] = 2 * rows * out_features * in_features / plain / 1e9
                if fast:
                    plan.prepack_speedup[name][str(rows)] = plain / fast[0]
            speedups = plan.prepack_speedup[name]
            # Decode rows must gain and prompt chunks must not lose: decodes are most of the steps.
            plan.prepack[name] = (
                bool(speedups) and speedups["1"] >= _MARGIN and speedups["256"] >= 1 / _MARGIN
            )
            if dtype == torch.bfloat16 and stream_linear_available():
                chosen = packed if plan.prepack[name] and packed is not None else None
                plan.stream_speedup[name] = _stream_speedups(weights, chosen)
                plan.stream_rows[name] = _stream_rows(plan.stream_speedup[name])
        if plan.gflops["bfloat16"]["32"] >= _MARGIN * plan.gflops["float32"]["32"]:
            plan.auto_dtype = "bfloat16"
        return plan
    finally:
        torch.set_num_threads(threads)


def _stream_speedups(weights: list[torch.Tensor], packed: list[torch.Tensor] | None) -> dict[str, float]:
    """rows -> how much faster the stream GEMV runs than oneDNN's packed weights (or F.linear)."""
    out_features, in_features = weights[0].shape
    streams = [stream_pack(w) for w in weights]
    speedups = {}
    for rows in _STREAM_ROWS:
        x = torch.randn(rows, in_features).to(weights[0].dtype)
        if packed is not None:
            base = functools.partial(_in_turn, _packed, x, packed)
        else:
            base = functools.partial(_in_turn, F.linear, x, weights)
        ours = functools.partial(_in_turn, lambda x, s: stream_linear(x, s, out_features, None), x, streams)
        base_time, our_time = _times([base, ours])
        speedups[str(rows)] = base_time / our_time
    return speedups


def _stream_rows(speedups: dict[str, float]) -> int:
    """The most rows up to which every measured row count won by the margin (0: none did)."""
    best = 0
    for rows in _STREAM_ROWS:
        if speedups.get(str(rows), 0.0) < _MARGIN:
            break
        best = rows
    return best


def _read(path: Path) -> CpuPlan | None:
    """The cached plan, or None to measure: there is none, it is unreadable, or it was measured
    while the C++ kernels were off (`PDSERVE_CPU_KERNELS=0`) and they are on now, so it never
    tried the stream GEMV (a machine whose kernels cannot have it never reaches the last test)."""
    try:
        plan = CpuPlan(**json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None  # none yet, or from another version of this file
    if "bfloat16" not in plan.stream_speedup and stream_linear_available():
        return None
    return plan


@functools.cache
def cpu_plan(refresh: bool = False) -> CpuPlan:
    """This machine's plan: from the cache, or measured now (and cached)."""
    model, flags = cpu_model_and_flags()
    path = _cache_file(model, flags)
    if not refresh and (cached := _read(path)) is not None:
        return cached
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        lock = open(path.with_suffix(".lock"), "w")  # noqa: SIM115 - held across the measurement
    except OSError:
        return measure()  # a read-only home: measured again next time
    with lock:
        # One process measures; the workers starting beside it wait, then read its result (and
        # the machine is not measured while they load it). The kernel drops the lock of a dead one.
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not refresh and (cached := _read(path)) is not None:
            return cached
        plan = measure()
        try:
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(asdict(plan), indent=1))
            tmp.replace(path)  # atomic: a reader sees the old plan or the new one
        except OSError:
            pass
        return plan


def cache_path() -> Path:
    return _cache_file(*cpu_model_and_flags())


def kernel_isa() -> str | None:
    """The instruction set the C++ kernels were built for, or None if they are unavailable."""
    from pdserve.engine.cpu_kernels import decode_attention_kernel

    if decode_attention_kernel() is None:
        return None
    isa: str = torch.ops.pdserve.kernel_isa()
    return isa
