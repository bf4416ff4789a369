"""The per-machine plan: measured once, cached under the CPU's key, read back by later processes,
shown by `pdserve info` and logged by engines."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from pdserve.engine import cpu_choice, cpu_kernels
from pdserve.engine.core import pick_dtype


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    # The measurement tries the C++ stream GEMV: load the library from the machine's own cache
    # first (under another PDSERVE_CACHE_DIR it would be built there again, ~30 s).
    cpu_kernels.decode_attention_kernel()
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    cpu_choice.cpu_plan.cache_clear()
    yield tmp_path
    cpu_choice.cpu_plan.cache_clear()


def test_the_plan_is_measured_once_then_read_from_the_cache(cache_dir: Path) -> None:
    plan = cpu_choice.cpu_plan()
    path = cpu_choice.cache_path()
    assert path.parent == cache_dir and path.exists()
    stored = json.loads(path.read_text())
    assert stored["auto_dtype"] == plan.auto_dtype in ("float32", "bfloat16")
    assert set(plan.gflops) == {"float32", "bfloat16"} and all(r > 0 for r in plan.gflops["float32"].values())
    # A later process reads it: the file is what it gets, even one edited by hand.
    stored["auto_dtype"] = "float32" if plan.auto_dtype == "bfloat16" else "bfloat16"
    path.write_text(json.dumps(stored))
    cpu_choice.cpu_plan.cache_clear()
    assert cpu_choice.cpu_plan().auto_dtype == stored["auto_dtype"]
    assert pick_dtype("auto", torch.device("cpu")) == getattr(torch, stored["auto_dtype"])
    # A broken file is measured again, not trusted.
    path.write_text("{not json")
    cpu_choice.cpu_plan.cache_clear()
    assert cpu_choice.cpu_plan().auto_dtype in ("float32", "bfloat16")
    assert json.loads(path.read_text())["model"] == plan.model


def test_without_native_bf16_auto_is_float32(cache_dir: Path) -> None:
    # Emulated bf16 matmuls run ~8x slower than fp32 (docs/performance.md): the measurement says so.
    plan = cpu_choice.cpu_plan()
    if {"avx512_bf16", "amx_bf16"} & set(plan.flags):
        pytest.skip("this CPU has native bf16")
    assert plan.auto_dtype == "float32"


def test_pdserve_info_prints_the_plan() -> None:
    # The machine's own cache (another PDSERVE_CACHE_DIR would rebuild the C++ kernels there too).
    out = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "info"], capture_output=True, text=True, timeout=300, check=True
    ).stdout
    cpu_choice.cpu_plan.cache_clear()
    plan = cpu_choice.cpu_plan()
    assert f"dtype=auto: {plan.auto_dtype}" in out
    assert "C++ kernels: " in out and str(cpu_choice.cache_path()) in out
    assert ("prepacked oneDNN" in out) == any(plan.prepack.values())
    assert ("stream GEMV against it" in out) == bool(plan.stream_speedup)


def test_the_stream_gemv_is_measured_where_it_can_run(cache_dir: Path) -> None:
    from pdserve.engine.cpu_linear import stream_linear_available

    plan = cpu_choice.cpu_plan()
    if not stream_linear_available():
        assert plan.stream_rows == {} and "stream GEMV" not in plan.summary(torch.bfloat16)
        return
    speedups = plan.stream_speedup["bfloat16"]
    tried = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert set(speedups) == {str(r) for r in tried} and all(x > 0 for x in speedups.values())
    rows = plan.stream_rows["bfloat16"]
    # Used up to the last row count that won, and for no more rows than won in a row from 1.
    assert rows in (0, *tried) and all(speedups[str(r)] >= 1.05 for r in tried if r <= rows)
    if rows < tried[-1]:  # and it stopped at the first count that did not win
        first_loss = tried[tried.index(rows) + 1] if rows else tried[0]
        assert speedups[str(first_loss)] < 1.05
    assert "float32" not in plan.stream_rows  # a bf16 kernel
    assert ("stream GEMV up to" in plan.summary(torch.bfloat16)) == (rows > 0)


def test_a_plan_measured_with_the_kernels_off_is_measured_again_once_they_are_on(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pdserve.engine.cpu_linear import stream_linear_available

    if not stream_linear_available():
        pytest.skip("no stream GEMV in this build")
    plan = cpu_choice.cpu_plan()
    stored = json.loads(cpu_choice.cache_path().read_text())
    stored["stream_rows"], stored["stream_speedup"] = {}, {}  # what PDSERVE_CPU_KERNELS=0 leaves
    cpu_choice.cache_path().write_text(json.dumps(stored))
    cpu_choice.cpu_plan.cache_clear()
    again = cpu_choice.cpu_plan()
    assert "bfloat16" in again.stream_speedup and again.measured_at > plan.measured_at
