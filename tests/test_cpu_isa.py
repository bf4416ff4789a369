"""The ISA level in force and the PDSERVE_CPU_ISA cap (cpu/isa.py): what a cap takes away from a
better CPU (its flags, the compiler target, torch's knobs), that a cap at or above the CPU changes
nothing, that a bad value is a clear error (in `pdserve serve` before any worker starts), and that
importing pdserve caps torch's own dispatch in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from pdserve.ops.cpu import isa as cpu_isa
from pdserve.ops.cpu.isa import CpuIsa, CpuIsaError

AMX_FLAGS = cpu_isa.TRACKED_FLAGS  # a Sapphire Rapids: every tracked flag
AVX2_FLAGS = ("avx2", "fma")


def test_a_cap_below_the_cpu_takes_its_flags_and_sets_the_build_and_torch() -> None:
    isa = CpuIsa("Xeon", AMX_FLAGS, "amx", "avx2")
    assert isa.capped and isa.level == "avx2"
    assert isa.flags == ("avx2", "fma") and not isa.has("avx512bw") and not isa.has("avx_ne_convert")
    assert isa.march == ("-march=x86-64-v3",)
    assert isa.torch_env == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    assert "capped by PDSERVE_CPU_ISA=avx2" in isa.describe()
    middle = CpuIsa("Xeon", AMX_FLAGS, "amx", "avx512_bf16")
    assert middle.has("avx512_bf16", "avx512bw") and not middle.has("amx_bf16")
    assert "-mavx512bf16" in middle.march and middle.torch_env["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"


def test_a_cap_at_the_cpus_level_still_takes_the_flags_above_it() -> None:
    # An AVX2-level CPU with AVX-NE-CONVERT (oneDNN's bf16 without AVX-512): avx2 takes that away.
    isa = CpuIsa("Core", ("avx2", "fma", "avx_ne_convert"), "avx2", "avx2")
    assert isa.capped and isa.level == "avx2" and isa.flags == ("avx2", "fma")
    assert isa.march == ("-march=x86-64-v3",) and isa.torch_env["ONEDNN_MAX_CPU_ISA"] == "AVX2"
    higher = CpuIsa("Core", ("avx2", "fma", "avx_ne_convert"), "avx2", "avx512")
    assert higher.capped and higher.level == "avx2"  # never above what the CPU has


@pytest.mark.parametrize("cap", [None, "avx2", "amx"])
def test_a_cap_at_or_above_the_cpu_changes_nothing(cap: str | None) -> None:
    isa = CpuIsa("EPYC", AVX2_FLAGS, "avx2", cap)
    assert not isa.capped and isa.level == "avx2" and isa.flags == AVX2_FLAGS
    assert isa.march == ("-march=native",) and isa.torch_env == {}
    assert ("changes nothing" in isa.describe()) == (cap is not None)


def test_the_level_is_the_highest_the_cpu_has_every_flag_of(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_isa, "_read_cpuinfo", lambda: ("X", {"avx2", "fma", "avx512f", "avx512bw"}))
    assert cpu_isa.probe({}).machine_level == "avx2"  # no avx512vl/dq: not the avx512 level
    monkeypatch.setattr(cpu_isa, "_read_cpuinfo", lambda: ("X", {"sse4_2", "avx"}))
    below = cpu_isa.probe({"PDSERVE_CPU_ISA": "avx2"})
    assert below.machine_level is None and not below.capped and below.level is None


@pytest.mark.parametrize("value", ["sse", "avx-2", "avx512bf16"])
def test_a_bad_value_names_the_levels(value: str) -> None:
    with pytest.raises(CpuIsaError, match="avx2, avx512, avx512_bf16, amx"):
        cpu_isa.requested_cap({"PDSERVE_CPU_ISA": value})
    assert cpu_isa.requested_cap({"PDSERVE_CPU_ISA": " AVX2 "}) == "avx2"
    assert cpu_isa.requested_cap({"PDSERVE_CPU_ISA": "native"}) is None


def test_pdserve_serve_refuses_a_bad_value_before_starting_anything() -> None:
    env = {**os.environ, "PDSERVE_CPU_ISA": "sse"}
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--model", "smollm2-135m", "--colocated", "1"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2 and "PDSERVE_CPU_ISA='sse' is not a level" in done.stderr
    assert "Traceback" not in done.stderr


def test_importing_pdserve_caps_torch_in_a_fresh_process() -> None:
    script = (
        "import json, os, pdserve, torch\n"
        "torch.ones(4).sum()\n"
        "print(json.dumps({k: os.environ.get(k) for k in "
        "('ATEN_CPU_CAPABILITY', 'ONEDNN_MAX_CPU_ISA', 'MKL_ENABLE_INSTRUCTIONS')} "
        "| {'dispatch': torch.backends.cpu.get_cpu_capability()}))"
    )
    env = {k: v for k, v in os.environ.items() if k not in cpu_isa._TORCH_ENV["avx2"]}
    env["PDSERVE_CPU_ISA"] = "avx2"
    out = json.loads(
        subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=True
        ).stdout
    )
    expected = cpu_isa.probe({"PDSERVE_CPU_ISA": "avx2"})
    for key, value in expected.torch_env.items():
        assert out[key] == value
    if expected.capped:  # a better CPU than AVX2: torch's own kernels are AVX2 ones now
        assert out["dispatch"] == "AVX2"
    else:
        assert all(out[key] is None for key in cpu_isa._TORCH_ENV["avx2"])
