"""`pdserve plan`: every candidate simulated, the choice the best goodput per worker among those
that meet the SLO, a plain sentence for colocated, the rate sweep, and a roofline plan for an
8B model on an H200 with its assumptions."""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

import pytest
from test_sim_profile import fixed_profile

from pdserve import serve_options
from pdserve.cli import main
from pdserve.errors import PdserveError
from pdserve.sim.plan import Candidate, candidates, parse_vary, serve_command


def test_the_candidates_are_every_split_and_every_colocated_size() -> None:
    found = candidates(4, {"disaggregated", "colocated"})
    assert [str(c) for c in found] == [
        "1P + 1D", "1P + 2D", "2P + 1D", "1P + 3D", "2P + 2D", "3P + 1D",
        "colocated 1", "colocated 2", "colocated 3", "colocated 4",
    ]  # fmt: skip
    assert candidates(1, {"disaggregated"}) == []
    assert Candidate(colocated=3).workers == 3
    varied = candidates(2, {"colocated"}, parse_vary(["max-num-seqs=8,16", "prefill_chunk_size=256"]))
    assert [str(c) for c in varied] == [
        "colocated 1, max_num_seqs=8, prefill_chunk_size=256", "colocated 1, max_num_seqs=16, prefill_chunk_size=256",
        "colocated 2, max_num_seqs=8, prefill_chunk_size=256", "colocated 2, max_num_seqs=16, prefill_chunk_size=256",
    ]  # fmt: skip
    for bad in ("nonsense=1", "max_num_seqs=", "max_num_seqs=many", "pin_cpus=true,false", "metrics_key=a,b"):
        with pytest.raises(PdserveError, match="--vary"):
            parse_vary([bad])


def planned(tmp_path: Path, capsys: pytest.CaptureFixture[str], rate: str, *flags: str) -> tuple[dict, str]:  # type: ignore[type-arg]
    """`pdserve plan` of `rate` prompts of 100 tokens with 30 out, on a profile where a prompt costs
    110 ms and a stream 5 ms a step: its report at load x1, and what it printed."""
    fixed_profile(step=0.01, per_token=1e-3, per_stream=0.005, pull=0.002).save(tmp_path / "p.json")
    code = main([
        "plan", "--profile", str(tmp_path / "p.json"), "--workload", f"{rate} prompt=fixed(100) output=fixed(30)",
        "--slo", "ttft=300,itl=100", "--out", str(tmp_path / "plan"), *flags,
    ])  # fmt: skip
    assert code == 0
    report = json.loads((tmp_path / "plan" / "plan.json").read_text())["scales"]["1"]
    return report, capsys.readouterr().out


def test_the_choice_meets_the_slo_with_the_best_goodput_per_worker(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A prompt of 100 tokens costs 110 ms and a stream 5 ms a step: 4 requests a second keep one
    # worker busy half the time with prompts alone, which its TTFT p90 does not survive.
    report, printed = planned(tmp_path, capsys, "poisson(4)", "--duration", "60", "--budget", "3")
    outcomes = report["outcomes"]
    assert len(outcomes) == 6
    meeting = [o for o in outcomes if o["meets"]]
    assert meeting and len(meeting) < len(outcomes)  # the load separates them
    chosen = max(
        meeting,
        key=lambda o: (round(o["per_worker"], 6), -Candidate(**o["candidate"] | {"settings": ()}).workers),
    )
    assert report["choice"] == str(Candidate(**chosen["candidate"] | {"settings": ()}))
    assert f"Choice: {report['choice']}" in printed
    for o in outcomes:  # what fails the SLO, fails it in the simulated numbers printed
        if not o["meets"]:
            assert o["within_slo"] < 0.9 or o["errors"] > 0
    assert "| deployment | workers |" in printed
    # The command it prints serves what was simulated: serve's own parser reads the same options.
    line = next(x for x in printed.splitlines() if x.startswith("Serve it as simulated: "))
    words = shlex.split(line.removeprefix("Serve it as simulated: "))
    assert words[:2] == ["pdserve", "serve"] and report["serve"] == shlex.join(words)
    parser = argparse.ArgumentParser()
    serve_options.add_arguments(parser)
    served = serve_options.layered(parser.parse_args(words[2:]))
    pools = Candidate(**chosen["candidate"] | {"settings": ()})
    if pools.colocated:
        assert served["colocated"] == pools.colocated and "--prefill" not in words
    else:
        assert (served["prefill"], served["decode"]) == (pools.prefill, pools.decode)
        assert "--colocated" not in words
    assert served["slo"] == "ttft=300,itl=100"  # the server's ITL budget, as simulated
    assert served["model"] == "tiny"  # the profile's model, as simulated


def test_repeats_show_each_deployments_range_and_say_when_the_choice_is_near_its_knee(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Near its knee a deployment meets the SLO in some draws of the workload and not in others.
    report, printed = planned(
        tmp_path, capsys, "poisson(3)", "--duration", "30", "--budget", "2", "--repeats", "5"
    )
    outcomes = report["outcomes"]
    for o in outcomes:
        low, high = o["within_slo_range"]
        assert o["runs"] == 5 and low <= o["within_slo"] <= high
        assert o["meets"] == (o["within_slo"] >= 0.9 and o["errors"] == 0)  # the median run decides
        assert f"{o['runs_meeting']} of 5 runs" in printed
    chosen = next(o for o in outcomes if o["meets"])
    assert 0 < chosen["runs_meeting"] < 5  # this load is the choice's knee: some draws miss
    assert f"It met the SLO in {chosen['runs_meeting']} of 5 simulated runs" in printed


def test_the_serve_command_carries_the_varied_settings_and_the_options_given() -> None:
    base = {name: default for name, (_, default, _) in serve_options.OPTIONS.items()}
    base |= {
        "model": "m",
        "transport": "tcp",
        "slo": "ttft=500,itl=50",
        "pin_cpus": False,
        "metrics_key": ["s3cret"],
    }
    command = serve_command(
        Candidate(2, 3, settings=(("prefill_chunk_size", 256),)), base, Path("pools.toml")
    )
    parser = argparse.ArgumentParser()
    serve_options.add_arguments(parser)
    args = parser.parse_args(shlex.split(command)[2:])
    assert args.config == Path("pools.toml")
    assert (args.prefill, args.decode, args.prefill_chunk_size) == (2, 3, 256)
    assert (args.transport, args.slo, args.pin_cpus, args.model) == ("tcp", "ttft=500,itl=50", False, "m")
    assert "s3cret" not in command  # a key is never printed
    assert "--port" not in command  # defaults are left out


def test_a_roofline_plan_for_an_8b_model_on_h200_says_its_assumptions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "profile",
                "--hardware",
                "h200",
                "--model-shape",
                "llama-3.1-8b",
                "--out",
                str(tmp_path / "h200.json"),
            ]
        )
        == 0
    )
    capsys.readouterr()
    code = main([
        "plan", "--profile", str(tmp_path / "h200.json"),
        "--workload", "poisson(2) prompt=lognormal(2000,0.5,64,8000) output=uniform(64,256)",
        "--duration", "20", "--slo", "ttft=500,itl=40", "--budget", "2", "--rate-scales", "1,4",
        "--rate-scale", "2", "--out", str(tmp_path / "plan"),
    ])  # fmt: skip
    assert code == 0
    printed = capsys.readouterr().out
    assert "NVIDIA H200 SXM" in printed and "60% of peak" in printed  # the assumptions, with the plan
    assert "Choice:" in printed
    assert "the fewest workers that meet the SLO, by load" in printed
    # Each load as the workload ran: --rate-scales on top of --rate-scale (4 and 16 requests a second).
    assert "== load x2 of poisson(2)" in printed and "== load x8 of poisson(2)" in printed
    assert "\n| x2 |" in printed and "\n| x8 |" in printed
    report = json.loads((tmp_path / "plan" / "plan.json").read_text())
    assert report["rate_scale"] == 2 and set(report["scales"]) == {"1", "4"}
    assert (tmp_path / "plan" / "plan.png").exists()


def test_plan_without_an_slo_or_budget_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fixed_profile().save(tmp_path / "p.json")
    flags = ["plan", "--profile", str(tmp_path / "p.json"), "--max-requests", "5"]
    assert main([*flags, "--budget", "2"]) == 2
    assert "needs an SLO" in capsys.readouterr().err
    assert main([*flags, "--budget", "0", "--slo", "ttft=100"]) == 2
    assert "--budget must be >= 1" in capsys.readouterr().err
    assert main([*flags, "--budget", "2", "--slo", "ttft=100", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1" in capsys.readouterr().err
    assert main([*flags, "--budget", "2", "--slo", "ttft=100", "--rate-scales", "1,x"]) == 2
    assert "--rate-scales must be numbers" in capsys.readouterr().err
