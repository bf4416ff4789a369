"""The step sweep: the real engine's steps of every kind (prompts, decode batches, mixed), timed as
the engine times them, and each role's step time fitted to the steps it runs."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from pdserve.costmodel import Step
from pdserve.errors import PdserveError
from pdserve.measure import steps
from pdserve.ops.cpu.linear import PackedLinear

TINY = steps.Sweep(
    prompts=(8, 32, 96),
    chunked_prompt=200,
    batches=(1, 3),
    contexts=(16, 48),
    decode_steps=3,
    mixed_batches=(2,),
    mixed_prompts=(24,),
    repeats=1,
    chunk=64,
    warmup_steps=2,
)


def test_the_sweep_measures_every_kind_of_step_and_the_roles_are_fitted(tiny_llama: Path) -> None:
    probe = steps.StepProbe(str(tiny_llama), "float32", 1, TINY.chunk, 0.01)
    samples = steps.sweep(probe, TINY)
    kinds = {(s.step.prefill_tokens > 0, s.step.decode_streams > 0) for s in samples}
    assert kinds == {(True, False), (False, True), (True, True)}  # prompts, decodes, mixed
    assert {s.step.decode_streams for s in samples} >= {1, 3}
    # The 200-token prompt ran in chunks of 64: chunks deep in the prompt attend to more.
    assert any(s.step.prefill_tokens == 64 and s.step.prefill_attention > 64 * 64 for s in samples)
    assert all(s.seconds > 0 for s in samples)
    assert probe.engine.stats().kv_blocks_used == 0  # every request finished, every block freed
    roles = steps.fit_roles(samples)
    assert set(roles) == {"prefill", "decode", "colocated"}
    prefill = roles["prefill"]
    assert prefill.samples == sum(1 for s in samples if not s.step.decode_streams)
    assert prefill.median_error is not None and prefill.p90_error is not None
    assert all(c >= 0 for c in roles["decode"].coefficients)
    assert roles["decode"].seconds(Step(512, 512 * 256, 0, 0)) >= roles["decode"].seconds(Step(8, 32, 0, 0))


def test_the_probe_says_which_stream_gemv_its_engine_runs(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    probe = steps.StepProbe(str(tiny_llama), "float32", 1, TINY.chunk, 0.01)
    model = probe.engine.runner.model
    streams = [m for m in model.layers.modules() if isinstance(m, PackedLinear) and m.stream is not None]
    passes = steps.stream_passes(probe)
    if not streams:  # this CPU's plan gives fp32 no stream GEMV (or the kernels are not built)
        assert passes is None
    else:  # fp32 over bf16-stored weights: the AVX2 kernel, 4 rows a pass
        assert passes is not None and passes.rows_per_pass == 4
        assert {m.stream_rows for m in streams} == {passes.stream_rows}
        assert passes.logits_rows <= passes.stream_rows
    # An operator who turns the stream GEMV off gets an engine, and a profile, without it.
    monkeypatch.setenv("PDSERVE_STREAM_GEMV", "0")
    assert steps.stream_passes(steps.StepProbe(str(tiny_llama), "float32", 1, TINY.chunk, 0.01)) is None


def test_the_gpu_sweep_runs_each_prompt_in_one_chunk_and_one_deep_in_its_prompt() -> None:
    gpu = steps.GPU
    assert max(gpu.prompts) <= gpu.chunk < gpu.chunked_prompt  # the chunked prompt's later chunks attend deep
    # Every decode batch runs at its shorter context at least, a KV cache of at most max_context_tokens.
    assert all(batch * min(gpu.contexts) <= gpu.max_context_tokens for batch in gpu.batches)
    assert max(gpu.batches) <= 256  # StepProbe's max_num_seqs


def test_a_time_budget_stops_the_sweep_early_and_keeps_what_was_measured(tiny_llama: Path) -> None:
    probe = steps.StepProbe(str(tiny_llama), "float32", 1, TINY.chunk, 0.01)
    samples = steps.sweep(probe, TINY, budget_s=0.0)
    assert samples and all(s.step.decode_streams == 0 or s.step.prefill_tokens == 0 for s in samples[:3])
    assert not any(s.step.prefill_tokens and s.step.decode_streams for s in samples)  # no mixed part ran


def cpu_seconds(pid: int) -> float:
    """The process's CPU time so far (user + system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("kind", ["decode", "prefill24", "spin"])
def test_a_busy_neighbour_of_each_kind_works_until_it_is_let_go(tiny_llama: Path, kind: str) -> None:
    cpu = max(os.sched_getaffinity(0))
    with steps.busy_neighbour(str(tiny_llama), "float32", cpu, kind) as process:
        ready = cpu_seconds(process.pid)
        deadline = time.monotonic() + 120  # an explicit bound: it works at once, on any machine
        while cpu_seconds(process.pid) < ready + 0.5:  # half a CPU-second of work after "ready"
            assert process.poll() is None, f"the {kind} neighbour exited with {process.returncode}"
            assert time.monotonic() < deadline, f"the {kind} neighbour did no work"
            time.sleep(0.05)
    assert process.returncode == 0  # it stopped when its stdin closed, not killed


@pytest.mark.parametrize("kind", ["prefill", "prefill0", "prefillx", "idle"])
def test_an_unknown_neighbour_kind_is_refused_before_anything_starts(kind: str) -> None:
    with (
        pytest.raises(PdserveError, match="unknown neighbour kind"),
        steps.busy_neighbour("no-such-model", "float32", 0, kind),
    ):
        pass


def test_a_neighbour_that_cannot_start_says_so(tiny_llama: Path) -> None:
    # A prompt longer than the tiny model's context: refused before "ready", not after.
    cpu = max(os.sched_getaffinity(0))
    with (
        pytest.raises(PdserveError, match="before it was ready"),
        steps.busy_neighbour(str(tiny_llama), "float32", cpu, "prefill100000"),
    ):
        pass
