"""`pdserve profile --served`: real DPD and colocated servers traced under the climbing load (and, on
two CPUs, a lone colocated worker that leaves one free), and a profile refitted to what they ran."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from test_sim_profile import fixed_profile

from pdserve.measure import served
from pdserve.router.recorder import STEP_TRACE_KEYS
from pdserve.sim.calibrate import calibrated
from pdserve.sim.profile import HostCpu


def test_the_deployments_are_traced_under_load_and_refit_the_profile(
    tmp_path: Path, tiny_llama: Path
) -> None:
    # The workload to plan for, climbing through its rate x0.5, x1, x2, x3.5 (a quarter each):
    # conversations (their later turns carry the answers, re-encoded) and documents.
    workload = (
        "chat: poisson(4) prompt=uniform(16,64) output=uniform(4,24) turns=fixed(2) followup=fixed(8) "
        "think=fixed(10); docs: poisson(0.5) prompt=fixed(200) output=fixed(4)"
    )
    # On two CPUs, which the two-worker deployments fill, a colocated 1 too (at half the load).
    traces = served.trace(str(tiny_llama), tmp_path, threads=1, duration_s=6.0, workload=workload, cpus=2)
    assert [t.name for t in traces] == ["steps-dpd.jsonl", "steps-colocated.jsonl", "steps-colocated-1.jsonl"]
    workers = [{json.loads(line)["worker"] for line in t.read_text().splitlines()} for t in traces]
    assert [len(w) for w in workers] == [2, 2, 1]
    pools = []
    for trace in traces:
        rows = [json.loads(line) for line in trace.read_text().splitlines()]
        assert rows and all(tuple(row) == STEP_TRACE_KEYS for row in rows)
        # The time the loop waited on KV pulls is part of its time around the step.
        assert all(0 <= row["pull_wait_seconds"] <= row["loop_seconds"] for row in rows)
        pools.append({row["pool"] for row in rows})
    assert pools == [{"prefill", "decode"}, {"colocated"}, {"colocated"}]
    # The real decode worker says the blocks of the pulls it waited on; nothing else pulls. Each
    # prompt prefilled on the prefill worker is pulled, at least its last partial block (blocks of
    # 64: a document's 200 tokens end in one). Not all 4 of a document's: the prompts share their
    # first words, and the decode worker pulls only what its prefix cache lacks (the delta pull).
    pulled = [json.loads(line) for line in traces[0].read_text().splitlines()]
    remote_documents = sum(1 for row in pulled if row["pool"] == "prefill" and row["prefill_tokens"] >= 200)
    assert remote_documents > 0
    assert sum(row["pull_blocks"] for row in pulled if row["pool"] == "decode") >= remote_documents
    # ... and the copies' own time (only with blocks: a step that waited on no pull says none).
    assert any(row["pull_seconds"] > 0 for row in pulled if row["pull_blocks"] > 0)
    assert all(row["pull_seconds"] == 0 for row in pulled if row["pull_blocks"] == 0)
    assert all(row["pull_blocks"] == 0 for row in pulled if row["pool"] == "prefill")
    assert all(
        row["pull_blocks"] == 0 for line in traces[1].read_text().splitlines() if (row := json.loads(line))
    )
    base = replace(fixed_profile(), host=HostCpu(cpus=2))
    profile = calibrated(base, traces)
    assert profile.steps_from == "serving"
    assert any("served steps" in a for a in profile.assumptions)
    # Every pool with enough steps is fitted to them; one without keeps the base's, and says so.
    # (the runs that filled the two CPUs: the lone worker's steps only spread around their fit)
    counts = {pool: sum(1 for t in traces[:2] for line in t.read_text().splitlines() if f'"pool": "{pool}"' in line)
              for pool in ("prefill", "decode", "colocated")}  # fmt: skip
    for pool, count in counts.items():
        if count >= 30:
            assert profile.steps[pool] != base.steps.get(pool) and profile.steps[pool].samples == count  # type: ignore[union-attr]
        else:
            assert profile.steps[pool] is base.steps[pool]
            assert any(f"the {pool} pool ran {count} steps" in a for a in profile.assumptions)
    assert counts["decode"] >= 30 and counts["colocated"] >= 30  # a load's worth of decode steps
    lone = len(traces[2].read_text().splitlines())
    assert lone >= 30 and profile.steps["colocated"].free_spread  # type: ignore[union-attr]
    assert any(f"runs with a CPU free of workers ({lone})" in a for a in profile.assumptions)


def test_the_load_climbs_the_staircase_or_the_workload_given() -> None:
    # From light (half the built-in rates: chat 1 a second) to past the knee, a quarter each.
    (builtin,) = served.phases(None, 120.0, 1.0, 7)
    chat = builtin.classes[0].arrival
    assert chat.base.rate == pytest.approx(1.0)  # type: ignore[attr-defined]
    assert [(s.at_s, s.for_s, s.factor) for s in chat.steps] == [(30, 30, 2), (60, 30, 4), (90, 30, 7)]  # type: ignore[attr-defined]
    given = served.phases("poisson(2) prompt=fixed(32) output=fixed(8)", 120.0, 0.5, 7)
    assert [w.duration_s for w in given] == [30.0] * 4
    assert [w.classes[0].arrival.rate for w in given] == pytest.approx([0.5, 1.0, 2.0, 3.5])  # type: ignore[attr-defined]
