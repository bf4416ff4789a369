"""`pdserve profile`: a measured profile of a model here, usable by `pdserve sim` as it comes; a
roofline profile; the flags it refuses."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from pdserve.cli import main
from pdserve.sim import profile as profiles
from pdserve.sim import speed


def test_a_quick_measured_profile_drives_a_simulation(tmp_path: Path, tiny_llama: Path) -> None:
    out = tmp_path / "tiny.json"
    flags = ["--quick", "--no-serve", "--transports", "shm,tcp", "--dtype", "float32"]
    assert main(["profile", "--model", str(tiny_llama), *flags, "--out", str(out)]) == 0
    profile = profiles.load(out)
    assert profile.source == "measured" and profile.meta["device"] == "cpu"
    assert set(profile.steps) == {"prefill", "decode", "colocated"} and set(profile.transfers) == {
        "shm",
        "tcp",
    }
    assert profile.meta["samples"] > 10 and "date" in profile.meta and "machine" in profile.meta
    assert any("--no-serve" in a for a in profile.assumptions)
    assert profile.model_config().vocab_size == 320
    # The speed check ran beside the sweep, on its engine, and is kept to scale the profile by.
    reference = speed.reference(profile, str(out))
    assert reference.model == str(tiny_llama) and reference.dtype == "float32" and reference.threads == 1
    assert len(reference.steps) >= speed.MIN_PAIRS
    run = tmp_path / "run"
    code = main([
        "sim", "--profile", str(out), "--prefill", "1", "--decode", "1",
        "--workload", "poisson(2) prompt=fixed(100) output=fixed(20)", "--max-requests", "10", "--out", str(run),
    ])  # fmt: skip
    assert code == 0
    summary = json.loads((run / "summary.json").read_text())
    assert summary["overall"]["completed"] == 10


def test_a_speed_check_here_scales_a_profile_measured_here(
    tmp_path: Path, tiny_llama: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "tiny.json"
    flags = ["--quick", "--no-serve", "--no-neighbour", "--transports", "shm", "--dtype", "float32"]
    assert main(["profile", "--model", str(tiny_llama), *flags, "--out", str(out)]) == 0
    now = tmp_path / "check.json"
    assert (
        main(
            ["profile", "--model", str(tiny_llama), "--dtype", "float32", "--speed-check", "--out", str(now)]
        )
        == 0
    )
    check = speed.load(now)
    # The same steps as the profile's check (every one of them: the check does not depend on the
    # sweep's chunk), each timed.
    assert {step for step, _ in check.steps} == {
        step for step, _ in speed.reference(profiles.load(out), "").steps
    }
    assert all(seconds > 0 for _, seconds in check.steps)
    capsys.readouterr()
    run = ["sim", "--profile", str(out), "--colocated", "1", "--max-requests", "3", "--speed-check", str(now)]
    assert main([*run, "--workload", "constant(5) prompt=fixed(20) output=fixed(4)"]) == 0
    said = capsys.readouterr().err
    factor = float(said.split("as long as")[0].rsplit("x", 1)[1])
    assert 0.2 < factor < 5  # the same host, moments apart
    assert f"the median of {len(check.steps)} steps" in said


def test_flags_that_do_not_go_together_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = ["--out", str(tmp_path / "p.json")]
    assert main(["profile", *out]) == 2
    assert "give --model" in capsys.readouterr().err
    assert main(["profile", "--hardware", "h200", *out]) == 2
    assert "needs --hardware and --model-shape" in capsys.readouterr().err
    assert main(["profile", "--hardware", "h200", "--model-shape", "llama-3.1-8b", "--model", "x", *out]) == 2
    assert main(["profile", "--model", "smollm2-135m", "--threads", "0", *out]) == 2
    assert "--threads must be >= 1" in capsys.readouterr().err
    assert main(["profile", "--model", "smollm2-135m", "--transports", "shm,nixl", *out]) == 2
    assert "cannot measure nixl here" in capsys.readouterr().err
    assert main(["profile", "--from-trace", str(tmp_path / "t.jsonl"), *out]) == 2
    assert "--from-trace needs --base" in capsys.readouterr().err
    assert main(["profile", "--model", "smollm2-135m", "--served", "--no-serve", *out]) == 2
    assert main(["profile", "--model", "smollm2-135m", "--speed-check", "--served", *out]) == 2
    assert main(["profile", "--model", "smollm2-135m", "--speed-check", "--quick", *out]) == 2
    assert (
        main(["profile", "--hardware", "h200", "--model-shape", "llama-3.1-8b", "--speed-check", *out]) == 2
    )
    assert "--served runs a server" in capsys.readouterr().err
    # The served load's options, checked before minutes of sweeping.
    assert main(["profile", "--model", "smollm2-135m", "--served-workload", "chat", *out]) == 2
    assert "go with --served" in capsys.readouterr().err
    roofline = ["profile", "--hardware", "h200", "--model-shape", "llama-3.1-8b"]
    assert main([*roofline, "--served-rate-scale", "1", *out]) == 2
    assert "go with --served" in capsys.readouterr().err
    served = ["profile", "--model", "smollm2-135m", "--served", "--served-workload"]
    assert main([*served, "poisson(", *out]) == 2
    assert "--served-workload: " in capsys.readouterr().err
    assert main([*served, "concurrency(4) prompt=fixed(8) output=fixed(8)", *out]) == 2
    err = capsys.readouterr().err
    assert "--served-workload: a closed loop (concurrency(n)) has no rate to climb" in err
    assert main(["profile", "--model", "smollm2-135m", "--served", "--served-rate-scale", "0", *out]) == 2
    assert "--served-rate-scale must be > 0" in capsys.readouterr().err
    assert main(["profile", "--hardware", "h200", "--model-shape", "llama-3.1-8b", "--served", *out]) == 2
    assert "neither --model nor --served" in capsys.readouterr().err
    # A GPU profile: its steps on the GPU; the serving probes run CPU servers, so it says so.
    assert main(["profile", "--model", "smollm2-135m", "--device", "cuda", *out]) == 2
    assert "--device cuda measures the engine's steps on the GPU" in capsys.readouterr().err
    assert (
        main(["profile", "--model", "smollm2-135m", "--device", "cuda", "--served", "--no-serve", *out]) == 2
    )
    assert "--served runs a server" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_gpu_profile_without_a_gpu_is_refused_before_anything_is_measured(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], tiny_llama: Path
) -> None:
    out = tmp_path / "gpu.json"
    assert (
        main(["profile", "--model", str(tiny_llama), "--device", "cuda", "--no-serve", "--out", str(out)])
        == 2
    )
    assert "--device cuda: this torch sees no CUDA device" in capsys.readouterr().err
    assert not out.exists()
