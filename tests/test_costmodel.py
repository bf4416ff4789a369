"""The cost model: a non-negative least-squares fit of step time, and what it predicts. Pure."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from pdserve import clock, slo
from pdserve.costmodel import (
    _SCALE as SCALE,
)
from pdserve.costmodel import (
    Step,
    StepCostModel,
    chunk_attention,
    pool_wait_quantile,
    workers_for_wait,
)

# A made-up machine: 5 ms a step, 40 us a prompt token, 2 ns per attended position, 0.5 ms a
# stream, 1 us per token of context.
TRUE = (0.005, 40e-6, 2e-9, 0.0005, 1e-6)


def true_seconds(step: Step) -> float:
    raw = (1, step.prefill_tokens, step.prefill_attention, step.decode_streams, step.decode_context)
    return sum(c * x for c, x in zip(TRUE, raw, strict=True))


def fitted(noise: float = 0.0, n: int = 400, seed: int = 0) -> StepCostModel:
    rng = random.Random(seed)
    model = StepCostModel()
    for _ in range(n):
        if rng.random() < 0.5:  # a prefill step
            tokens = rng.randint(16, 512)
            start = rng.choice([0, 256, 1024])
            step = Step(tokens, chunk_attention(start, tokens))
        else:  # a decode step
            streams = rng.randint(1, 32)
            step = Step(0, 0, streams, streams * rng.randint(50, 1500))
        model.add(step, true_seconds(step) * (1 + rng.gauss(0, noise)))
    return model


def test_fit_recovers_the_machine_from_its_steps() -> None:
    coef = fitted().coefficients()
    assert coef is not None
    for got, want in zip(coef, TRUE, strict=True):
        assert got == pytest.approx(want, rel=0.02, abs=1e-7)


def test_noisy_steps_still_predict_within_a_few_percent() -> None:
    model = fitted(noise=0.1, n=1500)
    for step in (Step(256, chunk_attention(0, 256)), Step(0, 0, 16, 16 * 800)):
        assert model.step_seconds(step) == pytest.approx(true_seconds(step), rel=0.05)


def test_not_ready_until_enough_samples_and_says_so() -> None:
    model = StepCostModel(min_samples=30)
    for _ in range(29):
        model.add(Step(100, 5000), 0.01)
    assert not model.ready and model.coefficients() is None
    with pytest.raises(RuntimeError, match="too few samples"):
        model.step_seconds(Step(1))
    model.add(Step(100, 5000), 0.01)
    assert not model.ready  # 30 steps, but no decode step among them: streams are a guess
    for _ in range(4):
        model.add(Step(0, 0, 2, 200), 0.01)
    assert model.ready


def test_not_ready_on_decode_steps_alone_even_as_the_window_turns_over() -> None:
    # What a server's first seconds look like: streams decoding, one short prompt.
    model = StepCostModel(window=50, min_samples=12)
    model.add(Step(70, chunk_attention(0, 70)), 0.3)
    for _ in range(20):
        model.add(Step(0, 0, 1, 100), 0.05)
    assert not model.ready
    for tokens in (64, 128, 256):
        model.add(Step(tokens, chunk_attention(0, tokens)), 0.01 * tokens)
    assert model.ready
    for _ in range(60):  # the prompt steps fall out of the window: not ready again
        model.add(Step(0, 0, 1, 100), 0.05)
    assert not model.ready


def test_a_window_turned_over_many_times_fits_as_its_last_steps_alone_would() -> None:
    # The fit keeps the window's sums as steps come and go: after 40 turns of the window (steps
    # of very different sizes, a 2048-token prompt's attention beside single decode streams),
    # it predicts what a model given only the window's last steps predicts.
    rng = random.Random(3)
    steps = []
    for _ in range(2000):
        if rng.random() < 0.5:
            tokens = rng.randint(1, 2048)
            step = Step(tokens, chunk_attention(rng.choice([0, 2048]), tokens))
        else:
            streams = rng.randint(1, 64)
            step = Step(0, 0, streams, streams * rng.randint(1, 4000))
        steps.append((step, true_seconds(step) * (1 + rng.gauss(0, 0.2))))
    turned = StepCostModel(window=50, min_samples=12)
    for step, seconds in steps:
        turned.add(step, seconds)
    last_only = StepCostModel(window=50, min_samples=12)
    for step, seconds in steps[-50:]:
        last_only.add(step, seconds)
    got, want = turned.coefficients(), last_only.coefficients()
    assert got is not None and want is not None
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, rel=1e-9, abs=1e-15)


def test_coefficients_never_negative_so_more_work_never_costs_less() -> None:
    model = StepCostModel(min_samples=5, min_each=0)
    # Decode steps whose time falls as streams grow (noise on a busy machine): a plain fit would
    # give streams a negative weight.
    for streams, seconds in [(1, 0.030), (2, 0.029), (4, 0.028), (8, 0.027), (16, 0.026), (32, 0.025)]:
        model.add(Step(0, 0, streams, streams * 100), seconds)
    coef = model.coefficients()
    assert coef is not None and all(c >= 0 for c in coef)
    assert model.decode_step_seconds(32, 100) >= model.decode_step_seconds(1, 100) - 1e-12


def test_stall_margin_is_the_recent_under_prediction_of_prompt_steps_beside_streams() -> None:
    model = fitted()
    mixed = [Step(t, chunk_attention(0, t), 8, 4000) for t in range(8, 48)]
    for step in mixed[:19]:  # predicted right, and too few to judge by anyway
        model.add(step, true_seconds(step))
    assert model.mixed_step_margin() == 1.0
    for step in mixed[19:]:
        model.add(step, true_seconds(step))
    assert model.mixed_step_margin() == pytest.approx(1.0, abs=0.02)  # never below 1
    # Pure prompt or pure decode steps, however slow, are not what a local prefill makes.
    model.add(Step(256, chunk_attention(0, 256)), 10 * true_seconds(Step(256, chunk_attention(0, 256))))
    assert model.mixed_step_margin() == pytest.approx(1.0, abs=0.02)
    # The mixed steps start to run 1.5x what the model predicts for them: once they are over 10%
    # of the window, its p90 says so.
    for step in mixed[:30]:
        model.add(step, 1.5 * model.step_seconds(step))
    assert model.mixed_step_margin() == pytest.approx(1.5, rel=0.02)


def test_stall_margin_is_the_fit_of_the_moments_not_a_young_fits() -> None:
    # A young fit (a dozen steps: short decode contexts, short prompts) cannot see what context
    # costs and under-predicts the first mixed steps (8 streams at 4000 tokens of context) by 30%
    # and more. Once the fit has seen long contexts it predicts those same steps right: the margin
    # follows, though no mixed step came since (a margin from the young fit's errors would keep
    # local prefills off, and with them the mixed steps that could correct it).
    async def main() -> tuple[float, float]:
        model = StepCostModel()  # refits at most once a second (of virtual time here)
        for i in range(12):
            step = Step(16 + i, chunk_attention(0, 16 + i)) if i % 2 else Step(0, 0, 1 + i, 10 * (1 + i))
            model.add(step, true_seconds(step))
        mixed = [Step(t, chunk_attention(0, t), 8, 4000) for t in range(8, 32)]
        young_error = min(true_seconds(step) / model.step_seconds(step) for step in mixed)
        for step in mixed:
            model.add(step, true_seconds(step))
        await asyncio.sleep(1.0)
        for streams in range(1, 33):  # long contexts, no prompt tokens beside them
            for context in (500, 1000, 1500):
                step = Step(0, 0, streams, streams * context)
                model.add(step, true_seconds(step))
        return young_error, model.mixed_step_margin()

    young_error, margin = clock.run_virtual(main)
    assert young_error > 1.3
    assert margin == pytest.approx(1.0, abs=0.02)


def test_stall_margin_is_taken_at_the_slo_s_percentile() -> None:
    # Steps that scatter around the prediction: 1.00x to 1.99x. The p50 of that is about 1.5x,
    # the p99 about 2x: an ITL SLO held at p99 needs the wider margin.
    model = fitted()
    for i in range(100):
        step = Step(8 + i, chunk_attention(0, 8 + i), 8, 4000)
        model.add(step, (1 + i / 100) * model.step_seconds(step))
    assert model.mixed_step_margin(0.5) == pytest.approx(1.49, abs=0.01)
    assert model.mixed_step_margin(0.99) == pytest.approx(1.98, abs=0.01)


def test_stall_margin_kept_step_by_step_is_the_one_reckoned_from_the_whole_window() -> None:
    # The margin's ratios are kept as mixed steps come (all again after a refit): through refits
    # and the window turning over, it is what the window's ratios by the fit of the moment say.
    async def main() -> list[tuple[float, float]]:
        rng = random.Random(3)
        model = StepCostModel()
        seen: list[tuple[float, float]] = []
        for i in range(700):
            tokens = rng.randint(4, 64)
            step = Step(tokens, chunk_attention(0, tokens), rng.randint(1, 16), rng.randint(100, 8000))
            model.add(step, true_seconds(step) * rng.uniform(0.8, 1.6))
            if i % 7 == 0:
                decode = Step(0, 0, rng.randint(1, 32), rng.randint(100, 20000))
                model.add(decode, true_seconds(decode))
            if i % 25 == 0:
                await asyncio.sleep(1.0)  # a refit is due
            if i % 3 == 0 and model.ready:
                kept = model.mixed_step_margin(0.9)
                coef = model.coefficients()
                assert coef is not None
                recent = list(model._mixed)  # (scaled features, seconds) of the last 200
                ratios = [
                    seconds / predicted
                    for features, seconds in recent
                    if (predicted := sum(c * x / s for c, x, s in zip(coef, features, SCALE, strict=True)))
                    > 0
                ]
                if len(ratios) >= 20:  # (1 until 20 mixed steps were seen)
                    seen.append((kept, max(1.0, slo.quantile(ratios, 0.9) or 1.0)))
        return seen

    seen = clock.run_virtual(main)
    assert len(seen) > 200
    for kept, whole in seen:
        assert kept == pytest.approx(whole, rel=1e-9)
    assert max(kept for kept, _ in seen) > 1.2  # the steps ran over: a margin there was to keep


def test_prompts_ahead_share_each_step_until_they_are_done_as_the_engine_chunks_them() -> None:
    # Worked by hand: chunks of 256 within 512 tokens a step, two streams beside them (510 left).
    # Ahead: 300 and 100 tokens; the new prompt 600. Step 1: 256 + 100 + 154 of the new one;
    # step 2: the first's last 44, then 256 of the new one; step 3: the new one's last 190.
    model = fitted()
    kw = {"chunk": 256, "budget": 512, "short_first": False, "decode_streams": 2, "decode_context": 900}
    steps = [
        Step(510, chunk_attention(0, 256) + chunk_attention(0, 100) + chunk_attention(0, 154), 2, 900),
        Step(300, chunk_attention(256, 44) + chunk_attention(154, 256), 2, 900),
        Step(190, chunk_attention(410, 190), 2, 900),
    ]
    running = Step(356, chunk_attention(0, 256) + chunk_attention(0, 100), 2, 900)  # not the new one
    expected = 0.5 * model.step_seconds(running) + sum(model.step_seconds(step) for step in steps)
    seconds, longest = model.prefill_finish_seconds(600, (300, 100), **kw)  # type: ignore[arg-type]
    assert seconds == pytest.approx(expected, rel=1e-12)
    assert longest == pytest.approx(max(model.step_seconds(step) for step in steps), rel=1e-12)


def test_a_short_prompt_on_a_busy_prefill_worker_waits_only_for_the_step_in_progress() -> None:
    model = fitted()
    long_chunk = true_seconds(Step(256, chunk_attention(0, 256)))
    ttft, _ = model.prefill_finish_seconds(100, (2000,), chunk=256, budget=2048, short_first=True)
    own = true_seconds(Step(100, chunk_attention(0, 100)))
    assert ttft == pytest.approx(0.5 * long_chunk + own, rel=0.05)


def test_a_short_prompt_waits_for_no_step_on_a_worker_that_interrupts_its_steps() -> None:
    # A prefill worker that runs a short prompt between two layers of the step in progress (when
    # the prompts of that step have more left than it): its own prefill, no half step before it.
    model = fitted()
    own = true_seconds(Step(100, chunk_attention(0, 100)))
    kw = {"chunk": 256, "budget": 2048, "short_first": True, "interrupts": True}
    ttft, _ = model.prefill_finish_seconds(100, (2000,), **kw)  # type: ignore[arg-type]
    assert ttft == pytest.approx(own, rel=0.05)
    # ... but a step that has less left than the new prompt ends first (shortest remaining first).
    nearly_done, _ = model.prefill_finish_seconds(100, (120,), **kw)  # type: ignore[arg-type]
    as_before, _ = model.prefill_finish_seconds(100, (120,), chunk=256, budget=2048, short_first=True)
    assert nearly_done == as_before > own
    # ... and a prompt longer than a chunk never jumps in: it waits as before.
    waits, _ = model.prefill_finish_seconds(300, (2000,), **kw)  # type: ignore[arg-type]
    no_jump, _ = model.prefill_finish_seconds(300, (2000,), chunk=256, budget=2048, short_first=True)
    assert waits == no_jump


def test_a_long_prompt_shares_steps_with_the_prompts_ahead() -> None:
    model = fitted()
    alone = model.prefill_alone_seconds(2048, 256, 2048)
    behind_one, _ = model.prefill_finish_seconds(2048, (2048,), chunk=256, budget=2048, short_first=True)
    behind_four, _ = model.prefill_finish_seconds(2048, (2048,) * 4, chunk=256, budget=2048, short_first=True)
    assert alone < behind_one < behind_four
    # Eight chunks of 256 fit the budget: four prompts ahead make every step about five chunks.
    assert behind_four > 3 * alone


def test_a_cached_prefix_is_not_computed_again_but_still_attended_to() -> None:
    model = fitted()
    whole = model.prefill_alone_seconds(1024, 256, 2048)
    rest = model.prefill_alone_seconds(1024, 256, 2048, cached=768)
    # The last 256 tokens only, attending to the 768 before them: one step, dearer than a fresh
    # 256-token prompt.
    assert rest == pytest.approx(true_seconds(Step(256, chunk_attention(768, 256))), rel=0.05)
    assert model.prefill_alone_seconds(256, 256, 2048) < rest < whole / 2
    # All of it cached: the last token is still computed (the worker samples from its logits).
    assert model.prefill_alone_seconds(1024, 256, 2048, cached=1024) == pytest.approx(
        true_seconds(Step(1, chunk_attention(1023, 1))), rel=0.05
    )
    busy, _ = model.prefill_finish_seconds(
        1024, (2048,), chunk=256, budget=2048, short_first=True, cached=768
    )
    assert busy < model.prefill_finish_seconds(1024, (2048,), chunk=256, budget=2048, short_first=True)[0]


def test_a_local_prefill_stalls_the_decode_streams_by_its_chunk() -> None:
    model = fitted()
    quiet = model.decode_step_seconds(8, 500)
    ttft, longest = model.prefill_finish_seconds(
        600, (), chunk=512, budget=2048, short_first=False, decode_streams=8, decode_context=4000
    )
    assert longest > quiet
    assert longest == pytest.approx(true_seconds(Step(512, chunk_attention(0, 512), 8, 4000)), rel=0.05)
    assert ttft > longest  # two chunks, plus half the step in progress


def test_largest_chunk_within_a_step_budget_checks_the_prompt_s_dearest_chunk() -> None:
    model = fitted()

    def last_chunk(c: int) -> float:
        return model.step_seconds(Step(c, chunk_attention(2000 - c, c), 8, 4000))

    c = model.largest_chunk_within(0.020, 2000, 8, 4000, limit=512)  # 13 ms of streams, 7 for tokens
    assert 0 < c < 512 and last_chunk(c) <= 0.020 < last_chunk(c + 1)
    assert model.largest_chunk_within(10.0, 300, 8, 4000, limit=512) == 300  # the whole prompt fits
    assert model.largest_chunk_within(10.0, 3000, 8, 4000, limit=512) == 512  # never above the chunk
    assert model.largest_chunk_within(0.010, 300, 8, 4000, limit=512) == 0  # the streams alone exceed it
    # Fitted on prompts of up to 100 tokens only: chunks of at most 200, whatever the fit says.
    small = StepCostModel(min_samples=5)
    for tokens in (20, 50, 100, 60, 80):
        small.add(
            Step(tokens, chunk_attention(0, tokens)), true_seconds(Step(tokens, chunk_attention(0, tokens)))
        )
    for streams in (1, 2, 4, 8):
        small.add(Step(0, 0, streams, streams * 100), true_seconds(Step(0, 0, streams, streams * 100)))
    assert small.largest_chunk_within(10.0, 3000, 8, 4000, limit=512) == 200


def test_chunk_within_adds_a_chunk_to_a_step_already_partly_filled() -> None:
    model = fitted()
    base = Step(100, chunk_attention(0, 100), 8, 4000)  # another prompt's chunk and eight streams

    def with_chunk(c: int) -> float:
        return model.step_seconds(Step(100 + c, base.prefill_attention + chunk_attention(1500, c), 8, 4000))

    c = model.chunk_within(0.030, base, start=1500, limit=512)
    assert 0 < c < 512 and with_chunk(c) <= 0.030 < with_chunk(c + 1)
    # Further into its prompt a chunk attends to more: fewer tokens fit the same step.
    assert model.chunk_within(0.030, base, start=0, limit=512) > c
    assert model.chunk_within(10.0, base, start=0, limit=64) == 64
    assert model.chunk_within(model.step_seconds(base), base, start=0, limit=512) == 0


def test_max_streams_within_an_itl_is_the_largest_batch_under_it() -> None:
    model = fitted()
    n = model.max_streams_within(0.030, 1000, limit=256)
    assert model.decode_step_seconds(n, 1000) <= 0.030 < model.decode_step_seconds(n + 1, 1000)
    assert model.max_streams_within(0.001, 1000, limit=256) == 0  # not even one
    assert model.max_streams_within(10.0, 1000, limit=64) == 64


def test_wait_quantile_grows_with_load_and_is_infinite_when_the_pool_cannot_keep_up() -> None:
    service = 0.5
    assert pool_wait_quantile(0.0, service, 1, 0.9) == 0.0
    assert pool_wait_quantile(0.1, service, 1, 0.9) == 0.0  # rho 0.05: 90% never wait
    light = pool_wait_quantile(1.0, service, 1, 0.9)
    heavy = pool_wait_quantile(1.8, service, 1, 0.9)
    assert 0 < light < heavy
    assert math.isinf(pool_wait_quantile(2.0, service, 1, 0.9))
    assert pool_wait_quantile(1.8, service, 2, 0.9) < heavy
    # M/M/1: P(W > t) = rho exp(-(mu - lambda) t)
    rho, mu, lam = 0.9, 2.0, 1.8
    assert heavy == pytest.approx(math.log(rho / 0.1) / (mu - lam))


def test_workers_for_wait_is_the_fewest_that_meet_it() -> None:
    k = workers_for_wait(5.0, 0.5, 0.9, 0.2)
    assert pool_wait_quantile(5.0, 0.5, k, 0.9) <= 0.2 < pool_wait_quantile(5.0, 0.5, k - 1, 0.9)
    assert workers_for_wait(0.0, 0.5, 0.9, 0.2) == 0
    assert workers_for_wait(1.0, 0.5, 0.9, 1e9, max_utilisation=0.5) == 1
    assert workers_for_wait(1.9, 1.0, 0.9, 1e9, max_utilisation=0.9) == 3


def test_service_times_that_vary_less_wait_less() -> None:
    exponential = pool_wait_quantile(1.6, 0.5, 1, 0.9, service_cv2=1.0)
    alike = pool_wait_quantile(1.6, 0.5, 1, 0.9, service_cv2=0.0)
    assert alike == pytest.approx(exponential / 2)
    assert workers_for_wait(1.6, 0.5, 0.9, 1.0, service_cv2=0.0) <= workers_for_wait(1.6, 0.5, 0.9, 1.0)


def test_the_fit_is_redone_at_most_once_per_refit_period() -> None:
    # The router asks for predictions on every request; refitting 2000 samples each time would
    # cost milliseconds of its loop. New steps show after the period, not before.
    slow = StepCostModel(min_samples=5, refit_seconds=3600.0, min_each=0)
    fresh = StepCostModel(min_samples=5, refit_seconds=0.0, min_each=0)
    for model in (slow, fresh):
        for streams in range(1, 11):
            model.add(Step(0, 0, streams, 0), 0.01 * streams)
        assert model.decode_step_seconds(10, 0) == pytest.approx(0.1, rel=0.01)
        for _ in range(200):  # the machine got twice as slow
            model.add(Step(0, 0, 10, 0), 0.2)
    assert slow.decode_step_seconds(10, 0) == pytest.approx(0.1, rel=0.01)
    assert fresh.decode_step_seconds(10, 0) > 0.18


def test_the_stall_margin_holds_when_more_mixed_steps_came_than_its_window_between_two_choices() -> None:
    # A fast worker (a GPU's steps of a few ms) can report more than the margin's window of mixed
    # steps between two path choices within one refit period: the margin is then the newest
    # window's, not an error.
    async def main() -> tuple[float, float]:
        model = fitted()
        for i in range(30):
            step = Step(8 + i, chunk_attention(0, 8 + i), 8, 4000)
            model.add(step, model.step_seconds(step))
        first = model.mixed_step_margin()
        for i in range(250):  # no time passes: no refit
            step = Step(8 + i % 40, chunk_attention(0, 8 + i % 40), 8, 4000)
            model.add(step, 1.5 * model.step_seconds(step))
        return first, model.mixed_step_margin()

    first, after = clock.run_virtual(main)
    assert first == pytest.approx(1.0, abs=0.02)
    assert after == pytest.approx(1.5, rel=0.01)
