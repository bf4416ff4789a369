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

from pdserve.engine.factory import pick_dtype
from pdserve.ops.cpu import isa as cpu_isa
from pdserve.ops.cpu import kernels as cpu_kernels
from pdserve.ops.cpu import plan as cpu_choice


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
    # bf16 is measured where oneDNN runs it; elsewhere the plan says why it is not.
    assert "float32" in plan.gflops and all(r > 0 for r in plan.gflops["float32"].values())
    assert ("bfloat16" in plan.gflops) != ("bfloat16 matmul" in plan.unavailable)
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
    assert ("stream GEMV" in out) == bool(plan.stream_speedup)
    for what, why in plan.unavailable.items():
        assert f"{what}: unavailable — {why}" in out
    assert "Traceback" not in out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_stream_gemv_is_measured_where_it_can_run(cache_dir: Path, dtype: torch.dtype) -> None:
    from pdserve.ops.cpu.linear import stream_linear_available, stream_linear_f32_available

    name = str(dtype).removeprefix("torch.")
    plan = cpu_choice.cpu_plan()
    available = stream_linear_available if dtype == torch.bfloat16 else stream_linear_f32_available
    recorded = any(what.startswith(f"{name} stream GEMV") for what in plan.unavailable)
    if not available() or name not in plan.gflops or recorded:
        assert name not in plan.stream_rows and "stream GEMV up to" not in plan.summary(dtype)
        assert (
            any(what.startswith(f"{name} stream GEMV") for what in plan.unavailable)
            or name not in plan.gflops
        )
        return
    tried = (1, 2, 4, 8, 16, 32, 64, 128, 256)

    def used_up_to_the_last_win(speedups: dict[str, float], rows: int, limit: int) -> None:
        """Used up to the last row count that won, for no more rows than won in a row from 1, and
        measured up to the first count that did not win (or `limit`), no further."""
        assert all(x > 0 for x in speedups.values())
        assert rows in (0, *tried) and all(speedups[str(r)] >= 1.05 for r in tried if r <= rows)
        if rows < limit:
            first_loss = tried[tried.index(rows) + 1] if rows else tried[0]
            assert speedups[str(first_loss)] < 1.05
            assert set(speedups) == {str(r) for r in tried if r <= first_loss}
        else:
            assert set(speedups) == {str(r) for r in tried if r <= limit}

    # The layers' projections; then the logits' weight apart, up to the layers' rows at most.
    rows = plan.stream_rows[name]
    used_up_to_the_last_win(plan.stream_speedup[name], rows, tried[-1])
    if rows == 0:
        assert name not in plan.logits_stream_speedup and name not in plan.logits_stream_rows
    else:
        used_up_to_the_last_win(plan.logits_stream_speedup[name], plan.logits_stream_rows[name], rows)
    logits = plan.logits_stream_rows.get(name, 0)
    assert ("stream GEMV up to" in plan.summary(dtype)) == (rows > 0)
    if rows:
        assert (f"the logits' up to {logits}" if logits else "the logits' never") in plan.summary(dtype)


def test_a_plan_measured_with_the_kernels_off_is_measured_again_once_they_are_on(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = cpu_choice.cpu_plan()
    if not plan.stream_speedup:
        pytest.skip("no stream GEMV in this build")
    stored = json.loads(cpu_choice.cache_path().read_text())
    for key in ("stream_rows", "stream_speedup", "logits_stream_rows", "logits_stream_speedup"):
        stored[key] = {}  # what PDSERVE_CPU_KERNELS=0 leaves
    cpu_choice.cache_path().write_text(json.dumps(stored))
    cpu_choice.cpu_plan.cache_clear()
    again = cpu_choice.cpu_plan()
    assert set(again.stream_speedup) == set(plan.stream_speedup) and again.measured_at > plan.measured_at
    assert set(again.logits_stream_rows) == {name for name, rows in again.stream_rows.items() if rows > 0}


@pytest.fixture
def quick(monkeypatch: pytest.MonkeyPatch) -> None:
    """A measurement of a few seconds: fewer weights and stream row counts (the choices' logic is
    the same; only the timings are coarser)."""
    monkeypatch.setattr(cpu_choice, "_WEIGHTS", 2)
    monkeypatch.setattr(cpu_choice, "_STREAM_LAYERS", 1)
    monkeypatch.setattr(cpu_choice, "_LOGITS_SHAPE", (4096, 576))
    monkeypatch.setattr(cpu_choice, "_STREAM_ROWS", (1, 2))


def boom(message: str):  # type: ignore[no-untyped-def]
    def fail(*args: object, **kwargs: object) -> None:
        raise RuntimeError(message)

    return fail


AVX2_ONLY = cpu_isa.CpuIsa("EPYC", ("avx2", "fma"), "avx2", None)


def test_a_failing_prepack_is_recorded_and_the_plan_takes_f_linear(
    quick: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What an AVX2-only CPU did in bf16: oneDNN refused the reorder (issue 29).
    message = "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw"
    monkeypatch.setattr(cpu_choice, "pack_weight", boom(message))
    plan = cpu_choice.measure()
    for dtype in plan.gflops:
        assert plan.prepack[dtype] is False and plan.prepack_speedup[dtype] == {}
        assert plan.unavailable[f"{dtype} prepack"] == f"RuntimeError: {message}"
    assert all(rate > 0 for rate in plan.gflops["float32"].values())


def test_a_prepack_that_computes_garbage_is_not_taken(quick: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_choice, "packed_linear", lambda x, w, b: torch.zeros(x.shape[0], w.shape[0]))
    monkeypatch.setattr(cpu_choice, "pack_weight", lambda w: w)
    plan = cpu_choice.measure(AVX2_ONLY)
    assert (
        plan.prepack["float32"] is False and "computed something else" in plan.unavailable["float32 prepack"]
    )


@pytest.mark.parametrize("where", ["available", "measure"])
def test_a_failing_stream_probe_is_recorded_and_the_stream_is_not_used(
    quick: None, monkeypatch: pytest.MonkeyPatch, where: str, tmp_path: Path
) -> None:
    from pdserve.ops.cpu.linear import stream_linear_f32_available

    if where == "available":
        monkeypatch.setattr(cpu_choice, "stream_linear_f32_available", boom("no such op"))
    elif not stream_linear_f32_available():
        pytest.skip("no fp32 stream GEMV in this build: nothing to fail while measuring")
    else:
        monkeypatch.setattr(cpu_choice, "stream_linear_f32", boom("illegal instruction, say"))
    plan = cpu_choice.measure(AVX2_ONLY)
    key = "float32 stream GEMV (bf16 weights)"
    assert "RuntimeError" in plan.unavailable[key] and plan.stream_rows.get("float32", 0) == 0
    assert "float32" not in plan.stream_speedup and "stream GEMV up to" not in plan.summary(torch.float32)
    # Cached, such a plan is read back as it is: not measured (and failing) again at every start.
    path = tmp_path / "cpu_plan.json"
    path.write_text(json.dumps(cpu_choice.asdict(plan)))
    assert cpu_choice._read(path, AVX2_ONLY) == plan


def test_without_the_kernels_the_stream_says_why(quick: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu_choice, "stream_linear_f32_available", lambda: False)
    monkeypatch.setattr(cpu_choice, "kernel_isa", lambda: None)
    plan = cpu_choice.measure(AVX2_ONLY)
    assert plan.unavailable["float32 stream GEMV (bf16 weights)"].startswith(
        "the C++ kernels are unavailable"
    )


def test_an_avx2_level_plan_measures_no_bf16_and_says_why(quick: None) -> None:
    # What an AVX2-only CPU, or PDSERVE_CPU_ISA=avx2 on any CPU, gets: fp32, and the reasons.
    plan = cpu_choice.measure(AVX2_ONLY)
    assert plan.auto_dtype == "float32" and set(plan.gflops) == {"float32"}
    assert plan.unavailable["bfloat16 prepack"] == "oneDNN needs AVX512-BW/VL/DQ or AVX-NE-CONVERT"
    assert "emulated" in plan.unavailable["bfloat16 matmul"]
    assert plan.flags == ["avx2", "fma"] and plan.isa == "avx2"
    assert "unavailable here: bfloat16 matmul" in plan.summary()


def test_the_cache_is_keyed_by_the_cap_and_a_foreign_plan_is_measured_again(
    cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("PDSERVE_CPU_ISA", raising=False)
    plan = cpu_choice.cpu_plan()
    native = cpu_choice.cache_path()
    monkeypatch.setenv("PDSERVE_CPU_ISA", "avx2")
    capped = cpu_choice.cache_path()
    assert capped != native and capped.parent == native.parent
    # The native plan copied under the capped key is not read as the capped one, nor the reverse.
    capped.write_text(native.read_text())
    isa = cpu_isa.probe()
    assert cpu_choice._read(capped, isa) is None
    # foreign by its cap (on a CPU the cap takes flags from, by its flags first)
    assert any(key in cpu_choice._foreign(plan, isa) for key in ("isa cap", "flags"))
    stored = json.loads(native.read_text())
    monkeypatch.delenv("PDSERVE_CPU_ISA")
    isa = cpu_isa.probe()
    for key, value in [("torch_version", "1.0"), ("model", "another CPU"), ("plan_version", 1)]:
        assert cpu_choice._read(native, isa) is not None
        native.write_text(json.dumps({**stored, key: value}))
        assert cpu_choice._read(native, isa) is None, key
        native.write_text(json.dumps(stored))
    for broken in (
        {**stored, "gflops": {}},
        {**stored, "gflops": [1.0]},
        {**stored, "stream_rows": {"float32": -1}},
        {**stored, "logits_stream_rows": {"float32": -1}},
        {**stored, "logits_stream_speedup": {"float32": [1.2]}},
        {**stored, "extra": 1},
    ):
        native.write_text(json.dumps(broken))
        assert cpu_choice._read(native, isa) is None


def test_a_failing_matmul_is_recorded_and_never_chosen(quick: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # A CPU said to have AVX-512 (so bf16 is tried) whose bf16 matmul fails: as if oneDNN refused it.
    import types

    import torch.nn.functional as F

    def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        if x.dtype == torch.bfloat16:
            raise RuntimeError("could not create a primitive")
        return F.linear(x, w, b)

    monkeypatch.setattr(cpu_choice, "F", types.SimpleNamespace(linear=linear, pad=F.pad))
    monkeypatch.setattr(cpu_choice, "pack_weight", lambda w: w)  # no oneDNN reorder to refuse first
    monkeypatch.setattr(cpu_choice, "packed_linear", lambda x, w, b: linear(x, w, b))
    flags = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16")
    isa = cpu_isa.CpuIsa("Xeon", flags, "avx512_bf16", None)
    plan = cpu_choice.measure(isa)
    assert plan.unavailable["bfloat16 matmul"] == "RuntimeError: could not create a primitive"
    assert "bfloat16" not in plan.gflops and plan.auto_dtype == "float32"
    # Where bf16 is native, float32 asked for is float32 weights: no bf16-stored stream.
    assert plan.unavailable["float32 stream GEMV (bf16 weights)"] == cpu_choice._NATIVE_BF16
    assert "float32" not in plan.stream_rows
    assert cpu_choice._foreign(plan, isa) == ""  # and such a plan, cached, is read back as it is
