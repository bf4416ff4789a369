"""Which x86-64 instruction sets this CPU offers, and the cap `PDSERVE_CPU_ISA` puts on them (no torch).

Users run pdserve on AVX2-only CPUs (older Xeons and EPYCs, many cloud VMs, laptops), on AVX-512, on
AVX512-BF16 and on AMX. Every engine path must work on each, and the paths of a lesser CPU must be
testable on a better one. So a process may cap the level it uses, with one setting:

    PDSERVE_CPU_ISA=avx2 | avx512 | avx512_bf16 | amx     (unset: what the CPU has)

Under a cap below the CPU's own level:
- the per-machine plan (cpu/plan.py) sees only the flags of the capped level, and its cache key
  names the cap (a plan measured under a cap is never read without it, nor the reverse);
- the C++ kernels (cpu/kernels.py) are compiled for that level (`-march=x86-64-v3` for avx2,
  `x86-64-v4` for avx512, plus `-mavx512bf16`, ...) instead of `-march=native`;
- torch's own dispatch is capped where it has a knob: `ATEN_CPU_CAPABILITY` (ATen's vectorized
  kernels), `ONEDNN_MAX_CPU_ISA` (oneDNN) and `MKL_ENABLE_INSTRUCTIONS` (MKL's fp32 GEMM). These are
  read by torch at its first use of each, so `apply_torch_caps()` sets them when pdserve is imported
  (pdserve/__init__.py), before any torch op; a value the user set already is left alone.
A cap that takes nothing away (at or above the CPU's own level and flags) changes nothing but the
plan's cache key.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from pathlib import Path

from pdserve.errors import PdserveError

ISA_ENV = "PDSERVE_CPU_ISA"
LEVELS = ("avx2", "avx512", "avx512_bf16", "amx")  # lowest to highest
# The /proc/cpuinfo flags each level needs (each includes those of the levels below it).
_LEVEL_FLAGS: dict[str, tuple[str, ...]] = {}
_needed: tuple[str, ...] = ()
for _level, _more in zip(
    LEVELS,
    (
        ("avx2", "fma"),
        ("avx512f", "avx512bw", "avx512vl", "avx512dq"),
        ("avx512_bf16",),
        ("amx_tile", "amx_bf16"),
    ),
    strict=True,
):
    _needed = _needed + _more
    _LEVEL_FLAGS[_level] = _needed
# Every flag the engine's choices depend on; avx_ne_convert lets oneDNN do bf16 without AVX-512.
TRACKED_FLAGS = (*_LEVEL_FLAGS["amx"], "avx_ne_convert")
# What the C++ kernels are compiled for at each capped level (gcc >= 11, clang >= 12).
_MARCH = {
    "avx2": ("-march=x86-64-v3",),
    "avx512": ("-march=x86-64-v4",),
    "avx512_bf16": ("-march=x86-64-v4", "-mavx512bf16"),
    "amx": ("-march=x86-64-v4", "-mavx512bf16", "-mamx-tile", "-mamx-bf16"),
}
# torch's own knobs, per capped level: ATen's dispatch, oneDNN's and MKL's.
_TORCH_ENV = {
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
    "avx512_bf16": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
    "amx": {
        "ATEN_CPU_CAPABILITY": "avx512",
        "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX",
        "MKL_ENABLE_INSTRUCTIONS": "AVX512",
    },
}


class CpuIsaError(PdserveError, ValueError):
    """PDSERVE_CPU_ISA names no level, or caps a CPU that is not x86-64."""


@dataclass(frozen=True)
class CpuIsa:
    model: str  # the CPU's model name
    machine_flags: tuple[str, ...]  # the tracked flags the CPU has
    machine_level: str | None  # the highest level the CPU has (None: below AVX2, or not x86-64)
    cap: str | None  # PDSERVE_CPU_ISA, as asked (None: unset)

    @property
    def capped(self) -> bool:
        """Whether the cap takes something away from this CPU: a higher level, or a flag beyond the
        cap's level (an AVX2-level CPU with AVX-NE-CONVERT, capped at avx2, loses that)."""
        if self.cap is None or self.machine_level is None:
            return False
        return bool(set(self.machine_flags) - set(_LEVEL_FLAGS[self.cap]))

    @property
    def level(self) -> str | None:
        """The level in force: the CPU's, or the cap where it is lower."""
        if not self.capped or self.machine_level is None:
            return self.machine_level
        assert self.cap is not None
        return LEVELS[min(LEVELS.index(self.cap), LEVELS.index(self.machine_level))]

    @property
    def flags(self) -> tuple[str, ...]:
        """The tracked flags in force: the CPU's, less those above the cap."""
        if not self.capped:
            return self.machine_flags
        assert self.cap is not None
        allowed = set(_LEVEL_FLAGS[self.cap])
        return tuple(f for f in self.machine_flags if f in allowed)

    def has(self, *flags: str) -> bool:
        return all(f in self.flags for f in flags)

    @property
    def march(self) -> tuple[str, ...]:
        """The compiler's target flags for the C++ kernels."""
        if not self.capped or self.level is None:
            return ("-march=native",)
        return _MARCH[self.level]

    @property
    def torch_env(self) -> dict[str, str]:
        """The variables that cap torch's own dispatch at the level in force (none when uncapped)."""
        if not self.capped or self.level is None:
            return {}
        return dict(_TORCH_ENV[self.level])

    def describe(self) -> str:
        """One line: the level in force and why."""
        here = self.machine_level or "below AVX2"
        if self.cap is None:
            return f"{here} (this CPU's own; {ISA_ENV} unset)"
        if not self.capped:
            return f"{here}: {ISA_ENV}={self.cap} is at or above this CPU's level ({here}), so it changes nothing"
        return (
            f"{self.level}: capped by {ISA_ENV}={self.cap} (this CPU: {here}, {' '.join(self.machine_flags)})"
        )


def _read_cpuinfo() -> tuple[str, set[str]]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine(), set()
    model, flags = platform.machine(), set[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model == platform.machine():
            model = value.strip()
        elif key.strip() in ("flags", "Features") and not flags:
            flags = set(value.split())
    return model, flags


def requested_cap(environ: dict[str, str] | os._Environ[str] | None = None) -> str | None:
    """PDSERVE_CPU_ISA, checked: one of LEVELS (case-insensitive), or None when unset or 'native'."""
    value = (environ if environ is not None else os.environ).get(ISA_ENV, "").strip().lower()
    if value in ("", "native"):
        return None
    if value not in LEVELS:
        raise CpuIsaError(
            f"{ISA_ENV}={value!r} is not a level: use one of {', '.join(LEVELS)} (or leave it unset)"
        )
    if platform.machine().lower() not in ("x86_64", "amd64"):
        raise CpuIsaError(f"{ISA_ENV} caps x86-64 instruction sets; this machine is {platform.machine()}")
    return value


def probe(environ: dict[str, str] | os._Environ[str] | None = None) -> CpuIsa:
    """This CPU and the cap in force. Raises CpuIsaError for a PDSERVE_CPU_ISA that names no level."""
    model, flags = _read_cpuinfo()
    machine_flags = tuple(f for f in TRACKED_FLAGS if f in flags)
    level = None
    for name in LEVELS:
        if all(f in flags for f in _LEVEL_FLAGS[name]):
            level = name
    return CpuIsa(model, machine_flags, level, requested_cap(environ))


def apply_torch_caps() -> None:
    """Under a cap, set torch's knobs (ATen, oneDNN, MKL) before torch reads them; those the user set
    are kept. A bad PDSERVE_CPU_ISA is left for the engine to report (it raises CpuIsaError there)."""
    if not os.environ.get(ISA_ENV):
        return
    try:
        isa = probe()
    except CpuIsaError:
        return
    for key, value in isa.torch_env.items():
        os.environ.setdefault(key, value)
