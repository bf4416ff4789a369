"""A served run's step trace read against its profile: the run's speed, its prompt work's own, and
how the host's speed moved over the run, replayed in a simulation window by window."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_sim_profile import fixed_profile

from pdserve.cli import main
from pdserve.costmodel import Step
from pdserve.sim import speed
from pdserve.sim.profile import HostCpu
from pdserve.sim.speed import SpeedCheck
from pdserve.sim.step_time import LinearStep, ProfileError, Spread, StreamPasses
from pdserve.sim.trace_speed import MIN_KIND_STEPS, SpeedCourse, speed_course, trace_speed


def served_profile(tmp_path: Path, **changes: float) -> Path:
    served = replace(fixed_profile(**changes), steps_from="serving")  # type: ignore[arg-type]
    served.save(tmp_path / "served.json")
    return tmp_path / "served.json"


def by_trace(run: list[str], profile: Path, trace: Path, out: Path) -> Path:
    """`pdserve sim` of `run` with `profile` scaled by `trace`, into `out`."""
    assert main([*run, "--profile", str(profile), "--speed-trace", str(trace), "--out", str(out)]) == 0
    return out


def test_a_served_runs_step_trace_says_the_hosts_speed_while_it_served(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A run on a host twice as slow as the profile, its prompt work 1.5 times and its mixed steps
    # (a decode worker's local chunks beside its streams) 2.5 times (simulated: the profile scaled
    # so), traces its steps; read against the profile, the trace says x2, x1.5 and x2.5, and a
    # simulation scaled by it runs at the slow host's pace.
    served_path = served_profile(tmp_path, step=0.010, per_token=1e-4, per_stream=2e-3)
    served = fixed_profile(step=0.010, per_token=1e-4, per_stream=2e-3)
    served = replace(served, steps_from="serving")
    speed.scaled(served, 2.0, prompt=1.5, mixed=2.5).save(tmp_path / "slow.json")
    workload = [
        "--workload",
        "poisson(20) prompt=uniform(20,200) output=uniform(2,20)",
        "--max-requests",
        "60",
    ]
    trace = tmp_path / "steps.jsonl"
    run = ["sim", "--prefill", "1", "--decode", "1", *workload, "--seed", "3"]
    assert main([*run, "--profile", str(tmp_path / "slow.json"), "--step-trace", str(trace)]) == 0
    traced = trace_speed(served, [trace])
    assert traced.factor == pytest.approx(2.0)  # most steps are the decode worker's
    assert traced.prompt == pytest.approx(1.5)  # the prefill worker's, prompt-only
    assert traced.steps == len(trace.read_text().splitlines()) >= speed.MIN_PAIRS
    assert traced.prompt_steps >= MIN_KIND_STEPS
    out = by_trace(run, served_path, trace, tmp_path / "scaled")
    simulation = json.loads((out / "summary.json").read_text())["simulation"]
    assert simulation["speed_factor"] == pytest.approx(2.0)
    assert simulation["speed_factor_prompt"] == pytest.approx(1.5)
    assert simulation["speed_window_s"] is None
    err = capsys.readouterr().err
    assert "took x2.000 the profile's fit" in err and "prompt-only steps x1.500" in err
    # Simulated so, the slow host's run comes out again: the same requests' first tokens.
    again = tmp_path / "slow-run"
    assert main([*run, "--profile", str(tmp_path / "slow.json"), "--out", str(again)]) == 0
    ttfts = [
        [json.loads(line)["chunk_times_s"][0] for line in (path / "records.jsonl").read_text().splitlines()]
        for path in (out, again)
    ]
    assert ttfts[0] == pytest.approx(ttfts[1], rel=1e-6)
    # Colocated workers run chunks beside their streams: on a host where those steps took x2.5 and
    # the rest x2, they read x2.5, and scaled so, the simulation runs at that host's pace again.
    speed.scaled(served, 2.0, mixed=2.5).save(tmp_path / "slow-mixed.json")
    colocated = ["sim", "--colocated", "2", *workload, "--seed", "3"]
    trace_colocated = tmp_path / "colocated.jsonl"
    slow = [*colocated, "--profile", str(tmp_path / "slow-mixed.json")]
    assert main([*slow, "--step-trace", str(trace_colocated), "--out", str(tmp_path / "slow-colocated")]) == 0
    traced = trace_speed(served, [trace_colocated])
    assert (traced.factor, traced.mixed) == pytest.approx((2.0, 2.5)) and traced.mixed_steps >= 3
    again = [*colocated, "--profile", str(served_path), "--speed-trace", str(trace_colocated)]
    assert main([*again, "--out", str(tmp_path / "scaled-colocated")]) == 0
    assert "mixed steps x2.500" in capsys.readouterr().err
    summaries = [
        json.loads((tmp_path / name / "summary.json").read_text())
        for name in ("slow-colocated", "scaled-colocated")
    ]
    assert summaries[1]["simulation"]["speed_factor_mixed"] == pytest.approx(2.5)
    assert summaries[1]["overall"]["itl_ms"] == pytest.approx(summaries[0]["overall"]["itl_ms"], rel=1e-6)
    # A sweep's profile leaves the router's CPU out of its steps: a served trace cannot scale it.
    with pytest.raises(ProfileError, match="only scale a profile fitted to served steps"):
        trace_speed(replace(served, steps_from="alone"), [trace])
    # Too few steps of the profile's roles, or both ways of saying the speed: refused.
    (tmp_path / "short.jsonl").write_text("\n".join(trace.read_text().splitlines()[:3]) + "\n")
    with pytest.raises(ProfileError, match="at least 8"):
        trace_speed(served, [tmp_path / "short.jsonl"])
    SpeedCheck("tiny", "cpu", "float32", 1, ()).save(tmp_path / "now.json")
    both = ["--speed-trace", str(trace), "--speed-check", str(tmp_path / "now.json")]
    assert main([*run, "--profile", str(served_path), *both]) == 2
    assert "give one" in capsys.readouterr().err


def test_a_trace_reads_prompts_on_the_gemm_apart_from_those_on_the_stream_gemv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The two kernels move apart with the host: a prefill worker's short prompts (the stream
    # GEMV's passes) at 0.86-0.90 of the fit, its long ones' chunks (a GEMM) at 0.90-0.98, at a
    # DPD knee on the AVX512 EPYC; by the short ones' factor the documents' prefill came 16% short.
    # A host where the short prompts took x1.5 and the long x1.8 reads so, and its run comes out
    # again from the trace.
    gemv = LinearStep(
        (0.010, 1e-4, 0.0, 2e-3, 0.0), passes=StreamPasses(8, 128, 32), pass_coefficients=(0.004, 0.01, 0.0)
    )
    served = replace(fixed_profile(), steps={"prefill": gemv, "decode": gemv}, steps_from="serving")
    served.save(tmp_path / "served.json")
    speed.scaled(served, 2.0, prompt=1.5, gemm=1.8).save(tmp_path / "slow.json")
    run = ["sim", "--prefill", "1", "--decode", "1", "--seed", "3", "--max-requests", "80"]
    run += ["--workload", "poisson(4) prompt=uniform(20,300) output=uniform(2,20)"]
    trace = tmp_path / "steps.jsonl"
    slow = tmp_path / "slow-run"
    assert (
        main([*run, "--profile", str(tmp_path / "slow.json"), "--step-trace", str(trace), "--out", str(slow)])
        == 0
    )
    traced = trace_speed(served, [trace])
    assert (traced.factor, traced.prompt, traced.gemm) == pytest.approx((2.0, 1.5, 1.8))
    assert traced.gemm_steps >= MIN_KIND_STEPS and traced.prompt_steps >= MIN_KIND_STEPS
    out = by_trace(run, tmp_path / "served.json", trace, tmp_path / "scaled")
    assert "on the GEMM x1.800" in capsys.readouterr().err
    summaries = [json.loads((path / "summary.json").read_text()) for path in (slow, out)]
    assert summaries[1]["simulation"]["speed_factor_gemm"] == pytest.approx(1.8)
    assert summaries[1]["overall"]["ttft_ms"] == pytest.approx(summaries[0]["overall"]["ttft_ms"], rel=1e-6)
    # Too few prompts on the GEMM for a factor of their own: they count with the others.
    few = tmp_path / "few.jsonl"
    rows = trace.read_text().splitlines()
    gemm_rows = [
        r for r in rows if json.loads(r)["prefill_tokens"] > 128 and not json.loads(r)["decode_streams"]
    ]
    few.write_text(
        "\n".join([r for r in rows if r not in gemm_rows] + gemm_rows[: MIN_KIND_STEPS - 1]) + "\n"
    )
    folded = trace_speed(served, [few])
    assert folded.gemm is None and folded.gemm_steps == 0
    assert folded.prompt_steps == traced.prompt_steps + MIN_KIND_STEPS - 1
    assert folded.prompt == pytest.approx(1.5)  # their median: most of them are the GEMV's


def test_each_pool_of_a_trace_reads_its_own_prompts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A decode worker's local prompts and a prefill worker's do not run alike against the fit (one
    # DPD run: 1.22 and 0.87); by their one median the prefill worker's prompt steps ran 35% slow. A host
    # where the decode pool's prompts took x2.5 and the prefill pool's x1.5 reads so, pool by
    # pool, and its run comes out again from the trace.
    served = replace(fixed_profile(step=0.010, per_token=1e-4, per_stream=2e-3), steps_from="serving")
    served.save(tmp_path / "served.json")
    slow = speed.scaled(served, 2.0, prompt=1.5, by_role={"decode": (2.0, 2.5, None, None)})
    assert slow.meta["speed_factors_by_role"] == {"decode": [2.0, 2.5, None, None]}
    slow.save(tmp_path / "slow.json")
    run = ["sim", "--prefill", "1", "--decode", "1", "--seed", "3", "--max-requests", "120"]
    run += ["--workload", "poisson(3) prompt=uniform(20,200) output=uniform(2,6)"]
    run += ["--path-choice", "threshold", "--local-prefill-threshold", "110"]  # the short ones local
    trace, measured = tmp_path / "steps.jsonl", tmp_path / "slow-run"
    assert (
        main(
            [
                *run,
                "--profile",
                str(tmp_path / "slow.json"),
                "--step-trace",
                str(trace),
                "--out",
                str(measured),
            ]
        )
        == 0
    )
    traced = trace_speed(served, [trace])
    assert set(traced.pools) == {"prefill", "decode"}
    # The prefill pool has no decode steps: their factor is the run's.
    assert traced.pools["prefill"].kinds() == pytest.approx((2.0, 1.5, None, None))
    assert traced.pools["decode"].kinds() == pytest.approx((2.0, 2.5, None, None))
    assert 1.5 <= traced.prompt <= 2.5  # the run's, both pools' together
    out = by_trace(run, tmp_path / "served.json", trace, tmp_path / "scaled")
    assert "its decode pool's" in capsys.readouterr().err
    simulation = json.loads((out / "summary.json").read_text())["simulation"]
    assert simulation["speed_factors_by_role"]["decode"] == pytest.approx([2.0, 2.5, None, None])
    ttfts = [
        [json.loads(line)["chunk_times_s"][0] for line in (path / "records.jsonl").read_text().splitlines()]
        for path in (measured, out)
    ]
    assert ttfts[0] == pytest.approx(ttfts[1], rel=1e-6)


GEMV_LINE = LinearStep(
    (0.010, 1e-4, 0.0, 2e-3, 0.0), passes=StreamPasses(8, 128, 32), pass_coefficients=(0.004, 0.01, 0.0)
)
SHORT, LONG, ONE_STREAM = Step(64, 2080, 0, 0), Step(300, 45150, 0, 0), Step(0, 0, 1, 100)


def hand_trace(path: Path, pools: dict[str, list[tuple[Step, float, float]]]) -> None:
    """Each pool's steps (step, its time over GEMV_LINE's, when) as a served trace writes them."""
    rows = []
    for pool, steps in pools.items():
        for step, ratio, t in steps:
            fields = {
                "prefill_tokens": step.prefill_tokens,
                "prefill_attention": step.prefill_attention,
                "decode_streams": step.decode_streams,
                "decode_context": step.decode_context,
            }
            rows.append(
                {"t_s": t, "worker": f"{pool}-0", "pool": pool, "seconds": ratio * GEMV_LINE.seconds(step)}
                | fields
                | {"loop_seconds": 0.0, "pull_wait_seconds": 0.0, "pull_blocks": 0, "pull_seconds": 0.0}
            )
    path.write_text("".join(json.dumps(row) + "\n" for row in sorted(rows, key=lambda r: r["t_s"])))


def test_a_pool_with_few_prompts_of_a_kind_takes_the_runs(tmp_path: Path) -> None:
    # The prefill pool's prompts read x1.5 on the GEMV and x1.8 on the GEMM; the decode pool has
    # 5 and 10 of its own (at x3), too few for either: both at the run's, the GEMM's included.
    served = replace(fixed_profile(), steps={"prefill": GEMV_LINE, "decode": GEMV_LINE}, steps_from="serving")
    times = iter(range(10_000))
    trace = tmp_path / "steps.jsonl"
    prefill = [(SHORT, 1.5, next(times)) for _ in range(30)] + [(LONG, 1.8, next(times)) for _ in range(30)]
    decode = [(ONE_STREAM, 2.0, next(times)) for _ in range(40)]
    few = [(SHORT, 3.0, next(times)) for _ in range(5)] + [(LONG, 3.0, next(times)) for _ in range(10)]
    hand_trace(trace, {"prefill": prefill, "decode": decode + few})
    traced = trace_speed(served, [trace])
    assert (traced.factor, traced.prompt, traced.gemm) == pytest.approx((2.0, 1.5, 1.8))
    assert traced.pools["decode"].kinds() == pytest.approx((2.0, 1.5, None, 1.8))
    assert traced.pools["prefill"].kinds() == pytest.approx((2.0, 1.5, None, 1.8))
    # Enough of both together (15 + 10): the pool's own prompts, its GEMM steps among them.
    more = [(SHORT, 3.0, next(times)) for _ in range(15)] + [(LONG, 3.0, next(times)) for _ in range(10)]
    hand_trace(trace, {"prefill": prefill, "decode": decode + more})
    assert trace_speed(served, [trace]).pools["decode"].kinds() == pytest.approx((2.0, 3.0, None, None))


def test_a_window_reads_a_pools_few_gemm_steps_with_its_prompts(tmp_path: Path) -> None:
    # Three GEMM prompts, all in a stall (x2), among 30 prompts on the GEMV at the fit: as a kind
    # of their own they would be their own pace (x1); with the prompts, the window reads the stall.
    served = replace(fixed_profile(), steps={"prefill": GEMV_LINE}, steps_from="serving")
    steps = [(SHORT, 1.0, 0.5 + k / 3) for k in range(30)] + [(LONG, 2.0, 10.5 + k / 3) for k in range(3)]
    hand_trace(tmp_path / "steps.jsonl", {"prefill": steps})
    course = speed_course(served, [tmp_path / "steps.jsonl"], 5.0)
    assert course.factors["prefill"][-1] > 1.5


def test_a_trace_of_the_profiles_own_spread_reads_x1(tmp_path: Path) -> None:
    # Served steps spread around their fit with a right tail, their median under it (the fit is of
    # the relative error): a run that steps as the profile draws them reads x1, not that median.
    band = Spread(None, (0.8, 0.85, 0.88, 0.9, 0.92, 0.95, 1.2, 2.0))
    line = LinearStep((0.010, 1e-4, 0.0, 2e-3, 0.0), spread=(band,))
    served = replace(fixed_profile(), steps={"prefill": line, "decode": line}, steps_from="serving")
    served.save(tmp_path / "served.json")
    trace = tmp_path / "steps.jsonl"
    run = [
        "sim",
        "--profile",
        str(tmp_path / "served.json"),
        "--prefill",
        "1",
        "--decode",
        "1",
        "--seed",
        "3",
    ]
    workload = [
        "--workload",
        "poisson(20) prompt=uniform(20,200) output=uniform(2,20)",
        "--max-requests",
        "80",
    ]
    assert main([*run, *workload, "--step-trace", str(trace)]) == 0
    assert trace_speed(served, [trace]).factor == pytest.approx(1.0, abs=0.04)
    rows = [json.loads(row) for row in trace.read_text().splitlines()]
    raw = [
        row["seconds"]
        / line.seconds(
            Step(
                row["prefill_tokens"], row["prefill_attention"], row["decode_streams"], row["decode_context"]
            )
        )
        for row in rows
    ]
    assert len(raw) >= 100 and sorted(raw)[len(raw) // 2] == pytest.approx(
        0.91, abs=0.03
    )  # the band's median


def write_trace(path: Path, paces: list[float], per_window: int = 10, window_s: float = 10.0) -> None:
    """A colocated worker's decode steps (one stream; the fixed profile's 0.012 s), `per_window` in
    each window of `window_s` seconds, each window's `pace` times as long as the fit."""
    rows = []
    for index, pace in enumerate(paces):
        for k in range(per_window):
            t = index * window_s + k * window_s / per_window
            step = {"prefill_tokens": 0, "prefill_attention": 0, "decode_streams": 1, "decode_context": 100}
            rows.append(
                {"t_s": t + 3.0, "worker": "colocated-0", "pool": "colocated", "seconds": 0.012 * pace}
                | step
                | {"loop_seconds": 0.0, "pull_wait_seconds": 0.0, "pull_blocks": 0, "pull_seconds": 0.0}
            )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_the_course_is_each_windows_pace_against_the_runs() -> None:
    course = SpeedCourse(10.0, {"decode": (0.5, 2.0)})
    assert [course.at("decode", t) for t in (0.0, 9.9, 10.0, 19.9)] == [0.5, 0.5, 2.0, 2.0]
    # Before the workload, after the trace, and a pool it does not have: the run's own pace.
    assert [course.at("decode", -1.0), course.at("decode", 20.0), course.at("prefill", 5.0)] == [
        1.0,
        1.0,
        1.0,
    ]
    assert course.describe() == "decode 0.50 2.00"


def test_a_stall_in_the_trace_is_a_slow_window(tmp_path: Path) -> None:
    profile = replace(fixed_profile(step=0.01, per_stream=0.002), steps_from="serving")
    trace = tmp_path / "steps.jsonl"
    write_trace(trace, [1.0, 1.0, 3.0, 1.0])  # 30 s at the fit's pace, 10 at a third of it
    # The whole run took 1.5 times the fit (its median step: x1); its windows against that.
    assert trace_speed(profile, [trace]).factor == pytest.approx(1.0)
    course = speed_course(profile, [trace], 10.0)
    assert course.factors == {"colocated": pytest.approx((2 / 3, 2 / 3, 2.0, 2 / 3))}
    # The trace's clock starts at its first step (3 s into it here).
    assert course.at("colocated", 0.0) == pytest.approx(2 / 3)
    # A window with fewer than three steps of the pool says nothing of its own.
    write_trace(trace, [1.0, 3.0], per_window=2)
    assert speed_course(profile, [trace], 10.0).factors == {"colocated": (1.0, 1.0)}
    with pytest.raises(ProfileError, match="at least 1 s"):
        speed_course(profile, [trace], 0.5)
    with pytest.raises(ProfileError, match="give one step trace"):
        speed_course(profile, [trace, trace], 10.0)


def test_a_trace_of_prompts_alone_takes_its_factor_from_every_step(tmp_path: Path) -> None:
    # A prefill worker's trace has no decode step: the run's factor is then all its steps' median.
    profile = replace(fixed_profile(step=0.01, per_token=1e-4), steps_from="serving")
    rows = [
        {"t_s": float(k), "worker": "prefill-0", "pool": "prefill", "seconds": (0.01 + 1e-4 * 64) * 1.5}
        | {"prefill_tokens": 64, "prefill_attention": 2080, "decode_streams": 0, "decode_context": 0}
        | {"loop_seconds": 0.0, "pull_wait_seconds": 0.0, "pull_blocks": 0, "pull_seconds": 0.0}
        for k in range(MIN_KIND_STEPS)
    ]
    trace = tmp_path / "steps.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    traced = trace_speed(profile, [trace])
    assert (traced.factor, traced.prompt, traced.mixed) == (pytest.approx(1.5), pytest.approx(1.5), None)
    # Fewer prompt steps than a kind's own factor needs: they run at the run's.
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows[: MIN_KIND_STEPS - 1]))
    assert trace_speed(profile, [trace]).prompt is None


def test_a_window_busy_with_prompts_reads_the_host_not_its_mix(tmp_path: Path) -> None:
    # Mixed steps ran at 1.2 times their fit all run long, decode steps at 1: the host did not
    # move. A window with more mixed steps than the run's share still reads x1 (the simulation runs
    # mixed steps at their own pace already: counting the mix again would slow them twice).
    profile = replace(fixed_profile(step=0.01, per_token=1e-4, per_stream=0.002), steps_from="serving")
    rows = []
    for window, mixed_share in enumerate((0.2, 0.8, 0.2)):
        for k in range(10):
            mixed = k < mixed_share * 10
            step = {"prefill_tokens": 16 if mixed else 0, "prefill_attention": 136 if mixed else 0}
            step |= {"decode_streams": 1, "decode_context": 100}
            fitted = 0.01 + 0.002 + (16e-4 if mixed else 0.0)
            rows.append(
                {"t_s": window * 10.0 + k, "worker": "colocated-0", "pool": "colocated"}
                | {"seconds": fitted * (1.2 if mixed else 1.0)}
                | step
                | {"loop_seconds": 0.0, "pull_wait_seconds": 0.0, "pull_blocks": 0, "pull_seconds": 0.0}
            )
    trace = tmp_path / "steps.jsonl"
    trace.write_text("".join(json.dumps(row) + "\n" for row in rows))
    assert speed_course(profile, [trace], 10.0).factors == {"colocated": pytest.approx((1.0, 1.0, 1.0))}


def test_a_simulation_replays_the_hosts_speed_window_by_window(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Requests every 10 s (each in the middle of a 12-s window) on a host whose third window ran a
    # served run's steps three times as long as the rest: replayed, that window's request streams
    # three times as slowly as the others, and each as the course says against the profile's own
    # pace.
    profile_path = served_profile(tmp_path, step=0.01, per_stream=0.002)
    trace = tmp_path / "steps.jsonl"
    write_trace(trace, [1.0, 1.0, 3.0, 1.0, 1.0], window_s=12.0)
    workload = ["--workload", "constant(0.1) prompt=fixed(16) output=fixed(5)", "--max-requests", "4"]
    run = ["sim", "--profile", str(profile_path), "--colocated", "1", *workload]
    records = {}
    for name, extra in {
        "alone": [],
        "replayed": ["--speed-trace", str(trace), "--speed-window", "12"],
    }.items():
        assert main([*run, *extra, "--out", str(tmp_path / name)]) == 0
        records[name] = [
            json.loads(line) for line in (tmp_path / name / "records.jsonl").read_text().splitlines()
        ]
    assert "--speed-window 12: each pool's steps" in capsys.readouterr().err
    course = speed_course(
        replace(fixed_profile(step=0.01, per_stream=0.002), steps_from="serving"), [trace], 12.0
    )
    slow = []
    for alone, replayed in zip(records["alone"], records["replayed"], strict=True):
        gaps, alone_gaps = (np.diff(record["chunk_times_s"]).tolist() for record in (replayed, alone))
        pace = course.at("colocated", replayed["sent_s"])
        assert gaps == pytest.approx([g * pace for g in alone_gaps], rel=1e-6)
        slow.append(pace > 1)
    assert slow.count(True) == 1 and len(slow) == 4
    summary = json.loads((tmp_path / "replayed" / "summary.json").read_text())
    assert summary["simulation"]["speed_window_s"] == 12.0
    # A window needs the run it replays, and one run.
    assert main([*run, "--speed-window", "10"]) == 2
    assert "give its --speed-trace" in capsys.readouterr().err
    assert main([*run, "--speed-trace", str(trace), str(trace), "--speed-window", "10"]) == 2
    assert "give one step trace" in capsys.readouterr().err


def test_a_run_that_left_a_cpu_free_is_read_against_such_runs_spread(tmp_path: Path) -> None:
    # The profile's steps ran at twice the fit where every CPU had a worker and as fitted where one
    # was free (two CPUs). A lone worker's run and a pair's, both at the profile's pace, each read
    # x1: each against the spread of its kind of run.
    base = replace(fixed_profile(step=0.01, per_token=1e-4, per_stream=1e-3), host=HostCpu(cpus=2))
    step = replace(base.steps["decode"], spread=(Spread(None, (2.0,)),), free_spread=(Spread(None, (1.0,)),))
    profile = replace(base, steps={"prefill": step, "decode": step}, steps_from="serving")
    profile.save(tmp_path / "p.json")
    for workers in (1, 2):
        trace = tmp_path / f"c{workers}.jsonl"
        run = [
            "sim",
            "--colocated",
            str(workers),
            "--profile",
            str(tmp_path / "p.json"),
            "--step-trace",
            str(trace),
        ]
        workload = ["--workload", "poisson(8) prompt=fixed(32) output=fixed(20)", "--max-requests", "30"]
        assert main([*run, *workload, "--out", str(tmp_path / f"run{workers}")]) == 0
        assert trace_speed(profile, [trace]).factor == pytest.approx(1.0), workers
