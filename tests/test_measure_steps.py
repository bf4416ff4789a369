"""The step sweep: the real engine's steps of every kind (prompts, decode batches, mixed), timed as
the engine times them, and each role's step time fitted to the steps it runs."""

from __future__ import annotations

from pathlib import Path

from pdserve.costmodel import Step
from pdserve.measure import steps

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


def test_a_time_budget_stops_the_sweep_early_and_keeps_what_was_measured(tiny_llama: Path) -> None:
    probe = steps.StepProbe(str(tiny_llama), "float32", 1, TINY.chunk, 0.01)
    samples = steps.sweep(probe, TINY, budget_s=0.0)
    assert samples and all(s.step.decode_streams == 0 or s.step.prefill_tokens == 0 for s in samples[:3])
    assert not any(s.step.prefill_tokens and s.step.decode_streams for s in samples)  # no mixed part ran
