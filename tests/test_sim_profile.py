"""A profile: step and transfer times as written, read back the same, hand-checked predictions, and
clear errors for a file that is not one."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from pdserve.costmodel import Step
from pdserve.sim import profile as profiles
from pdserve.sim.profile import LoopTime, Overhead, Profile, ServedPull, TransferTime
from pdserve.sim.step_time import LinearStep, ProfileError, RooflineStep, Spread, StreamPasses

SHAPE = {
    "model_type": "llama", "vocab_size": 1000, "hidden_size": 64, "intermediate_size": 128,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    "tie_word_embeddings": True,
}  # fmt: skip


def fixed_profile(
    step: float = 0.01,
    per_token: float = 0.0,
    per_stream: float = 0.0,
    pull: float = 0.0,
    request_s: float = 0.0,
    step_s: float = 0.0,
    start_s: float = 0.0,
    blocks: int = 1024,
) -> Profile:
    """A hand-computable profile: a step costs `step` + `per_token` a prompt token + `per_stream` a
    decode stream; a pull `pull`."""
    linear = LinearStep((step, per_token, 0.0, per_stream, 0.0))
    return Profile(
        source="measured",
        model="tiny",
        model_shape=SHAPE,
        block_size=16,
        kv_blocks={"prefill": blocks, "decode": blocks, "colocated": blocks},
        steps={"prefill": linear, "decode": linear},
        transfers={"shm": TransferTime(pull, 0.0), "tcp": TransferTime(pull, 0.0)},
        overhead=Overhead(request_s, step_s),
        start_s=start_s,
        meta={"device": "cpu"},
    )


def test_a_profile_reads_back_as_written(tmp_path: Path) -> None:
    original = fixed_profile(0.01, 1e-4, 2e-3, 0.005, 0.002, 0.001, 7.5)
    roofline = RooflineStep(0.004, 16e9, 1e6, 16e9, 131072, 6e14, 3.8e12)
    bands = (Spread(0.05, (0.9, 1.0, 3.0)), Spread(None, (0.95, 1.0, 1.2)))
    spread = LinearStep(
        (0.01, 1e-4, 0.0, 2e-3, 0.0),
        samples=40,
        median_error=0.05,
        spread=bands,
        mixed_spread=(1.0, 1.1, 1.4),
        free_spread=(Spread(None, (0.97, 1.0, 1.05)),),
        free_mixed_spread=(0.9, 0.95, 1.0),
    )
    original = replace(
        original,
        steps={**original.steps, "colocated": roofline, "decode": spread},
        steps_from="serving",
        start_busy_s=21.5,
        loops={"decode": LoopTime(0.001, 2e-4, ((1, 5e-4), (4, 9e-4))), "prefill": LoopTime(0.0015)},
        free_loops={"decode": LoopTime(0.0005, 1e-4, ((1, 3e-4),))},
        pulls={
            "decode": ServedPull(
                "shm",
                TransferTime(0.002, 1e-4),
                TransferTime(0.003, 3e-4),
                41,
                TransferTime(0.001, 1e-4),
                TransferTime(0.001, 2e-4),
            ),
            "colocated": ServedPull("tcp", TransferTime(0.002, 1e-4), TransferTime(0.003, 3e-4)),
        },
    )
    original.save(tmp_path / "p.json")
    back = profiles.load(tmp_path / "p.json")
    assert back == original
    assert back.model_config().num_layers == 2
    # A loop without traced counts writes none (older readers read it as before); a loop with a key
    # it does not know is refused, by where it is.
    body = json.loads((tmp_path / "p.json").read_text())
    # A step without a free runs' spread writes none (older readers read it as before); a bad one
    # is refused by where it is.
    assert "free_spread" in body["steps"]["decode"] and "free_spread" not in body["steps"]["prefill"]
    bad = json.loads(json.dumps(body))
    bad["steps"]["decode"]["free_spread"] = [{"below_s": None}]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match=r"steps\.decode\.free_spread\[0\] must be"):
        profiles.load(tmp_path / "bad.json")
    bad["steps"]["decode"]["free_spread"], bad["steps"]["decode"]["free_mixed_spread"] = [], ["x"]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match=r"steps\.decode\.free_mixed_spread must be a list of ratios"):
        profiles.load(tmp_path / "bad.json")
    # A profile without free runs' loops writes none; a bad one is refused by where it is.
    assert "free_loops" not in replace(original, free_loops={}).to_json()
    assert back.loop_time("colocated", free_cpu=True) == original.free_loops["decode"]
    assert back.loop_time("prefill", free_cpu=True) == back.loop_time("prefill")  # none of its own
    # A colocated role's own loop before the decode pool's free one; the decode pool's where it has none.
    own = replace(back, loops={**back.loops, "colocated": LoopTime(0.003)})
    assert own.loop_time("colocated", free_cpu=True) == LoopTime(0.003)
    assert back.loop_time("colocated") == back.loops["decode"]
    bad = json.loads(json.dumps(body))
    bad["free_loops"]["decode"]["per_step"] = 0.001
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(ProfileError, match=r"free_loops\.decode must be an object of"):
        profiles.load(tmp_path / "bad.json")
    assert "by_streams" in body["loops"]["decode"] and "by_streams" not in body["loops"]["prefill"]
    body["loops"]["decode"]["by_stream"] = body["loops"]["decode"].pop("by_streams")
    (tmp_path / "p.json").write_text(json.dumps(body))
    with pytest.raises(ProfileError, match=r"loops\.decode must be an object of"):
        profiles.load(tmp_path / "p.json")


def test_a_profile_with_the_stream_gemv_reads_back_and_bad_ones_are_refused(tmp_path: Path) -> None:
    passes = StreamPasses(4, 32, 32)
    step = LinearStep((0.008, 0.003, 0.0, 0.002, 0.0), passes=passes, pass_coefficients=(0.012, 0.15, 0.001))
    original = replace(
        fixed_profile(), steps={"prefill": LinearStep((0.02, 0.003, 0.0, 0.0, 0.0)), "decode": step}
    )
    original.save(tmp_path / "p.json")
    assert profiles.load(tmp_path / "p.json") == original
    body = json.loads((tmp_path / "p.json").read_text())
    # A step without the GEMV writes no keys of it: older readers read it as before.
    assert "passes" not in body["steps"]["prefill"] and "pass_coefficients" not in body["steps"]["prefill"]
    assert body["steps"]["decode"]["passes"] == {"rows_per_pass": 4, "stream_rows": 32, "logits_rows": 32}
    shape = r'steps\.decode: passes must be \{"rows_per_pass": n, "stream_rows": n, "logits_rows": n\}'
    bad = [
        ({"passes": {"rows_per_pass": 4, "stream_rows": 32}}, shape),
        ({"passes": {"rows_per_pass": 4, "stream_rows": 32, "logits_rows": True}}, shape),
        ({"passes": {"rows_per_pass": 4.5, "stream_rows": 32, "logits_rows": 32}}, shape),
        ({"passes": [4, 32, 32]}, shape),
        ({"passes": {"rows_per_pass": 0, "stream_rows": 32, "logits_rows": 32}}, "rows_per_pass >= 1"),
        ({"pass_coefficients": [0.012, -0.1, 0.0]}, "pass_coefficients must be 3 finite numbers >= 0"),
        ({"pass_coefficients": [0.012, 0.1]}, "pass_coefficients must be 3 finite numbers >= 0"),
        ({"pass_coefficients": None}, r"steps\.decode: passes without pass_coefficients"),
    ]
    for change, message in bad:
        broken = json.loads(json.dumps(body))
        broken["steps"]["decode"].update(change)
        (tmp_path / "bad.json").write_text(json.dumps(broken))
        with pytest.raises(ProfileError, match=message):
            profiles.load(tmp_path / "bad.json")
    del body["steps"]["decode"]["passes"]
    (tmp_path / "bad.json").write_text(json.dumps(body))
    with pytest.raises(ProfileError, match=r"steps\.decode: pass_coefficients without passes"):
        profiles.load(tmp_path / "bad.json")


def test_a_role_without_its_own_step_time_and_a_missing_transport() -> None:
    p = fixed_profile()
    assert p.step_time("colocated") is p.steps["decode"]  # a mixed worker steps as a decode one
    with pytest.raises(ProfileError, match="no transfer time for --transport nixl"):
        p.transfer("nixl")
    assert p.transfer("shm").seconds(10) == 0.0
    # The worker loop: the overhead's for every role, unless a role has its own (a served fit).
    assert p.loop_time("decode") == LoopTime(p.overhead.step_s, p.overhead.stream_s)
    served = replace(p, loops={"decode": LoopTime(0.002, 1e-4)})
    assert served.loop_time("colocated") == LoopTime(0.002, 1e-4)
    assert served.loop_time("prefill") == LoopTime(p.overhead.step_s, p.overhead.stream_s)
    # A served loop with its traced counts: each count's own, between two close ones the line
    # between them; below the first, past the last and across a wide gap, the loop's line.
    traced_loop = LoopTime(0.002, 1e-4, ((1, 5e-4), (3, 9e-4), (4, 1.5e-3), (12, 3e-3)))
    assert [traced_loop.seconds(n) for n in (1, 2, 3, 4)] == pytest.approx([5e-4, 7e-4, 9e-4, 1.5e-3])
    for untraced in (0, 5, 11, 13):
        assert traced_loop.seconds(untraced) == pytest.approx(0.002 + untraced * 1e-4)
    assert traced_loop.seconds(12) == pytest.approx(3e-3)
    assert LoopTime(0.002, 1e-4, [[1, 5e-4]]).by_streams == ((1, 5e-4),)  # as JSON reads it: tuples
    for bad in (
        ((2, 1e-3), (1, 1e-3)),
        ((0, 1e-3),),
        ((1, -1e-3),),
        ((1, 1e-3), (1, 2e-3)),
        ((1.5, 1e-3),),
        ((1,),),
    ):
        with pytest.raises(ProfileError, match="by_streams must be"):
            LoopTime(0.002, 1e-4, bad)  # type: ignore[arg-type]
    # A served pull wait: for its role (a mixed worker: the decode one's) and its transport only.
    pull = ServedPull("shm", TransferTime(0.002, 1e-4), TransferTime(0.004, 3e-4))
    assert p.served_pull("decode", "shm") is None
    served = replace(p, pulls={"decode": pull})
    assert served.served_pull("decode", "shm") is pull and served.served_pull("colocated", "shm") is pull
    assert served.served_pull("decode", "tcp") is None
    assert pull.seconds(10, 0.0) == pytest.approx(0.003)
    assert pull.seconds(10, 0.5) == pytest.approx(0.003 + (0.007 - 0.003) * 0.5)
    # Its copy's own part: the whole wait where not traced, else its own line, never past the wait.
    assert pull.copy_seconds(10, 0.5) == pull.seconds(10, 0.5)
    traced = replace(pull, copy_alone=TransferTime(0.001, 1e-4), copy_busy=TransferTime(0.001, 1e-3))
    assert traced.copy_seconds(10, 0.0) == pytest.approx(0.002)
    assert traced.copy_seconds(10, 1.0) == pytest.approx(traced.seconds(10, 1.0))  # 11 ms of copy: capped


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("not json", "is not JSON"),
        (json.dumps({"format": "something else"}), "is not a pdserve profile"),
        (json.dumps({"format": profiles.FORMAT, "source": "measured"}), "incomplete or malformed"),
    ],
)
def test_a_file_that_is_not_a_profile_is_said_so(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ProfileError, match=message):
        profiles.load(path)


def test_a_negative_or_missing_pull_or_start_time_is_refused_by_where_it_is(tmp_path: Path) -> None:
    pull = ServedPull("shm", TransferTime(0.002, 1e-4), TransferTime(0.003, 3e-4))
    good = replace(fixed_profile(), pulls={"decode": pull}).to_json()
    cases = [
        (
            ("transfers", "shm", "per_block_s"),
            -1e-4,
            r"transfers\.shm: base_s and per_block_s must be finite",
        ),
        (("pulls", "decode", "busy", "base_s"), float("nan"), r"pulls\.decode\.busy: base_s and per_block_s"),
        (("pulls", "decode", "copy_alone"), {"base_s": -1, "per_block_s": 0}, r"pulls\.decode\.copy_alone: "),
        (("pulls", "decode", "alone"), {"base_s": 0.001}, "incomplete or malformed"),
        (("start_busy_s",), -3.0, r"start_busy_s must be a finite number of seconds >= 0, got -3\.0"),
        (("start_s",), float("inf"), "start_s must be a finite number"),
    ]
    for path, value, message in cases:
        body = json.loads(json.dumps(good))
        node = body
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        (tmp_path / "p.json").write_text(json.dumps(body))
        with pytest.raises(ProfileError, match=message):
            profiles.load(tmp_path / "p.json")


def test_negative_coefficients_and_unknown_kinds_are_refused(tmp_path: Path) -> None:
    body = fixed_profile().to_json()
    body["steps"]["decode"]["coefficients"] = [0.01, -1, 0, 0, 0]
    (tmp_path / "p.json").write_text(json.dumps(body))
    with pytest.raises(ProfileError, match="finite numbers >= 0"):
        profiles.load(tmp_path / "p.json")
    body["steps"]["decode"]["coefficients"] = [0.01, 0, 0, 0, 0]
    ratios = r"steps\.decode: a step time's spread must be ascending ratios > 0"
    shape = r"steps\.decode\.spread\[0\] must be \{\"below_s\""
    ends = r"steps\.decode: a step time's spread bands must end \(below_s\) at ascending seconds > 0"
    band = {"below_s": None, "quantiles": [1.0]}
    bad_spreads = [
        ([{"below_s": None, "quantiles": [1.2, 0.9]}], ratios),  # quantiles ascend
        ([{"below_s": None, "quantiles": [0.0, 1.0]}], ratios),  # a step takes time
        ([{"below_s": None, "quantiles": []}], ratios),
        ([{"below_s": None, "quantiles": ["x"]}], shape),
        ([{"below_s": None, "quantiles": "123"}], shape),
        ([{"quantiles": [1.0]}], shape),
        ([[0.05, [1.0]]], shape),
        ({"below_s": None}, r"steps\.decode\.spread must be a list of bands"),
        ([{"below_s": 0.2, "quantiles": [1.0]}, {"below_s": 0.1, "quantiles": [1.0]}], ends),  # ascending
        ([{"below_s": -0.1, "quantiles": [1.0]}], ends),
        ([{"below_s": float("nan"), "quantiles": [1.0]}], ends),
        (
            [band, {"below_s": 0.1, "quantiles": [1.0]}],
            r"only a step time's last spread band may have no end",
        ),
    ]
    for spread, message in bad_spreads:
        body["steps"]["decode"]["spread"] = spread
        (tmp_path / "p.json").write_text(json.dumps(body))
        with pytest.raises(ProfileError, match=message):
            profiles.load(tmp_path / "p.json")
    del body["steps"]["decode"]["spread"]
    mixed = r"steps\.decode\.mixed_spread must be a list of ratios"
    for bad, message in (
        ([1.2, 0.9], ratios),
        ([0.0], ratios),
        (["x"], mixed),
        (1.1, mixed),
        ([True], mixed),
    ):
        body["steps"]["decode"]["mixed_spread"] = bad
        (tmp_path / "p.json").write_text(json.dumps(body))
        with pytest.raises(ProfileError, match=message):
            profiles.load(tmp_path / "p.json")
    del body["steps"]["decode"]["mixed_spread"]
    body["steps"]["decode"] = {"kind": "cubic"}
    (tmp_path / "p.json").write_text(json.dumps(body))
    with pytest.raises(ProfileError, match="linear or roofline"):
        profiles.load(tmp_path / "p.json")
    body = fixed_profile().to_json() | {"steps_from": "guessed"}
    (tmp_path / "p.json").write_text(json.dumps(body))
    with pytest.raises(ProfileError, match="steps_from must be one of alone, serving"):
        profiles.load(tmp_path / "p.json")
    with pytest.raises(ProfileError, match="cannot read"):
        profiles.load(tmp_path / "missing.json")


COMMITTED = sorted((Path(__file__).resolve().parents[1] / "profiles").glob("*.json"))


@pytest.mark.parametrize("path", COMMITTED, ids=[p.name for p in COMMITTED])
def test_every_committed_profile_loads_and_predicts_steps(path: Path) -> None:
    """The profiles kept as data (docs/capacity-planning.md) still read under this version, and say
    a longer time for a longer prompt; one holding a speed check can be scaled by a check of a host
    (`pdserve sim --speed-check`): against its own check, by exactly x1."""
    from pdserve.sim import speed

    profile = profiles.load(path)
    for role, step in profile.steps.items():
        short, long = step.seconds(Step(64, 64 * 64, 0, 0)), step.seconds(Step(512, 512 * 512, 0, 0))
        assert 0 < short < long, (role, short, long)
    if "speed_check" in profile.meta:
        check = speed.reference(profile, str(path))
        factor, pairs = speed.speed_factor(check, check)
        assert factor == 1.0 and pairs == len(check.steps) >= speed.MIN_PAIRS
        assert speed.scaled(profile, factor).steps["decode"].seconds(Step(0, 0, 4, 512)) == pytest.approx(
            profile.steps["decode"].seconds(Step(0, 0, 4, 512))
        )


def test_the_committed_cpu_profiles_hold_a_speed_check() -> None:
    """Every committed CPU profile was measured with the check (the AMX Xeon's again 2026-12-07 for
    it): `pdserve sim --profile profiles/cpu-amx-xeon-smollm2-served.json --speed-check now.json`
    works on such a host."""
    metas = {p.name: json.loads(p.read_text())["meta"] for p in COMMITTED}
    cpu = {name for name, meta in metas.items() if meta.get("device") == "cpu"}
    assert {
        "cpu-amx-xeon-smollm2.json",
        "cpu-amx-xeon-smollm2-served.json",
        "cpu-avx2-epyc-smollm2.json",
    } <= cpu
    assert all("speed_check" in metas[name] for name in cpu), sorted(
        n for n in cpu if "speed_check" not in metas[n]
    )
