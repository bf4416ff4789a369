"""`pdserve sim`: serve's deployment and bench's workload, in virtual time, with the router's own
admission, path choice, pools and planner. Hand-computable cases come out exactly; the output is
the bench's; the planner scales simulated pools; a run is reproducible."""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from test_sim_profile import fixed_profile

from pdserve.bench.workload import parse_workload
from pdserve.cli import main
from pdserve.sim import run as runner
from pdserve.sim.profile import HostCpu, Profile, ServedPull, TransferTime
from pdserve.sim.step_time import LinearStep


def sim(tmp_path: Path, profile: Profile, *flags: str) -> dict:  # type: ignore[type-arg]
    profile.save(tmp_path / "profile.json")
    out = tmp_path / "run"
    code = main(["sim", "--profile", str(tmp_path / "profile.json"), "--out", str(out), *flags])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    summary["records"] = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
    return summary


def chunk_times(record: dict) -> list[float]:  # type: ignore[type-arg]
    return [t - record["sent_s"] for t in record["chunk_times_s"]]


def test_one_request_on_a_colocated_worker_takes_exactly_the_profiles_time(tmp_path: Path) -> None:
    profile = fixed_profile(step=0.010, request_s=0.002, step_s=0.001)
    run = sim(
        tmp_path, profile, "--colocated", "1", "--workload", "constant(1) prompt=fixed(50) output=fixed(5)",
        "--max-requests", "1",
    )  # fmt: skip
    (record,) = run["records"]
    # A token leaves when its step ends; the worker loop's work (0.001) comes before the next step.
    expected = [0.002 + 0.010 + (0.010 + 0.001) * k for k in range(5)]
    assert chunk_times(record) == pytest.approx(expected, abs=1e-9)
    assert record["error"] is None and record["output_tokens"] == 5
    assert run["overall"]["completed"] == 1
    assert run["simulation"]["workers_started"] == 1
    assert (tmp_path / "run" / "ttft_cdf.png").exists() or list((tmp_path / "run").glob("*.png"))


def test_a_router_on_the_workers_host_stretches_their_steps(tmp_path: Path) -> None:
    # One CPU, and the router spends a whole CPU-second on the request: over the 2 s window that
    # is half the host, so every step within it takes twice as long.
    profile = replace(fixed_profile(step=0.010), host=HostCpu(cpus=1, router_request_s=1.0))
    run = sim(
        tmp_path, profile, "--colocated", "1", "--workload", "constant(1) prompt=fixed(50) output=fixed(3)",
        "--max-requests", "1",
    )  # fmt: skip
    (record,) = run["records"]
    assert chunk_times(record) == pytest.approx([0.020, 0.040, 0.060], abs=1e-9)


def test_workers_pinned_to_one_cpu_share_it(tmp_path: Path) -> None:
    # Two colocated workers decode a stream each at once. With a CPU each, every step takes the
    # profile's 10 ms; pinned to the one CPU of a one-CPU host, they take it in turns: 20 ms.
    def itls(cpus: int) -> list[float]:
        profile = replace(fixed_profile(step=0.010), host=HostCpu(cpus=cpus))
        run = sim(
            tmp_path, profile, "--colocated", "2", "--workload",
            "constant(1000) prompt=fixed(20) output=fixed(40)", "--max-requests", "2",
        )  # fmt: skip
        return [b - a for r in run["records"] for a, b in itertools.pairwise(chunk_times(r))]

    own_cpus, one_cpu = itls(2), itls(1)
    assert own_cpus == pytest.approx([0.010] * len(own_cpus))
    assert sorted(one_cpu)[len(one_cpu) // 2] == pytest.approx(0.020, rel=0.02)


def test_the_disaggregated_path_adds_the_prefill_step_and_the_pull(tmp_path: Path) -> None:
    profile = fixed_profile(step=0.010, per_token=1e-4, per_stream=1e-3, pull=0.004)
    run = sim(
        tmp_path, profile, "--prefill", "1", "--decode", "1", "--path-choice", "threshold",
        "--local-prefill-threshold", "64", "--workload", "constant(1) prompt=fixed(200) output=fixed(4)",
        "--max-requests", "1",
    )  # fmt: skip
    (record,) = run["records"]
    ttft = 0.010 + 1e-4 * 200  # the whole prompt in one step (of at most 256) on the prefill worker
    decode = 0.010 + 1e-3  # one stream on the decode worker
    expected = [ttft] + [ttft + 0.004 + decode * k for k in range(1, 4)]
    assert chunk_times(record) == pytest.approx(expected, abs=1e-9)
    # Fitted to served pulls over shm, the pull takes the served wait (6 ms alone) instead; a
    # deployment over tcp keeps the profile's line for tcp.
    # Its copy's own part (2 ms) is what TTFT's transfer part says; the wait around it holds the
    # stream back all the same.
    served = replace(
        profile,
        pulls={
            "decode": ServedPull(
                "shm",
                TransferTime(0.006, 0.0),
                TransferTime(0.009, 0.0),
                30,
                TransferTime(0.002, 0.0),
                TransferTime(0.003, 0.0),
            )
        },
    )
    for transport, pull, copy in (("shm", 0.006, 0.002), ("tcp", 0.004, 0.004)):
        run = sim(
            tmp_path / transport, served, "--prefill", "1", "--decode", "1", "--path-choice", "threshold",
            "--local-prefill-threshold", "64", "--workload", "constant(1) prompt=fixed(200) output=fixed(4)",
            "--max-requests", "1", "--transport", transport,
        )  # fmt: skip
        (record,) = run["records"]
        expected = [ttft] + [ttft + pull + decode * k for k in range(1, 4)]
        assert chunk_times(record) == pytest.approx(expected, abs=1e-9), transport
        assert run["ttft_parts"]["kv_transfer"]["mean_ms"] == pytest.approx(copy * 1000, abs=1e-3), transport


def test_a_conversation_s_next_turn_computes_only_what_the_cache_lacks(tmp_path: Path) -> None:
    profile = fixed_profile(step=0.010, per_token=1e-4)
    workload = "talk: poisson(1) prompt=fixed(200) output=fixed(4) turns=fixed(2) followup=fixed(20) think=fixed(1000)"
    flags = ("--colocated", "1", "--workload", workload, "--max-requests", "2")
    for cache, compute in (("--prefix-cache", 224 - 192), ("--no-prefix-cache", 224)):
        run = sim(tmp_path / cache, profile, *flags, cache)
        first, second = sorted(run["records"], key=lambda r: r["turn"])
        assert chunk_times(first) == pytest.approx([0.030, 0.040, 0.050, 0.060], abs=1e-9)
        # Sent a second after its answer ended, with the conversation so far (200 + 4) and 20 new
        # tokens; with the cache, 12 blocks of 16 (the prompt and the first 3 answer tokens'
        # KV, 203 tokens) are found, and only the last 32 tokens are computed.
        assert second["sent_s"] == pytest.approx(first["chunk_times_s"][-1] + 1.0, abs=1e-9)
        assert second["prompt_tokens"] == 224 and second["session"] == first["session"]
        assert chunk_times(second)[0] == pytest.approx(0.010 + 1e-4 * compute, abs=1e-9)
    assert run["turns"]["2"]["completed"] == 1


def test_steps_spread_around_their_fit_as_the_profile_s_measured_steps_did(tmp_path: Path) -> None:
    fitted = LinearStep((0.010, 0.0, 0.0, 0.0, 0.0), median_error=0.1)
    profile = replace(fixed_profile(), steps={"prefill": fitted, "decode": fitted})
    flags = (
        "--colocated",
        "1",
        "--workload",
        "constant(1) prompt=fixed(10) output=fixed(400)",
        "--max-requests",
        "1",
    )
    (record,) = sim(tmp_path / "a", profile, *flags)["records"]
    gaps = [b - a for a, b in itertools.pairwise(record["chunk_times_s"])]
    errors = sorted(abs(math.log(gap / 0.010)) for gap in gaps)
    assert 0.08 < errors[len(errors) // 2] < 0.12  # the median relative error, as measured
    assert sim(tmp_path / "b", profile, *flags)["records"][0]["chunk_times_s"] == record["chunk_times_s"]


def test_log_lines_come_at_serve_s_level_stamped_in_simulated_seconds(tmp_path: Path) -> None:
    fixed_profile(step=0.010).save(tmp_path / "p.json")
    command = [
        sys.executable, "-m", "pdserve.cli", "sim", "--profile", str(tmp_path / "p.json"), "--prefill", "1",
        "--decode", "1", "--workload", "constant(1) prompt=fixed(200) output=fixed(4)", "--max-requests", "2",
        "--log-level", "DEBUG",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    lines = [x for x in done.stderr.splitlines() if "prefill of 200 tokens" in x]
    assert len(lines) == 2 and all(
        re.match(r"t=\s*[0-9.]+ DEBUG pdserve\.router\.dispatch: ", x) for x in lines
    )
    quiet = subprocess.run(command[:-2], capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0 and "DEBUG" not in quiet.stderr  # INFO by default, as serve


def test_an_overloaded_deployment_queues_and_a_duration_bounds_the_run(tmp_path: Path) -> None:
    # 10 requests a second of 100-token prompts at 50 ms a step: the one worker cannot keep up.
    profile = fixed_profile(step=0.05, per_token=1e-3)
    run = sim(
        tmp_path, profile, "--colocated", "1", "--workload", "poisson(10) prompt=fixed(100) output=fixed(20)",
        "--duration", "20", "--finish-timeout", "5", "--slo", "ttft=500,itl=200",
    )  # fmt: skip
    records = run["records"]
    assert all(r["sent_s"] < 20 for r in records)
    late = [r for r in records if r["error"] and "cancelled" in r["error"]]
    assert late, "requests still queued 5 s after the last was sent are cut off, as the bench does"
    assert run["overall"]["ttft_ms"]["p90"] > 1000  # queued: far over the SLO
    assert run["overall"]["goodput"] == 0.0  # not one request within its TTFT SLO


def test_the_planner_scales_the_decode_pool_when_its_itl_goes_over_the_slo(tmp_path: Path) -> None:
    # Each decode stream adds 4 ms to a step: ~20 streams put the ITL over its 60 ms SLO.
    profile = fixed_profile(step=0.005, per_token=2e-5, per_stream=0.004, start_s=5.0)
    run = sim(
        tmp_path, profile, "--prefill", "1", "--decode", "1", "--planner", "slo", "--max-workers", "6",
        "--slo", "ttft=2000,itl=60", "--workload", "poisson(2) step(30,60,5) prompt=fixed(200) output=fixed(100)",
        "--duration", "100", "--planner-interval", "5", "--pool-sample-interval", "5",
    )  # fmt: skip
    assert run["simulation"]["workers_started"] > 2
    decode_active = [s["pools"]["decode"]["active"] for s in run["timeline"]["pool_samples"]]
    assert max(decode_active) > 1
    assert decode_active[0] == 1


def test_a_simulation_is_reproducible(tmp_path: Path) -> None:
    profile = fixed_profile(step=0.01, per_token=1e-4, per_stream=1e-3, pull=0.002)
    flags = ("--prefill", "1", "--decode", "1", "--workload", "chat", "--max-requests", "40", "--seed", "3")
    first = sim(tmp_path / "a", profile, *flags)
    second = sim(tmp_path / "b", profile, *flags)
    assert first["records"] == second["records"]


def test_bad_input_is_said_plainly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = fixed_profile()
    profile.save(tmp_path / "p.json")
    assert main(["sim", "--profile", str(tmp_path / "p.json"), "--colocated", "1"]) == 2
    assert "give --max-requests or --duration" in capsys.readouterr().err
    flags = ["sim", "--profile", str(tmp_path / "p.json"), "--max-requests", "1"]
    assert main([*flags, "--prefill", "1", "--decode", "1", "--transport", "nixl"]) == 2
    assert "no transfer time for --transport nixl" in capsys.readouterr().err
    assert main([*flags, "--colocated", "1", "--prefill", "1"]) == 2
    assert "either --colocated N or --prefill P --decode D" in capsys.readouterr().err
    assert main([*flags, "--colocated", "1", "--timeline-window", "0"]) == 2
    assert "--timeline-window must be" in capsys.readouterr().err
    assert (
        main(["sim", "--profile", str(tmp_path / "none.json"), "--max-requests", "1", "--colocated", "1"])
        == 2
    )
    assert "cannot read the profile" in capsys.readouterr().err


def test_workloads_in_sequence_run_on_one_deployment_each_reported_apart(tmp_path: Path) -> None:
    # As bench compare runs its rates on one server: the second load starts on the pools the
    # first left (here the decode pool the planner grew), and each is reported on its own: its
    # requests, its clock, its workers started, its prompts by path.
    profile = fixed_profile(step=0.005, per_token=2e-5, per_stream=0.004, start_s=5.0)
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    args = parser.parse_args(
        ["--profile", "unused", "--prefill", "1", "--decode", "1", "--planner", "slo", "--max-workers", "6",
         "--slo", "ttft=2000,itl=60", "--planner-interval", "5"]
    )  # fmt: skip
    o = runner.resolve(args, profile)
    heavy = parse_workload("poisson(10) prompt=fixed(200) output=fixed(100)", 0, None, 60.0, 1.0)
    light = parse_workload("poisson(1) prompt=fixed(200) output=fixed(100)", 1, None, 20.0, 1.0)
    first, second = runner.simulate_in_sequence(o, profile, [heavy, light], pool_sample_interval_s=5.0)
    assert len(first.records) == len(heavy.requests) and len(second.records) == len(light.requests)
    assert all(r.ok for r in first.records + second.records)
    assert min(r.sent_s for r in second.records) < 2.0  # its own clock, from its first request
    assert first.workers_started > 2 and second.workers_started == 0
    assert second.pool_samples[0]["pools"]["decode"]["active"] > 1
    assert sum(second.server["paths"].values()) == len(light.requests)
    alone = runner.simulate(o, profile, light, pool_sample_interval_s=5.0)
    assert alone.pool_samples[0]["pools"]["decode"]["active"] == 1


def test_another_noise_seed_draws_the_steps_anew_on_the_same_load(tmp_path: Path) -> None:
    # A trace replay is the same load on every run: what varies between its runs is how the steps
    # come out, and `plan --repeats` draws that anew for each run (noise_seed), reproducibly.
    step = LinearStep((0.01, 1e-4, 0.0, 1e-3, 0.0), median_error=0.05)
    profile = replace(fixed_profile(), steps={"prefill": step, "decode": step})
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    o = runner.resolve(parser.parse_args(["--profile", "unused", "--colocated", "1"]), profile)
    load = parse_workload("poisson(5) prompt=fixed(64) output=fixed(16)", 0, 30, None, 1.0)

    def gaps(noise_seed: int) -> list[float]:
        result = runner.simulate(o, profile, load, pool_sample_interval_s=0, noise_seed=noise_seed)
        return [g for r in sorted(result.records, key=lambda r: r.index) for g in r.itls]

    assert gaps(1) == gaps(1) and gaps(0) == gaps(0)
    assert gaps(1) != gaps(0)
    # `pdserve sim --noise-seed` picks the draw: the CLI's run is the same as the function's.
    profile.save(tmp_path / "noisy.json")
    cli = ["sim", "--profile", str(tmp_path / "noisy.json"), "--colocated", "1", "--max-requests", "30"]
    cli += ["--workload", "poisson(5) prompt=fixed(64) output=fixed(16)", "--seed", "0"]
    for seed in (0, 1):
        assert main([*cli, "--noise-seed", str(seed), "--out", str(tmp_path / f"draw-{seed}")]) == 0
        records = [
            json.loads(line)
            for line in (tmp_path / f"draw-{seed}" / "records.jsonl").read_text().splitlines()
        ]
        chunks = [r["chunk_times_s"] for r in sorted(records, key=lambda r: r["index"])]
        cli_gaps = [b - a for times in chunks for a, b in itertools.pairwise(times)]
        assert cli_gaps == pytest.approx(gaps(seed), abs=1e-9)
        summary = json.loads((tmp_path / f"draw-{seed}" / "summary.json").read_text())
        assert summary["simulation"]["noise_seed"] == seed
