"""The speed check: a host's speed now against when its profile was measured, and a profile scaled
by it: every time it measured, worked by hand; a simulation on a host twice as slow takes twice
as long; checks that are not of the same steps are refused."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from test_sim_profile import fixed_profile

from pdserve.cli import main
from pdserve.costmodel import Step
from pdserve.sim import speed
from pdserve.sim.profile import HostCpu, LoopTime, ServedPull, TransferTime
from pdserve.sim.speed import SpeedCheck
from pdserve.sim.step_time import LinearStep, ProfileError, RooflineStep, Spread, StreamPasses

STEPS = tuple((Step(0, 0, streams, 40 * streams), 0.02 + 0.001 * streams) for streams in range(1, 11))


def check(factor: float = 1.0, **changes: object) -> SpeedCheck:
    base = SpeedCheck(
        "tiny", "cpu", "float32", 1, tuple((s, t * factor) for s, t in STEPS), "2026-12-06T18:00:00+00:00"
    )
    return replace(base, **changes)  # type: ignore[arg-type]


def test_the_factor_is_the_median_of_the_paired_steps() -> None:
    now = check(1.0)
    ratios = [1.1, 1.2, 1.3, 1.25, 1.0, 3.0, 1.2, 1.15, 1.3, 1.2]  # one step disturbed: the median holds
    now = replace(now, steps=tuple((s, t * r) for (s, t), r in zip(STEPS, ratios, strict=True)))
    factor, pairs = speed.speed_factor(check(), now)
    assert pairs == 10 and factor == pytest.approx(1.2)
    # Only steps both ran count: steps the other check lacks are left out.
    extra = replace(now, steps=(*now.steps, (Step(5, 15, 0, 0), 9.0)))
    assert speed.speed_factor(check(), extra) == (factor, 10)


@pytest.mark.parametrize(
    ("field", "value"),
    [("model", "other"), ("device", "cuda"), ("dtype", "bfloat16"), ("threads", 2), ("plan", "check-0")],
)
def test_checks_of_other_steps_are_refused(field: str, value: object) -> None:
    with pytest.raises(ProfileError, match=field):
        speed.speed_factor(check(), check(1.5, **{field: value}))


def test_too_few_steps_in_common_are_refused() -> None:
    with pytest.raises(ProfileError, match="in common"):
        speed.speed_factor(check(), replace(check(), steps=STEPS[:3]))


def test_every_time_a_profile_measured_is_scaled_and_its_ratios_are_not() -> None:
    passes = StreamPasses(4, 32, 32)
    linear = LinearStep(
        (0.01, 1e-4, 1e-9, 2e-3, 1e-6),
        spread=(Spread(0.05, (0.9, 1.0, 1.3)), Spread(None, (0.95, 1.0, 1.1))),
        mixed_spread=(0.9, 1.1),
        free_spread=(Spread(0.04, (0.98, 1.02)), Spread(None, (1.0,))),
        passes=passes,
        pass_coefficients=(0.004, 0.01, 0.002),
    )
    pull = TransferTime(0.002, 1e-4, [(8, 0.003)])
    profile = replace(
        fixed_profile(request_s=0.002, step_s=0.001, start_s=7.5),
        steps={"decode": linear},
        steps_busy={"decode": linear},
        transfers={"shm": pull},
        start_busy_s=20.0,
        host=HostCpu(2, 1e-3, 2e-5, 3e-3, 4e-5, 0.05),
        loops={"decode": LoopTime(0.001, 1e-4, ((1, 4e-4), (3, 8e-4)))},
        free_loops={"decode": LoopTime(0.0005, 1e-4, ((1, 3e-4),))},
        pulls={"decode": ServedPull("shm", pull, TransferTime(0.004, 2e-4), 30, pull, None)},
    )
    slow = speed.scaled(profile, 1.5)
    for step in (Step(10, 55, 3, 300), Step(0, 0, 40, 9000), Step(300, 45150, 0, 0)):
        assert slow.step_time("decode").seconds(step) == pytest.approx(
            1.5 * profile.step_time("decode").seconds(step)
        )
        assert slow.steps_busy["decode"].seconds(step) == pytest.approx(1.5 * linear.seconds(step))
    scaled_linear = slow.steps["decode"]
    assert isinstance(scaled_linear, LinearStep)
    # How steps spread around their fit is a ratio: kept; the bands end at steps 1.5x as long.
    assert [b.quantiles for b in scaled_linear.spread] == [b.quantiles for b in linear.spread]
    assert scaled_linear.spread[0].below_s == pytest.approx(0.075) and scaled_linear.spread[1].below_s is None
    assert scaled_linear.mixed_spread == linear.mixed_spread and scaled_linear.passes == passes
    assert [b.quantiles for b in scaled_linear.free_spread] == [b.quantiles for b in linear.free_spread]
    assert scaled_linear.free_spread[0].below_s == pytest.approx(0.06)  # a lone worker's bands too
    assert slow.transfer("shm").seconds(8) == pytest.approx(1.5 * pull.seconds(8))
    assert slow.transfer("shm").samples == [(8, pytest.approx(0.0045))]
    assert (slow.overhead.request_s, slow.overhead.step_s) == pytest.approx((0.003, 0.0015))
    assert (slow.start_s, slow.start_busy_s) == pytest.approx((11.25, 30.0))
    assert slow.host is not None and slow.host.cpus == 2
    assert slow.host.router_request_s == pytest.approx(1.5e-3) and slow.host.router_idle == pytest.approx(
        0.075
    )
    assert slow.loop_time("decode").stream_s == pytest.approx(1.5e-4)
    assert slow.loop_time("decode").seconds(2) == pytest.approx(1.5 * 6e-4)  # the traced counts too
    assert slow.loop_time("decode", free_cpu=True).seconds(1) == pytest.approx(1.5 * 3e-4)  # a lone worker's
    served = slow.pulls["decode"]
    assert served.seconds(8, 0.5) == pytest.approx(1.5 * profile.pulls["decode"].seconds(8, 0.5))
    assert served.copy_busy is None and served.samples == 30
    assert slow.meta["speed_factor"] == 1.5


PROMPT_STEPS = tuple(
    (Step(tokens, tokens * (tokens + 1) // 2, 0, 0), 0.001 * tokens) for tokens in (16, 64, 128)
)


def test_the_prompt_work_has_a_factor_of_its_own_where_the_check_ran_prompts() -> None:
    """On the AVX512 EPYC a check read the prompt steps 7-10% faster than the decode steps; the
    simulation then scales a step's cost per prompt token (and per token attended) by their factor
    and the rest by the steps' own."""
    then = check(1.0, steps=STEPS + PROMPT_STEPS)
    now = check(
        1.0, steps=tuple((s, t * 1.2) for s, t in STEPS) + tuple((s, t * 1.05) for s, t in PROMPT_STEPS)
    )
    assert speed.speed_factor(then, now)[0] == pytest.approx(1.2)  # 10 decode steps of 13: their median
    assert speed.prompt_factor(then, now) == pytest.approx(1.05)
    assert speed.prompt_factor(check(), check(2.0)) is None  # no prompt steps: none of its own
    assert speed.prompt_factor(then, replace(now, model="other")) is None
    linear = LinearStep((0.01, 1e-4, 1e-9, 2e-3, 1e-6))
    gemv = replace(linear, passes=StreamPasses(8, 128, 32), pass_coefficients=(0.004, 0.01, 0.002))
    prompt, decode, mixed = Step(300, 45150, 0, 0), Step(0, 0, 8, 2000), Step(100, 5050, 8, 2000)
    short = Step(64, 2080, 0, 0)  # on the stream GEMV's passes where the profile has them
    for fitted in (linear, gemv):
        profile = replace(fixed_profile(), steps={"decode": fitted}, steps_busy={})
        both = speed.scaled(profile, 1.2, 1.05).step_time("decode")
        # A prompt-only step, whatever its terms, runs at the prompt steps' factor; a decode step
        # at the steps'; a mixed one its decode part at the one, what its prompt adds at the other.
        for step in (prompt, short):
            assert both.seconds(step) == pytest.approx(1.05 * fitted.seconds(step))
        assert both.seconds(decode) == pytest.approx(1.2 * fitted.seconds(decode))
        rest = fitted.seconds(decode)
        assert both.seconds(mixed) == pytest.approx(1.2 * rest + 1.05 * (fitted.seconds(mixed) - rest))
        again = speed.scaled(replace(profile, steps={"decode": both}), 2.0, 1.0).step_time("decode")
        assert again.seconds(short) == pytest.approx(1.05 * fitted.seconds(short))  # factors compound
    scaled = speed.scaled(profile, 1.2, 1.05)
    assert (scaled.meta["speed_factor"], scaled.meta["speed_factor_prompt"]) == (1.2, 1.05)
    # One factor: the prompt work's is not known, and every step runs at it.
    assert speed.scaled(profile, 1.2).meta["speed_factor_prompt"] is None
    assert speed.scaled(profile, 1.2).step_time("decode").seconds(short) == pytest.approx(
        1.2 * gemv.seconds(short)
    )
    with pytest.raises(ProfileError):
        LinearStep((0.01, 0, 0, 0, 0), prompt_scale=0.0)


def test_a_served_traces_mixed_steps_scale_as_a_whole() -> None:
    """A served trace times a decode worker's mixed steps (short local chunks beside its streams)
    apart from its prompts: such a step runs at the mixed factor as a whole, the others as before,
    and a profile keeps the scale through its JSON."""
    linear = LinearStep((0.01, 1e-4, 1e-9, 2e-3, 1e-6))
    profile = replace(fixed_profile(), steps={"decode": linear}, steps_busy={})
    prompt, decode, mixed = Step(300, 45150, 0, 0), Step(0, 0, 8, 2000), Step(9, 45, 4, 1000)
    scaled = speed.scaled(profile, 0.96, 0.90, 1.0)
    step = scaled.step_time("decode")
    assert step.seconds(mixed) == pytest.approx(1.0 * linear.seconds(mixed))
    assert step.seconds(prompt) == pytest.approx(0.90 * linear.seconds(prompt))
    assert step.seconds(decode) == pytest.approx(0.96 * linear.seconds(decode))
    assert (
        scaled.meta["speed_factor_mixed"] == 1.0
        and speed.scaled(profile, 1.2).meta["speed_factor_mixed"] is None
    )
    # Mixed steps at the run's own factor are still set apart: their prompt is not the prompts' pace.
    alike = speed.scaled(profile, 0.96, 0.80, 0.96).step_time("decode")
    assert alike.seconds(mixed) == pytest.approx(0.96 * linear.seconds(mixed))
    # A headroom on top (another scaling) compounds, mixed steps included.
    again = speed.scaled(scaled, 1.1).step_time("decode")
    assert again.seconds(mixed) == pytest.approx(1.1 * linear.seconds(mixed))
    assert LinearStep.to_json(linear).get("mixed_scale") is None  # as fitted: read as before
    assert isinstance(step, LinearStep) and step.to_json()["mixed_scale"] == pytest.approx(1.0 / 0.96)
    with pytest.raises(ProfileError, match="mixed_scale must be a finite number > 0"):
        LinearStep((0.01, 0, 0, 0, 0), mixed_scale=0.0)


def test_a_served_traces_prompts_on_the_gemm_scale_apart_from_the_stream_gemvs() -> None:
    """A served trace times prompt-only steps on the GEMM (rows past the stream GEMV) apart from
    those on its passes: such a step's prompt work runs at the GEMM's factor, a short prompt at the
    prompt factor, a mixed step on the GEMM (no mixed factor set) its prompt part at the GEMM's
    and its streams at the steps'; a check on top moves both prompt kinds alike; the scale
    survives the profile's JSON; without the stream GEMV known, there is no GEMM to tell apart."""
    linear = LinearStep((0.01, 1e-4, 1e-9, 2e-3, 1e-6))
    gemv = replace(linear, passes=StreamPasses(8, 128, 32), pass_coefficients=(0.004, 0.01, 0.002))
    profile = replace(fixed_profile(), steps={"prefill": gemv, "decode": linear}, steps_busy={})
    long, short, decode = Step(1024, 524800, 0, 0), Step(64, 2080, 0, 0), Step(0, 0, 8, 2000)
    mixed = Step(200, 20100, 4, 1000)  # on the GEMM, beside streams
    scaled = speed.scaled(profile, 0.96, 0.88, None, 0.93)
    step = scaled.step_time("prefill")
    assert step.seconds(long) == pytest.approx(0.93 * gemv.seconds(long))
    assert step.seconds(short) == pytest.approx(0.88 * gemv.seconds(short))
    assert step.seconds(decode) == pytest.approx(0.96 * gemv.seconds(decode))
    rest = gemv.seconds(Step(0, 0, 4, 1000))
    assert step.seconds(mixed) == pytest.approx(0.96 * rest + 0.93 * (gemv.seconds(mixed) - rest))
    assert (
        scaled.meta["speed_factor_gemm"] == 0.93
        and speed.scaled(profile, 1.2).meta["speed_factor_gemm"] is None
    )
    # Without passes the profile cannot tell a GEMM's step: every prompt at the prompt factor.
    assert scaled.step_time("decode").seconds(long) == pytest.approx(0.88 * linear.seconds(long))
    # A check's prompt factor on top moves the GEMM's prompts with the rest of the prompt work.
    again = speed.scaled(scaled, 1.1, 1.2).step_time("prefill")
    assert again.seconds(long) == pytest.approx(1.2 * 0.93 * gemv.seconds(long))
    assert again.seconds(short) == pytest.approx(1.2 * 0.88 * gemv.seconds(short))
    assert isinstance(step, LinearStep) and step.to_json()["gemm_prompt_scale"] == pytest.approx(0.93 / 0.96)
    assert "gemm_prompt_scale" not in gemv.to_json()  # as fitted: read as before
    with pytest.raises(ProfileError, match="gemm_prompt_scale must be a finite number > 0"):
        LinearStep((0.01, 0, 0, 0, 0), gemm_prompt_scale=-1.0)
    with pytest.raises(ProfileError, match="must be > 0"):
        speed.scaled(profile, 1.0, gemm=0.0)


def test_a_simulation_scales_its_prompts_by_the_checks_prompt_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    linear = LinearStep((0.002, 1e-4, 0.0, 1e-3, 0.0))
    then = check(1.0, steps=STEPS + PROMPT_STEPS)
    profile = replace(
        fixed_profile(request_s=0.0, step_s=0.0),
        steps={"colocated": linear, "decode": linear, "prefill": linear},
        steps_busy={},
        meta={"device": "cpu", "speed_check": then.to_json()},
    )
    profile.save(tmp_path / "profile.json")
    now = replace(
        then, steps=tuple((s, t * 2.0) for s, t in STEPS) + tuple((s, t * 1.5) for s, t in PROMPT_STEPS)
    )
    now.save(tmp_path / "now.json")
    args = ["sim", "--profile", str(tmp_path / "profile.json"), "--colocated", "1", "--max-requests", "1"]
    args += ["--workload", "constant(1) prompt=fixed(50) output=fixed(2)", "--out", str(tmp_path / "run")]
    assert main([*args, "--speed-check", str(tmp_path / "now.json")]) == 0
    err = capsys.readouterr().err
    assert "x2.000" in err and "its prompt work x1.500" in err
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["simulation"]["speed_factor"], summary["simulation"]["speed_factor_prompt"]) == (2.0, 1.5)
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "records.jsonl").read_text().splitlines()]
    # The prompt's step (prompt-only): all of it at the prompt steps' x1.5.
    first = record["chunk_times_s"][0] - record["sent_s"]
    assert first == pytest.approx((0.002 + 50 * 1e-4) * 1.5, rel=0.02)
    # --headroom slows both on top of the checks.
    args[-1] = str(tmp_path / "slower")
    assert main([*args, "--speed-check", str(tmp_path / "now.json"), "--headroom", "0.1"]) == 0
    summary = json.loads((tmp_path / "slower" / "summary.json").read_text())
    assert summary["simulation"]["speed_factor"] == pytest.approx(2.2)
    assert summary["simulation"]["speed_factor_prompt"] == pytest.approx(1.65)


def test_a_roofline_or_a_profile_without_a_check_cannot_be_scaled() -> None:
    roofline = replace(
        fixed_profile(), steps={"decode": RooflineStep(0.004, 16e9, 1e6, 16e9, 131072, 6e14, 3.8e12)}
    )
    with pytest.raises(ProfileError, match="roofline"):
        speed.scaled(roofline, 1.2)
    with pytest.raises(ProfileError, match="no speed check"):
        speed.reference(fixed_profile(), "p.json")


def test_a_check_reads_back_as_written_and_a_malformed_one_is_refused(tmp_path: Path) -> None:
    original = check(1.3)
    original.save(tmp_path / "check.json")
    assert speed.load(tmp_path / "check.json") == original
    body = original.to_json()
    for broken in (
        {**body, "format": "x"},
        {**body, "steps": [[1, 2, 3]]},
        {**body, "steps": [[1, 1, 0, 0, 0.0]]},
    ):
        (tmp_path / "bad.json").write_text(json.dumps(broken))
        with pytest.raises(ProfileError):
            speed.load(tmp_path / "bad.json")


def test_a_simulation_on_a_host_twice_as_slow_takes_twice_as_long(tmp_path: Path) -> None:
    profile = fixed_profile(step=0.010, request_s=0.002, step_s=0.001)
    profile = replace(profile, meta=profile.meta | {"speed_check": check().to_json()})
    profile.save(tmp_path / "profile.json")
    check(2.0).save(tmp_path / "now.json")
    times = []
    for extra in ([], ["--speed-check", str(tmp_path / "now.json")]):
        out = tmp_path / f"run{len(extra)}"
        args = ["sim", "--profile", str(tmp_path / "profile.json"), "--colocated", "1", "--max-requests", "1"]
        workload = ["--workload", "constant(1) prompt=fixed(50) output=fixed(5)", "--out", str(out)]
        assert main([*args, *workload, *extra]) == 0
        (record,) = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
        times.append([t - record["sent_s"] for t in record["chunk_times_s"]])
        summary = json.loads((out / "summary.json").read_text())
        assert summary["simulation"]["speed_factor"] == (2.0 if extra else None)
    assert times[0] == pytest.approx([0.002 + 0.010 + 0.011 * k for k in range(5)], abs=1e-9)
    assert times[1] == pytest.approx([2 * t for t in times[0]], abs=1e-9)


def test_several_checks_scale_by_their_median(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = replace(fixed_profile(), meta={"device": "cpu", "speed_check": check().to_json()})
    profile.save(tmp_path / "profile.json")
    for name, factor in (("a", 2.0), ("b", 8.0)):
        check(factor).save(tmp_path / f"{name}.json")
    args = ["sim", "--profile", str(tmp_path / "profile.json"), "--colocated", "1", "--max-requests", "1"]
    checks = ["--speed-check", str(tmp_path / "a.json"), str(tmp_path / "b.json")]
    out = ["--workload", "constant(1) prompt=fixed(50) output=fixed(5)", "--out", str(tmp_path / "run")]
    assert main([*args, *out, *checks]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["simulation"]["speed_factor"] == pytest.approx(4.0)
    err = capsys.readouterr().err
    assert "a.json x2.000" in err and "b.json x8.000" in err and "x4.000" in err
    with pytest.raises(ProfileError):
        speed.combined_factor([])
    # Three checks or more: their median, not the mean that one caught in a stall would pull.
    assert speed.combined_factor([1.02, 1.03, 1.18, 1.06, 1.60]) == pytest.approx(1.06)
    assert speed.combined_factor([1.0, 1.1, 1.2, 3.0]) == pytest.approx((1.1 * 1.2) ** 0.5)


def test_a_check_of_another_model_is_refused_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = replace(fixed_profile(), meta={"device": "cpu", "speed_check": check().to_json()})
    profile.save(tmp_path / "profile.json")
    check(2.0, model="other").save(tmp_path / "now.json")
    args = ["sim", "--profile", str(tmp_path / "profile.json"), "--colocated", "1", "--max-requests", "1"]
    assert main([*args, "--workload", "constant(1)", "--speed-check", str(tmp_path / "now.json")]) == 2
    assert "model" in capsys.readouterr().err


def test_headroom_simulates_a_host_that_much_slower_on_top_of_the_checks(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = fixed_profile(step=0.010, request_s=0.002, step_s=0.001)
    profile = replace(profile, meta=profile.meta | {"speed_check": check().to_json()})
    profile.save(tmp_path / "profile.json")
    check(2.0).save(tmp_path / "now.json")
    args = ["sim", "--profile", str(tmp_path / "profile.json"), "--colocated", "1", "--max-requests", "1"]
    workload = ["--workload", "constant(1) prompt=fixed(50) output=fixed(5)"]
    alone = [0.002 + 0.010 + 0.011 * k for k in range(5)]
    for extra, factor in (
        (["--headroom", "0.25"], 1.25),
        (["--headroom", "0.25", "--speed-check", str(tmp_path / "now.json")], 2.5),
    ):
        out = tmp_path / f"run{len(extra)}"
        assert main([*args, *workload, "--out", str(out), *extra]) == 0
        (record,) = [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]
        assert [t - record["sent_s"] for t in record["chunk_times_s"]] == pytest.approx(
            [factor * t for t in alone], abs=1e-9
        )
        assert json.loads((out / "summary.json").read_text())["simulation"]["speed_factor"] == factor
        assert "--headroom 0.25" in capsys.readouterr().err
    assert main([*args, *workload, "--headroom", "-0.1"]) == 2
    assert "--headroom must be a fraction >= 0" in capsys.readouterr().err
    roofline = Path(__file__).resolve().parents[1] / "profiles" / "h200-llama-3.1-8b-roofline.json"
    assert main(["sim", "--profile", str(roofline), "--colocated", "1", "--max-requests", "1", *workload,
                 "--headroom", "0.1"]) == 2  # fmt: skip
    assert "a roofline's are derived from the hardware's data sheet" in capsys.readouterr().err
