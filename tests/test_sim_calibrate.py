"""`pdserve profile --from-trace`: step times and the worker loop's time fitted to a served run's
steps. A simulated run of a known profile writes its trace through the router's own recorder, and
the fit gives that profile back; bad traces are refused with where and why."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from test_sim_profile import fixed_profile

from pdserve.cli import main
from pdserve.costmodel import Step
from pdserve.measure.cli import describe
from pdserve.router.recorder import STEP_TRACE_KEYS
from pdserve.sim import profile as profiles
from pdserve.sim.calibrate import (
    attention_ratio,
    calibrated,
    fit_alone_and_busy,
    fit_pull,
    others_busy,
    read_trace,
)
from pdserve.sim.profile import Overhead
from pdserve.sim.step_time import LinearStep, ProfileError, StreamPasses

WORKLOAD = "poisson(20) prompt=uniform(20,300) output=uniform(2,40)"


def traced_run(tmp_path: Path, truth: profiles.Profile, *flags: str) -> Path:
    truth.save(tmp_path / "truth.json")
    trace = tmp_path / "steps.jsonl"
    code = main(
        ["sim", "--profile", str(tmp_path / "truth.json"), "--workload", WORKLOAD, "--max-requests", "120",
         "--seed", "3", "--step-trace", str(trace), *flags]
    )  # fmt: skip
    assert code == 0
    return trace


def test_the_fit_to_a_simulated_runs_trace_gives_its_profile_back(tmp_path: Path) -> None:
    truth = replace(
        fixed_profile(step=0.01, per_token=1e-4, per_stream=2e-3, pull=0.001),
        overhead=Overhead(request_s=0.002, step_s=0.001, stream_s=0.0005),
    )
    trace = traced_run(
        tmp_path, truth, "--prefill", "1", "--decode", "1", "--path-choice", "threshold",
        "--local-prefill-threshold", "0",
    )  # fmt: skip
    rows = [json.loads(line) for line in trace.read_text().splitlines()]
    assert rows and all(tuple(row) == STEP_TRACE_KEYS for row in rows)
    assert {row["pool"] for row in rows} == {"prefill", "decode"}

    # The decode worker waited on pulls (1 ms each) while it had streams: traced apart.
    decode = [row for row in rows if row["pool"] == "decode"]
    assert all(0 <= row["pull_wait_seconds"] <= row["loop_seconds"] for row in decode)
    assert any(row["pull_wait_seconds"] > 0 for row in decode)
    # ... with the blocks those pulls moved (a step that waited moved some, one that did not none)
    # and the copies' own time, 1 ms each (two pulls at once: 2 ms of copies in a 1 ms wait).
    assert all((row["pull_blocks"] > 0) == (row["pull_wait_seconds"] > 0) for row in decode)
    copies = [row["pull_seconds"] / 0.001 for row in decode if row["pull_blocks"] > 0]
    assert all(n >= 0.999 and abs(n - round(n)) < 1e-6 for n in copies) and 1 in {round(n) for n in copies}

    fitted = calibrated(truth, [trace])
    assert fitted.steps_from == "serving"
    # What each pool's steps can tell: a prefill worker runs no stream; a decode worker (every
    # prompt prefilled remotely) no prompt chunk, so it takes the prefill pool's cost per prompt
    # token (the same kernels on a CPU: here the truth) rather than none.
    identifiable = {"prefill": (0.01, 1e-4, 0.0, 0.0, 0.0), "decode": (0.01, 1e-4, 0.0, 2e-3, 0.0)}
    for role, expected in identifiable.items():
        step, busy = fitted.steps[role], fitted.steps_busy[role]
        assert isinstance(step, LinearStep) and isinstance(busy, LinearStep)
        assert step.coefficients == pytest.approx(expected, rel=1e-3, abs=1e-7)
        # The other worker's work never slowed these steps: beside it, the same fit.
        assert busy.coefficients == pytest.approx(expected, rel=1e-3, abs=1e-7)
        assert step.median_error is not None and step.median_error < 1e-3
    # The decode worker samples one token a stream: its loop is 1 ms + 0.5 ms a stream. A prefill
    # step samples each prompt's first token: its loop is at least the 1 ms.
    loop = fitted.loops["decode"]
    assert (loop.step_s, loop.stream_s) == pytest.approx((0.001, 0.0005))
    assert loop.by_streams and all(
        seconds == pytest.approx(0.001 + 0.0005 * n) for n, seconds in loop.by_streams
    )
    assert fitted.loops["prefill"].step_s >= 0.0015 and fitted.loops["prefill"].stream_s == 0
    # Each pull took 1 ms whatever its blocks, the other worker's work or not: so did their waits.
    pull = fitted.served_pull("decode", "shm")
    assert pull is not None and pull.samples >= 20
    assert (pull.alone.base_s, pull.alone.per_block_s) == pytest.approx((0.001, 0.0), abs=1e-6)
    assert (pull.busy.base_s, pull.busy.per_block_s) == pytest.approx((0.001, 0.0), abs=1e-6)
    # The copies: each pull's own time, 1 ms, the whole of its wait (a step's two pulls' 2 ms of
    # copies pull the line in blocks up a little; the wait caps it).
    assert pull.copy_alone is not None and pull.copy_busy is not None
    assert 0.0009 <= pull.copy_alone.seconds(4) <= 0.002
    assert pull.copy_seconds(4, 1.0) == pytest.approx(0.001, abs=1e-6)
    assert fitted.served_pull("decode", "tcp") is None  # traced over shm: another keeps its own line
    assert any("decode pulls: their wait fitted to" in a for a in fitted.assumptions)
    assert fitted.overhead == truth.overhead  # the request's overhead: the base's probe
    # No colocated pool traced: a mixed worker steps as the decode pool's fit says.
    assert "colocated" not in fitted.steps and fitted.step_time("colocated") is fitted.steps["decode"]
    assert fitted.loop_time("colocated") == fitted.loops["decode"]
    assert any("served steps" in a for a in fitted.assumptions)
    assert any("decode steps: the prefill pool's cost per prompt token" in a for a in fitted.assumptions)
    assert fitted.meta["step_traces"] == "steps.jsonl"


def test_profile_from_trace_writes_a_profile_that_simulates_without_host_contention(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    truth = fixed_profile(step=0.01, per_token=1e-4, per_stream=2e-3)
    trace = traced_run(tmp_path, truth, "--colocated", "1")
    base = replace(truth, host=profiles.HostCpu(cpus=1, router_request_s=1.0))
    base.save(tmp_path / "base.json")
    out = tmp_path / "served.json"
    assert (
        main(
            ["profile", "--from-trace", str(trace), "--base", str(tmp_path / "base.json"), "--out", str(out)]
        )
        == 0
    )
    printed = capsys.readouterr().out
    assert "steps fitted to served steps (steps.jsonl)" in printed
    # How the steps spread around the fit, said (here they ran exactly as fitted).
    spreads = [line for line in printed.splitlines() if "measured / fitted" in line]
    assert spreads and all("measured / fitted 1.00 to 1.00, median 1.00, mean 1.000" in s for s in spreads)
    served = profiles.load(out)
    assert served.steps_from == "serving" and set(served.steps) == {"prefill", "decode", "colocated"}
    assert served.host == base.host  # kept, as the rest of the base
    # A router that would take the one CPU for a second stretches no step of a served profile:
    # the steps already ran beside it.
    code = main(
        ["sim", "--profile", str(out), "--colocated", "1", "--workload",
         "constant(1) prompt=fixed(50) output=fixed(3)", "--max-requests", "1", "--out", str(tmp_path / "run")]
    )  # fmt: skip
    assert code == 0
    (record,) = [json.loads(line) for line in (tmp_path / "run" / "records.jsonl").read_text().splitlines()]
    gaps = [b - a for a, b in zip(record["chunk_times_s"], record["chunk_times_s"][1:], strict=False)]
    assert gaps == pytest.approx([0.01 + 2e-3] * 2, rel=1e-3)


def test_a_served_pulls_wait_is_a_line_in_its_blocks_slowed_by_busy_neighbours() -> None:
    # Waits of 2 ms + 0.1 ms a block beside idle workers, 4 ms + 0.3 ms a block beside busy ones.
    def wait(blocks: int, busy: float) -> float:
        alone, beside = 0.002 + 1e-4 * blocks, 0.004 + 3e-4 * blocks
        return alone + (beside - alone) * busy

    rows = [
        {"pull_blocks": n, "pull_wait_seconds": wait(n, b), "busy": b}
        for n in (1, 2, 8, 16)
        for b in (0.0, 0.3, 0.7, 1.0)
        for _ in range(2)
    ]
    rows += [{"pull_blocks": 0, "pull_wait_seconds": 0.0, "busy": 1.0}] * 10  # no pull: not a wait
    fitted = fit_pull(rows)
    assert fitted is not None
    alone, busy, steps = fitted
    assert steps == 32
    assert (alone.base_s, alone.per_block_s) == pytest.approx((0.002, 1e-4), rel=1e-4)
    assert (busy.base_s, busy.per_block_s) == pytest.approx((0.004, 3e-4), rel=1e-4)
    # Too few steps that waited, or a trace from before the pulls' blocks were traced: no fit.
    assert fit_pull(rows[:19]) is None
    # The copies' own time is fitted the same way, from `pull_seconds`.
    copies = [row | {"pull_seconds": row["pull_wait_seconds"] / 2} for row in rows]
    copy = fit_pull(copies, "pull_seconds", relative=True)  # exact data: the same line
    assert copy is not None and (copy[0].base_s, copy[1].per_block_s) == pytest.approx(
        (0.001, 1.5e-4), rel=1e-4
    )
    assert fit_pull([{k: v for k, v in row.items() if k != "pull_blocks"} for row in rows]) is None


def test_bad_traces_are_refused_with_where_and_why(tmp_path: Path) -> None:
    base = fixed_profile()
    with pytest.raises(ProfileError, match="cannot read the step trace"):
        read_trace([tmp_path / "missing.jsonl"])
    bad = tmp_path / "bad.jsonl"
    row = dict.fromkeys(STEP_TRACE_KEYS, 1) | {"worker": "decode-0", "pool": "decode", "seconds": 0.01}
    bad.write_text(json.dumps(row) + "\nnot json\n")
    with pytest.raises(ProfileError, match=r"bad.jsonl:2 is not a step trace line"):
        read_trace([bad])
    bad.write_text('{"t_s": 0, "worker": "w", "pool": "decode", "seconds": 0.01}\n')
    with pytest.raises(ProfileError, match=r"bad.jsonl:1 is not a step trace line .*: no prefill_tokens"):
        read_trace([bad])
    older = tmp_path / "older.jsonl"  # from before the pull waits were traced: still read
    older.write_text(json.dumps({k: v for k, v in row.items() if k != "pull_wait_seconds"}) + "\n")
    assert len(read_trace([older])["decode"]) == 1
    few = tmp_path / "few.jsonl"
    few.write_text(json.dumps(row) + "\n")
    with pytest.raises(ProfileError, match="no pool ran 30 steps or more"):
        calibrated(base, [few])
    code = main(["profile", "--from-trace", str(few), "--out", str(tmp_path / "x.json")])
    assert code != 0 and not (tmp_path / "x.json").exists()


def test_how_busy_the_other_workers_were_is_read_from_the_trace() -> None:
    # While each step ran (from its report less its seconds, to its report), the share of it the
    # other workers' steps ran beside it, on a host of 2 CPUs (one other CPU).
    rows = [
        {"t_s": 1.0, "worker": "a", "seconds": 0.5},  # alone
        {"t_s": 2.0, "worker": "a", "seconds": 0.5},  # b's 40 ms ran beside the last of it: 0.08
        {"t_s": 2.0, "worker": "b", "seconds": 0.04},  # inside a's step: 1
        {"t_s": 9.0, "worker": "b", "seconds": 0.04},  # a idle by then
        # A long prompt step, reported as it ends (14.0 s), and a decode step inside it: beside it
        # all through, though the prompt step began long before.
        {"t_s": 14.0, "worker": "p", "seconds": 1.5},
        {"t_s": 13.0, "worker": "d", "seconds": 0.05},
    ]
    assert others_busy(rows, cpus=2) == pytest.approx([0.0, 0.08, 1.0, 0.0, 0.05 / 1.5, 1.0])
    assert others_busy(rows, cpus=1)[1] == pytest.approx(0.08)  # one CPU: shared all the same
    assert others_busy(rows, cpus=3)[2] == 0.5  # one of two other CPUs busy


def test_steps_alone_and_beside_busy_neighbours_are_told_apart() -> None:
    alone = LinearStep((0.02, 1e-4, 0.0, 1e-3, 0.0))
    busy = LinearStep((0.03, 2e-4, 0.0, 1e-3, 0.0))  # a busy host: a higher base, dearer prompts
    samples = []
    for k in range(60):
        step = Step(prefill_tokens=(k * 37) % 300, decode_streams=k % 9 + (0 if k % 5 else 1))
        b = (k % 7) / 6
        samples.append((step, alone.seconds(step) + (busy.seconds(step) - alone.seconds(step)) * b, b))
    fitted_alone, fitted_busy = fit_alone_and_busy(samples)
    assert fitted_alone.coefficients == pytest.approx(alone.coefficients, rel=1e-6, abs=1e-12)
    assert fitted_busy.coefficients == pytest.approx(busy.coefficients, rel=1e-6, abs=1e-12)
    assert (
        fitted_alone.median_error is not None
        and fitted_alone.median_error < 1e-6
        and fitted_alone.samples == 60
    )


def test_a_step_beside_idle_cpus_may_be_fitted_the_slower() -> None:
    # A light load's steps ran slower than a busy one's on a shared host: the fit says so, rather
    # than pinning both to the busier steps' line.
    alone = LinearStep((0.03, 2e-4, 0.0, 1.5e-3, 0.0))
    busy = LinearStep((0.02, 1e-4, 0.0, 1e-3, 0.0))
    samples = []
    for k in range(60):
        step = Step(prefill_tokens=(k * 37) % 300, decode_streams=k % 9 + (0 if k % 5 else 1))
        b = (k % 7) / 6
        samples.append((step, alone.seconds(step) * (1 - b) + busy.seconds(step) * b, b))
    fitted_alone, fitted_busy = fit_alone_and_busy(samples)
    assert fitted_alone.coefficients == pytest.approx(alone.coefficients, rel=1e-6, abs=1e-12)
    assert fitted_busy.coefficients == pytest.approx(busy.coefficients, rel=1e-6, abs=1e-12)


def test_a_prompts_cost_per_token_attended_keeps_the_sweeps_ratio(tmp_path: Path) -> None:
    # A long prompt's chunks: each 256 tokens, attending over all before it. Its first chunk ran
    # beside idle CPUs, the later (dearer) ones beside busy neighbours, 10% over the truth: the
    # served steps alone cannot tell a chunk's cost per token from its cost per token attended,
    # and the free fit splits them anyhow (a long chunk alone off by x3.7 here). With the sweep's
    # ratio the fit keeps the prompt's shape and scales it: the truth back, alone and beside.
    ratio = 5e-4
    truth = LinearStep((0.02, 3e-3, 3e-3 * ratio, 2e-3, 0.0))
    samples = []
    for k in range(120):
        if k % 2:  # decode steps, beside idle and busy neighbours
            step = Step(0, 0, k % 5 + 1, 300 * (k % 5 + 1))
            samples.append((step, truth.seconds(step), (k % 4) / 3))
            continue
        chunk = k % 6
        step = Step(256, 256 * (256 * chunk + 128), 0, 0)
        samples.append((step, truth.seconds(step) * (1.1 if chunk else 1.0), 1.0 if chunk else 0.0))
    last_chunk = Step(256, 256 * (256 * 5 + 128), 0, 0)
    free, _ = fit_alone_and_busy(samples)
    shaped, shaped_busy = fit_alone_and_busy(samples, attention_per_token=ratio)
    assert abs(free.seconds(last_chunk) / truth.seconds(last_chunk) - 1) > 0.2
    assert shaped.seconds(last_chunk) == pytest.approx(truth.seconds(last_chunk), rel=1e-3)
    assert shaped_busy.seconds(last_chunk) == pytest.approx(1.1 * truth.seconds(last_chunk), rel=1e-3)
    for fit in (shaped, shaped_busy):
        assert fit.coefficients[2] == pytest.approx(ratio * fit.coefficients[1])
    # A sweep says its ratio (the decode role's for a colocated one); a served profile does not.
    sweep = replace(fixed_profile(), steps={"prefill": truth, "decode": LinearStep((0.01, 2e-3, 4e-7, 0, 0))})
    assert attention_ratio(sweep, "prefill") == pytest.approx(ratio)
    assert attention_ratio(sweep, "colocated") == pytest.approx(2e-4)
    assert attention_ratio(replace(sweep, steps_from="serving"), "prefill") is None
    assert attention_ratio(fixed_profile(), "prefill") is None  # c2 = 0: no shape to keep
    # calibrated() fits each role to the sweep's ratio, and says so.
    trace = traced_run(tmp_path, sweep, "--colocated", "1")
    fitted = calibrated(sweep, [trace])
    step = fitted.steps["colocated"]
    assert isinstance(step, LinearStep) and step.coefficients[2] == pytest.approx(2e-4 * step.coefficients[1])
    assert any(
        "colocated steps: a prompt's cost per token attended at the sweep's" in a for a in fitted.assumptions
    )


def test_the_stream_gemvs_terms_are_fitted_back_from_steps_that_show_them() -> None:
    # Decode steps of 1-64 streams and a prompt's rows beside some: passes of 4 rows up to 32,
    # a GEMM for the layers past it, another for the logits past 32 streams; the neighbours
    # raise the line's base and per-stream cost, not the kernels'.
    passes = StreamPasses(4, 32, 32)
    kernel = (0.012, 0.05, 0.04)
    alone = LinearStep((0.008, 0.003, 0.0, 0.002, 0.0), passes=passes, pass_coefficients=kernel)
    busy = LinearStep((0.011, 0.003, 0.0, 0.003, 0.0), passes=passes, pass_coefficients=kernel)
    samples = []
    for k in range(160):
        streams = k % 64 + 1
        step = Step(prefill_tokens=(k * 7) % 40 if k % 4 == 0 else 0, decode_streams=streams)
        b = (k % 5) / 4
        samples.append((step, alone.seconds(step) + (busy.seconds(step) - alone.seconds(step)) * b, b))
    fitted_alone, fitted_busy = fit_alone_and_busy(samples, passes=passes)
    for fitted, truth in ((fitted_alone, alone), (fitted_busy, busy)):
        assert fitted.passes == passes
        assert fitted.coefficients == pytest.approx(truth.coefficients, rel=1e-6, abs=1e-12)
        assert fitted.pass_coefficients == pytest.approx(kernel, rel=1e-6)
    # The line alone fits these steps worse: it cannot bend where a pass begins.
    line, _ = fit_alone_and_busy(samples)
    assert line.passes is None and line.pass_coefficients == (0.0, 0.0, 0.0)
    assert line.median_error is not None and line.median_error > 0.02
    assert fitted_alone.median_error is not None and fitted_alone.median_error < 1e-6

    # Steps that never leave the GEMV fit no GEMM step (those terms are 0, not guessed); too few
    # steps on the GEMV, and the line alone.
    narrow = [(step, t, b) for step, t, b in samples if step.prefill_tokens + step.decode_streams <= 32]
    assert len(narrow) >= 30
    on_stream, _ = fit_alone_and_busy(narrow, passes=passes)
    assert on_stream.pass_coefficients == pytest.approx((0.012, 0.0, 0.0), rel=1e-6, abs=1e-12)
    wide = [(step, t, b) for step, t, b in samples if step.prefill_tokens + step.decode_streams > 32]
    few, _ = fit_alone_and_busy(wide + narrow[:29], passes=passes)
    assert few.passes is None


def test_a_gemm_term_that_every_step_shows_is_the_lines_base() -> None:
    # An AMX Xeon's engine: the stream GEMV up to 2 rows, the logits always on a GEMM
    # (logits_rows 0). Its decode pool's steps all have a stream, so all show the logits' term:
    # that term cannot be told from the base, which holds it; a prompt alone (no stream) then
    # steps at the base too, not the base less an arbitrary share.
    passes = StreamPasses(8, 2, 0)
    truth = LinearStep((0.03, 4e-4, 0.0, 2e-4, 5e-6), passes=passes, pass_coefficients=(0.0, 6e-4, 0.0))
    samples = []
    for k in range(120):
        step = Step(prefill_tokens=(k * 7) % 40 if k % 5 == 0 else 0, decode_streams=k % 3 + 1)
        step = replace(step, decode_context=step.decode_streams * (100 + k))
        samples.append((step, truth.seconds(step), 0.0))
    fitted, _ = fit_alone_and_busy(samples, passes=passes)
    assert fitted.pass_coefficients[2] == 0.0
    assert fitted.coefficients[0] == pytest.approx(0.03, rel=1e-6)
    alone_prompt = Step(prefill_tokens=64, decode_streams=0)
    assert fitted.seconds(alone_prompt) == pytest.approx(truth.seconds(alone_prompt), rel=1e-6)


def test_a_served_fit_takes_the_stream_gemv_its_base_profile_recorded(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A simulated DPD run (1-40 streams) whose decode steps bend as the stream GEMV's (4 rows a
    # pass, up to 20, the logits' up to 12): the fit gives the bends back where the base profile
    # says what the engine runs.
    passes = StreamPasses(4, 20, 12)
    decode = LinearStep((0.01, 1e-4, 0.0, 2e-3, 0.0), passes=passes, pass_coefficients=(0.004, 0.01, 5e-4))
    base = fixed_profile(step=0.01, per_token=1e-4, per_stream=2e-3)
    truth = replace(
        base, steps={**base.steps, "decode": decode}, meta=base.meta | {"stream_passes": passes.to_json()}
    )
    trace = traced_run(
        tmp_path, truth, "--prefill", "1", "--decode", "1", "--path-choice", "threshold",
        "--local-prefill-threshold", "0",
    )  # fmt: skip
    fitted = calibrated(truth, [trace])
    step = fitted.steps["decode"]
    assert isinstance(step, LinearStep) and step.passes == passes
    assert step.coefficients == pytest.approx(decode.coefficients, rel=1e-3, abs=1e-7)
    assert step.pass_coefficients == pytest.approx(decode.pass_coefficients, rel=1e-3, abs=1e-7)
    # The prefill worker's prompts never ran on the GEMV: its line, and the profile says so.
    assert fitted.steps["prefill"].passes is None  # type: ignore[union-attr]
    assert any("prefill steps: one line (fewer than 30" in a for a in fitted.assumptions)
    # Without the GEMV in the base profile's record: the line, as before.
    plain = calibrated(replace(truth, meta=base.meta), [trace])
    assert plain.steps["decode"].passes is None  # type: ignore[union-attr]
    # `pdserve profile --from-trace` says the GEMV's terms in words.
    capsys.readouterr()
    out = tmp_path / "served.json"
    code = main(
        ["profile", "--from-trace", str(trace), "--base", str(tmp_path / "truth.json"), "--out", str(out)]
    )
    assert code == 0 and profiles.load(out).steps["decode"] == fitted.steps["decode"]
    said = capsys.readouterr().out
    assert (
        "stream GEMV (4 rows a pass, up to 20 rows): 4.00 ms a pass past the first; a GEMM past it +10.00 ms"
        in said
    )
    assert "0.100 ms a row on the GEMM (c1)" in said


def test_a_served_profile_keeps_the_neighbours_term(tmp_path: Path) -> None:
    # Steps fitted beside busy neighbours cost more than alone: in a DPD run, where each worker's
    # neighbour works too, the simulation steps between the two (the router's CPU stretches nothing).
    alone = LinearStep((0.01, 1e-4, 0.0, 2e-3, 0.0))
    base = replace(
        fixed_profile(step=0.01, per_token=1e-4, per_stream=2e-3),
        steps_from="serving",
        host=profiles.HostCpu(cpus=2, router_request_s=0.5),
    )
    itls = {}
    # A fit may also say they ran faster beside busy neighbours (a light load's steps the slower).
    cases = (
        ("same", alone),
        ("slower", LinearStep((0.03, 3e-4, 0.0, 6e-3, 0.0))),
        ("faster", LinearStep((0.004, 1e-4, 0.0, 1e-3, 0.0))),
    )
    for name, busy in cases:
        profile = replace(
            base, steps={"prefill": alone, "decode": alone}, steps_busy={"prefill": busy, "decode": busy}
        )
        profile.save(tmp_path / f"{name}.json")
        out = tmp_path / name
        code = main(
            ["sim", "--profile", str(tmp_path / f"{name}.json"), "--prefill", "1", "--decode", "1", "--workload",
             WORKLOAD, "--max-requests", "60", "--seed", "3", "--out", str(out)]
        )  # fmt: skip
        assert code == 0
        itls[name] = json.loads((out / "summary.json").read_text())["overall"]["itl_ms"]["p50"]
    assert itls["slower"] > itls["same"] * 1.2
    assert itls["faster"] < itls["same"] * 0.95


def test_the_fit_keeps_how_the_served_steps_spread_around_it() -> None:
    # Served steps have a right tail, a short step's the longest (here one short step in five takes
    # twice its time, one long step in five 1.2x): the fit, on the relative error, sits near the
    # many, so its line alone misses part of the work. The spread it keeps (measured / fitted,
    # by bands of fitted length that each took a like share of the time) puts it back, as the
    # simulation draws each step's deviation from its band.
    truth = LinearStep((0.02, 1e-4, 0.0, 1e-3, 0.0))
    samples = []
    for k in range(300):  # prompt steps and decode steps (mixed ones spread apart: below)
        step = Step(prefill_tokens=(k * 37) % 600) if k % 2 else Step(decode_streams=k % 9)
        short = truth.seconds(step) < 0.05
        slow = k % 5 == 4
        samples.append((step, truth.seconds(step) * (1.0 if not slow else 2.0 if short else 1.2), 0.0))
    fitted, _ = fit_alone_and_busy(samples)
    measured = sum(t for _, t, _ in samples)
    line = sum(fitted.seconds(step) for step, _, _ in samples)
    assert line < 0.97 * measured
    bands = fitted.spread
    longest = max(fitted.seconds(step) for step, _, _ in samples)
    assert 2 <= len(bands) <= 3 and bands[-1].below_s is not None and bands[-1].below_s > longest
    # A step longer than any measured deviates by the longest band's mean only: its tail unseen.
    (beyond,) = fitted.spread_at(2 * longest)
    assert beyond == pytest.approx(sum(bands[-1].quantiles) / 50)
    assert all(len(b.quantiles) == 50 and list(b.quantiles) == sorted(b.quantiles) for b in bands)
    drawn_work = sum(
        fitted.seconds(step) * sum(q := fitted.spread_at(fitted.seconds(step))) / len(q)
        for step, _, _ in samples
    )
    assert drawn_work == pytest.approx(measured, rel=0.03)
    short_band, long_band = bands[0].quantiles, bands[-1].quantiles
    assert short_band[-1] / short_band[0] == pytest.approx(2.0, rel=0.1)  # the short steps' tail: 2x
    assert long_band[-1] / long_band[0] < 1.5  # the long steps': 1.2x


def test_steps_with_a_prompt_beside_streams_keep_a_spread_of_their_own() -> None:
    # A decode worker's served steps: its decode steps as the line says, its local prefills' steps
    # (prompt tokens beside streams) 1.1x to 1.4x it; its cost per prompt token is the prefill
    # pool's (as `calibrated` gives a decode pool). The mixed steps' spread, kept apart, says they
    # ran over the line and the decode steps did not.
    truth = LinearStep((0.02, 1e-4, 0.0, 1e-3, 1e-6))
    samples = []
    for k in range(400):
        if k % 4 == 0:  # a prompt's chunk beside k % 7 + 1 streams
            step = Step(16 + k % 48, 0, k % 7 + 1, 300 * (k % 7 + 1))
            samples.append((step, truth.seconds(step) * (1.1 + 0.3 * (k % 3) / 2), 0.0))
        else:
            step = Step(0, 0, k % 9 + 1, 400 * (k % 9 + 1))
            samples.append((step, truth.seconds(step), 0.0))
    prefill_pool = (truth, truth)
    fitted, _ = fit_alone_and_busy(samples, prefill_pool)
    mixed = fitted.mixed_spread
    assert len(mixed) == 50 and list(mixed) == sorted(mixed)
    decode_ratios = [q for band in fitted.spread for q in band.quantiles]
    mixed_median, decode_median = sorted(mixed)[25], sorted(decode_ratios)[len(decode_ratios) // 2]
    assert mixed_median / decode_median == pytest.approx(1.25, rel=0.05)  # what they ran over the rest
    # The simulated mixed steps are drawn from it: their work adds up as measured.
    work = sum(
        fitted.seconds(step)
        * sum(q := fitted.spread_at(fitted.seconds(step), step.prefill_tokens > 0))
        / len(q)
        for step, _, _ in samples
    )
    assert work == pytest.approx(sum(t for _, t, _ in samples), rel=0.02)
    # Too few mixed steps to tell: one spread for all, as before.
    few, _ = fit_alone_and_busy(
        [s for i, s in enumerate(samples) if s[0].prefill_tokens == 0 or i < 40], prefill_pool
    )
    assert few.mixed_spread == () and few.spread


def test_a_colocated_pool_takes_the_decode_pools_cost_per_token_of_context(tmp_path: Path) -> None:
    # A colocated worker's long contexts come with many streams, and its served steps cannot tell
    # a token of context from a stream (on three hosts its free fit came 0.24x, 1.3x and 1.7x the
    # sweep's, the decode pool's within 10% of it): traced with a decode pool, it takes that
    # pool's. Here the colocated truth is set apart (9e-6 s a token against 5e-6) to show whose.
    decode = LinearStep((0.01, 1e-4, 0.0, 2e-3, 5e-6))
    colocated_line = replace(decode, coefficients=(0.01, 1e-4, 0.0, 2e-3, 9e-6))
    truth = replace(fixed_profile(), steps={"prefill": decode, "decode": decode, "colocated": colocated_line})
    (tmp_path / "dpd").mkdir()
    (tmp_path / "colocated").mkdir()
    dpd = traced_run(tmp_path / "dpd", truth, "--prefill", "1", "--decode", "1")
    colocated = traced_run(tmp_path / "colocated", truth, "--colocated", "2")
    fitted = calibrated(truth, [dpd, colocated])
    alone, busy = fitted.steps["colocated"], fitted.steps_busy["colocated"]
    assert isinstance(alone, LinearStep) and isinstance(busy, LinearStep)
    assert fitted.steps["decode"].coefficients[4] == pytest.approx(5e-6, rel=1e-3)  # type: ignore[union-attr]
    assert alone.coefficients[4] == fitted.steps["decode"].coefficients[4]  # type: ignore[union-attr]
    assert busy.coefficients[4] == fitted.steps_busy["decode"].coefficients[4]  # type: ignore[union-attr]
    assert alone.coefficients[0] == pytest.approx(0.01, rel=0.05)  # the rest fitted around it
    # Its prompt cost stays as first fitted: the decode pool's, taken from it, is still its own.
    assert alone.coefficients[1:3] == fitted.steps["decode"].coefficients[1:3]  # type: ignore[union-attr]
    assert any(
        "colocated steps: the decode pool's cost per token of a stream's context" in a
        for a in fitted.assumptions
    )
    # Traced alone, a colocated pool keeps its own (nothing to take it from).
    own = calibrated(truth, [colocated]).steps["colocated"]
    assert isinstance(own, LinearStep) and own.coefficients[4] == pytest.approx(9e-6, rel=1e-3)
    # A decode pool whose steps cost nothing a token of context (its fit's c4 is 0) has none to
    # give: the colocated pool keeps its own, and no note says it took one.
    flat = replace(decode, coefficients=(0.01, 1e-4, 0.0, 2e-3, 0.0))
    flat_truth = replace(truth, steps={**truth.steps, "prefill": flat, "decode": flat})
    (tmp_path / "dpd-flat").mkdir()
    flat_dpd = traced_run(tmp_path / "dpd-flat", flat_truth, "--prefill", "1", "--decode", "1")
    kept = calibrated(flat_truth, [flat_dpd, colocated])
    assert kept.steps["decode"].coefficients[4] == 0  # type: ignore[union-attr]
    assert kept.steps["colocated"].coefficients[4] == pytest.approx(9e-6, rel=1e-3)  # type: ignore[union-attr]
    assert not any("cost per token of a stream's context" in a for a in kept.assumptions)


def written_trace(path: Path, workers: int, steps: list[tuple[Step, float]], loop_s: float = 0.001) -> Path:
    """`steps` as one run's step trace, taken in turn by `workers` colocated workers, one after
    another in time (none beside another: b = 0), each loop `loop_s`."""
    rows, t = [], 0.0
    for index, (step, seconds) in enumerate(steps):
        t += seconds + 0.001
        rows.append(
            {"t_s": t, "worker": f"colocated-{index % workers}", "pool": "colocated", "seconds": seconds,
             "prefill_tokens": step.prefill_tokens, "prefill_attention": step.prefill_attention,
             "decode_streams": step.decode_streams, "decode_context": step.decode_context,
             "loop_seconds": loop_s, "pull_wait_seconds": 0.0, "pull_blocks": 0, "pull_seconds": 0.0}
        )  # fmt: skip
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_runs_that_left_a_cpu_free_spread_on_their_own_around_the_filled_runs_fit(tmp_path: Path) -> None:
    # On two CPUs: colocated 2 fills them, its steps with a right tail (one in five 1.5x: the
    # router's and the client's work between them); colocated 1 leaves one free, its steps tight
    # and 5% under the line. The fit is the filled run's; the lone worker's steps keep their own
    # spread, which the simulation draws a deployment that leaves a CPU free from.
    truth = LinearStep((0.012, 1e-3, 0.0, 6e-4, 0.0))
    steps = [
        Step(prefill_tokens=(k * 37) % 300) if k % 4 == 0 else Step(decode_streams=1 + k % 9)
        for k in range(240)
    ]
    filled = [(step, truth.seconds(step) * (1.5 if k % 5 == 4 else 1.0)) for k, step in enumerate(steps)]
    free = [(step, truth.seconds(step) * 0.95) for step in steps]
    # The lone worker's loop too is shorter: the router and the client ran on the other CPU.
    traces = [
        written_trace(tmp_path / "c2.jsonl", 2, filled),
        written_trace(tmp_path / "c1.jsonl", 1, free, loop_s=0.0004),
    ]
    base = replace(fixed_profile(), host=profiles.HostCpu(cpus=2))
    fitted = calibrated(base, traces)
    alone = calibrated(base, traces[:1])
    step = fitted.steps["colocated"]
    assert isinstance(step, LinearStep) and step.coefficients == alone.steps["colocated"].coefficients
    assert fitted.loops == alone.loops  # the loop is the filled run's, the lone run's its own
    assert fitted.loop_time("colocated").seconds(3) == pytest.approx(0.001)
    assert fitted.loop_time("colocated", free_cpu=True).seconds(3) == pytest.approx(0.0004)
    assert not alone.free_loops and alone.loop_time("colocated", free_cpu=True) == alone.loops["colocated"]
    assert any("colocated worker loop of runs with a CPU free of workers" in a for a in fitted.assumptions)
    assert any("worker loop with a CPU free of workers: 0.400 ms" in line for line in describe(fitted))
    assert step.spread == alone.steps["colocated"].spread
    tail = step.spread[0].quantiles
    assert tail[-1] / tail[len(tail) // 2] == pytest.approx(1.5, rel=0.05)
    # Tight, and 5% under the filled run's steps that ran as the line (its median).
    assert step.free_spread and all(b.quantiles[-1] / b.quantiles[0] < 1.01 for b in step.free_spread)
    median = tail[len(tail) // 2]
    assert all(
        b.quantiles[len(b.quantiles) // 2] / median == pytest.approx(0.95, rel=0.01) for b in step.free_spread
    )
    assert any("runs with a CPU free of workers (240)" in a for a in fitted.assumptions)
    assert not alone.steps["colocated"].free_spread  # type: ignore[union-attr]
    printed = [line for line in describe(fitted) if "with a CPU free of workers, fitted at" in line]
    assert printed and all("measured / fitted 0.9" in line for line in printed[:1])
    # Too few steps of a lone worker: left out, and said.
    few = written_trace(tmp_path / "c1-few.jsonl", 1, free[:12])
    assert not calibrated(base, [traces[0], few]).steps["colocated"].free_spread  # type: ignore[union-attr]
    assert not calibrated(base, [traces[0], few]).free_loops
    # A lone worker's run of prompt steps only says nothing of its loop (a decode step's): none
    # kept (a loop of 0 would be a guess), and said; its steps' spread is kept.
    prompts = [(step, seconds) for step, seconds in free if step.decode_streams == 0]
    silent = calibrated(base, [traces[0], written_trace(tmp_path / "c1-prompts.jsonl", 1, prompts, 0.0)])
    assert not silent.free_loops and silent.steps["colocated"].free_spread  # type: ignore[union-attr]
    assert any("loop of runs with a CPU free of workers: not seen" in a for a in silent.assumptions)
    assert any(
        "free of workers: 12 (< 30), left out" in a for a in calibrated(base, [traces[0], few]).assumptions
    )
    # Only runs that left a CPU free: fitted to them (nothing else to fit), and said.
    lone = calibrated(base, traces[1:])
    assert lone.steps["colocated"].samples == 240  # type: ignore[union-attr]
    assert any("0 of runs whose workers filled the host's 2 CPUs" in a for a in lone.assumptions)
    # On four CPUs both runs left one free: one fit of them all, and no spread apart.
    roomy = calibrated(replace(base, host=profiles.HostCpu(cpus=4)), traces)
    assert not roomy.steps["colocated"].free_spread  # type: ignore[union-attr]
    assert roomy.steps["colocated"].samples == 480  # type: ignore[union-attr]
