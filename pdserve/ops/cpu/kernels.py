"""Optional C++ CPU kernels, compiled on first use with torch's JIT extension builder.

`decode_attention_kernel()` returns `torch.ops.pdserve.paged_decode_attention` (see
cpu_attention.cpp), or None when kernels are disabled (`PDSERVE_CPU_KERNELS=0`) or cannot be built
(no compiler, no ninja, a compile error): then one warning says why, and callers keep the portable
torch path, which stays the reference.

The first use on a machine compiles (10-20 s on 2 cores); later processes load the cached library
in milliseconds. The build folder is keyed by everything the binary depends on (sources, flags, torch
and Python versions, the CPU's instruction set since we compile with -march=native or the level
PDSERVE_CPU_ISA caps it at, see cpu/isa.py), so a changed
source, an upgraded torch or a home directory shared between different machines never loads a
stale or illegal binary. It lives under `$PDSERVE_CACHE_DIR/torch_extensions` (default
`~/.cache/pdserve/torch_extensions`).

Concurrency: torch's own guard is a lock file (`FileBaton`) that waiters poll forever, so a builder
killed mid-build would hang every later process. We serialize builders with `fcntl.flock` instead
(the kernel drops it when its holder dies) and, holding it, clear a stale baton before calling
torch. A `ready` stamp, written atomically once the library has loaded, lets later processes skip
torch's builder (which reruns ninja and probes the compiler) and load the library directly.
A failed build is not remembered: each new process tries again (and warns again), so installing a
missing compiler or ninja needs no cache cleanup.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import platform
import re
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from pdserve.ops.cpu import isa as cpu_isa

logger = logging.getLogger(__name__)

_NAME = "pdserve_cpu_kernels"
_SOURCES = (
    "cpu_attention.cpp",
    "cpu_gemv.cpp",
    "cpu_gemv_f32.cpp",
    "cpu_ops.cpp",
    "cpu_paged_attention.cpp",
    "cpu_paged_attention_bf16.cpp",
)
# Not compiled on their own, but the build depends on them.
_HEADERS = ("cpu_paged_attention.h", "cpu_paged_attention_lanes.h", "cpu_parallel.h", "cpu_vec.h")
# -ffp-contract=fast lets gcc fuse a*b+c into FMAs (off by default in torch's ISO -std=c++ mode;
# the ops that must round between a product and a sum turn it off for themselves);
# -fopenmp enables the `omp simd` loops and matches torch's OpenMP at::parallel_for;
# -fno-trapping-math lets gcc vectorize loops with float -> int conversions and min/max (exp's
# polynomial), which it otherwise keeps scalar in case they raise FP exceptions (nothing here
# reads those). No -ffast-math: the kernels must stay close to the portable path.
# The target (-march) comes from cpu/isa.py: `native`, or the level PDSERVE_CPU_ISA caps it at.
_CFLAGS = ["-O3", "-fopenmp", "-ffp-contract=fast", "-fno-trapping-math", "-DNDEBUG"]
_LDFLAGS = ["-fopenmp"]
_unavailable_reason: str | None = None


def _cache_root() -> Path:
    base = os.environ.get("PDSERVE_CACHE_DIR")
    root = Path(base) if base else Path.home() / ".cache" / "pdserve"
    return root / "torch_extensions"


def _cpu_fingerprint() -> str:
    """What -march=native compiles for: the CPU model and its feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU implementer", "CPU part")
    lines = {line.split(":", 1)[0].strip(): line for line in text.splitlines() if ":" in line}
    return platform.machine() + "".join(lines.get(key, "") for key in wanted)


def _cflags() -> list[str]:
    """The compiler flags: the fixed ones and the target of the ISA level in force."""
    return [*_CFLAGS, *cpu_isa.probe().march]


def _build_dir() -> Path:
    digest = hashlib.sha256()
    for name in _SOURCES + _HEADERS:
        digest.update((Path(__file__).parent / name).read_bytes())
    for part in (_cflags(), _LDFLAGS, torch.__version__, sys.version, _cpu_fingerprint()):
        digest.update(repr(part).encode())
    tag = re.sub(
        r"[^A-Za-z0-9._-]", "_", f"py{sys.version_info[0]}{sys.version_info[1]}_torch{torch.__version__}"
    )
    return _cache_root() / f"{tag}_{digest.hexdigest()[:16]}"


def _ensure_ninja_on_path() -> None:
    # torch's builder runs `ninja` from PATH; a venv that pip-installed ninja but is not activated
    # has it only in the venv's bin folder (or the ninja package's own).
    if shutil.which("ninja"):
        return
    candidates = [str(Path(sys.executable).parent)]
    try:
        import ninja

        candidates.insert(0, str(ninja.BIN_DIR))
    except (ImportError, AttributeError):
        pass
    for folder in candidates:
        if shutil.which("ninja", path=folder):
            os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")
            return


def _load_op_library(path: Path) -> None:
    """dlopen the library; its static initializers register torch.ops.pdserve.*."""
    torch.ops.load_library(str(path))  # type: ignore[no-untyped-call]


def _already_loaded() -> bool:
    """Whether this process has loaded the library already (its ops are registered)."""
    try:
        torch.ops.pdserve.paged_decode_attention  # noqa: B018 - the lookup is the test
    except (AttributeError, RuntimeError):
        return False
    return True


def _load_library() -> None:
    """Build if needed, then load the library (registers torch.ops.pdserve.*). Raises on failure.

    One library per process: once its ops are registered, a later call (another PDSERVE_CACHE_DIR,
    say, after `decode_attention_kernel.cache_clear()`) keeps them. Loading a second build would
    register the `pdserve` namespace again, which torch refuses in the library's static initializer,
    where the error can only abort the process (seen: a test suite's SIGABRT on an AVX2 machine)."""
    if _already_loaded():
        return
    build_dir = _build_dir()
    library = build_dir / f"{_NAME}.so"
    ready = build_dir / "ready"
    if ready.exists() and library.exists():
        _load_op_library(library)
        return

    import fcntl

    from torch.utils.cpp_extension import load

    build_dir.mkdir(parents=True, exist_ok=True)
    with open(build_dir / "build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released by the kernel if we die; waits for a builder
        try:
            if not (ready.exists() and library.exists()):
                # Only flock holders build here, so a baton left now was left by a dead builder.
                (build_dir / "lock").unlink(missing_ok=True)
                _ensure_ninja_on_path()
                logger.info("compiling the CPU attention kernel in %s (once per machine)", build_dir)
                started = time.perf_counter()
                load(  # builds, then loads the library
                    name=_NAME,
                    sources=[str(Path(__file__).parent / name) for name in _SOURCES],
                    extra_cflags=_cflags(),
                    extra_ldflags=_LDFLAGS,
                    build_directory=str(build_dir),
                    is_python_module=False,
                    verbose=False,
                )
                logger.info("CPU attention kernel built in %.1f s", time.perf_counter() - started)
                tmp = build_dir / f"ready.{os.getpid()}"
                tmp.write_text(f"{time.time()}\n")
                tmp.replace(ready)  # atomic: a reader sees no stamp or a whole one
                return
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    _load_op_library(library)  # another process built it while we waited


def _reason(error: BaseException) -> str:
    """One line from a build error: torch's message starts with the whole compiler command line,
    so keep its head and the first line of the tool output that says what went wrong."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    head = f"{type(error).__name__}: {lines[0] if lines else ''}".split(": [1/")[0]
    markers = ("error", "not found", "fatal", "no such file", "cannot")
    detail = next((line for line in lines[1:] if any(m in line.lower() for m in markers)), "")
    reason = f"{head} ({detail})" if detail else head
    return reason if len(reason) <= 400 else reason[:397] + "..."


@functools.cache
def decode_attention_kernel() -> Callable[..., torch.Tensor] | None:
    """The C++ paged decode attention op, or None (disabled or unavailable; warned once).

    op(q [B, H, D], k_cache [NB, BS, KVH, D], v_cache, block_tables [B, MB] int64,
       seq_lens [B] int64, scale: float, sliding_window: int (0 = none)) -> [B, H, D]
    """
    global _unavailable_reason
    if os.environ.get("PDSERVE_CPU_KERNELS", "1").strip().lower() in ("0", "false", "no", "off"):
        _unavailable_reason = "disabled by PDSERVE_CPU_KERNELS"
        logger.info("CPU kernels disabled by PDSERVE_CPU_KERNELS; using the portable attention path")
        return None
    try:
        _load_library()
        op: Callable[..., torch.Tensor] = torch.ops.pdserve.paged_decode_attention
    except cpu_isa.CpuIsaError:
        raise  # a bad PDSERVE_CPU_ISA is the operator's to fix, not a reason to run slower
    except Exception as error:  # any failure (no compiler, bad flags, load error) means: portable path
        _unavailable_reason = _reason(error)
        logger.warning(
            "pdserve: the C++ CPU attention kernel is unavailable, using the slower portable path "
            "(set PDSERVE_CPU_KERNELS=0 to silence this). Reason: %s",
            _unavailable_reason,
        )
        return None
    _unavailable_reason = None
    return op


def unavailable_reason() -> str | None:
    """Why the last `decode_attention_kernel()` returned None (None if it returned the op)."""
    return _unavailable_reason
