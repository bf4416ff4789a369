"""The sampler on hand-made logits: greedy is argmax, seeded draws are reproducible, sampled tokens
follow softmax(logits / temperature) restricted by top-k / top-p / min-p, penalties follow the
CTRL (repetition) and OpenAI (presence / frequency) formulas, logprobs are the model's own."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from pdserve.engine.sampler import TOP_P_CANDIDATES, SamplingRow, sample, top_p_filter
from pdserve.errors import InvalidRequestError
from pdserve.sampling_params import SamplingParams

VOCAB = 50


def random_logits(rows: int, seed: int = 0, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def row(
    params: SamplingParams,
    seed: int | None = 0,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
) -> SamplingRow:
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return SamplingRow(params, generator, list(prompt or []), list(output or []))


def draws(logits: torch.Tensor, params: SamplingParams, n: int, seed: int = 0) -> list[int]:
    """n draws from one logits vector [V], all from one generator (as one request over n steps)."""
    generator = torch.Generator().manual_seed(seed)
    rows = [SamplingRow(params, generator, [], []) for _ in range(n)]
    tokens, _ = sample(logits.expand(n, -1).contiguous(), rows)
    return tokens


def chi_square(counts: Counter[int], probs: torch.Tensor, n: int) -> float:
    expected = probs * n
    return sum(
        (counts.get(i, 0) - float(e)) ** 2 / float(e) for i, e in enumerate(expected.tolist()) if e > 0
    )


def test_greedy_is_argmax_for_every_row() -> None:
    logits = random_logits(64)
    tokens, logprobs = sample(logits, [row(SamplingParams(temperature=0), seed=None) for _ in range(64)])
    assert tokens == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 64  # not asked for


def test_bf16_logits_give_the_tokens_and_logprobs_of_their_float32_values() -> None:
    """The runner hands over logits in the model dtype; greedy rows take their argmax as they are,
    everything else works on their float32 values."""
    logits = random_logits(6, seed=3).bfloat16()
    greedy = SamplingParams(temperature=0)
    params = [greedy, greedy, SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.8)]
    for chosen in ([greedy] * 6, params + params[:2]):
        got = sample(logits, [row(p, seed=1) for p in chosen])
        want = sample(logits.float(), [row(p, seed=1) for p in chosen])
        assert got == want
    tokens, _ = sample(logits, [row(greedy, seed=None) for _ in range(6)])
    assert tokens == logits.float().argmax(dim=-1).tolist()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0, top_k=1),
        SamplingParams(temperature=5.0, top_k=1),
        SamplingParams(temperature=1.0, top_p=1e-6),
        SamplingParams(temperature=3.0, top_p=1e-6),
        SamplingParams(temperature=1.0, min_p=1.0),
    ],
)
def test_filters_that_leave_one_token_give_greedy(params: SamplingParams) -> None:
    logits = random_logits(64, seed=1)
    tokens, _ = sample(logits, [row(params, seed=i) for i in range(64)])
    assert tokens == logits.argmax(dim=-1).tolist()


def test_seeded_generators_reproduce_and_different_seeds_differ() -> None:
    logits = random_logits(1, seed=2)[0] / 3  # flat enough that draws vary
    params = SamplingParams(temperature=1.0)
    first = draws(logits, params, 200, seed=7)
    assert first == draws(logits, params, 200, seed=7)
    assert first != draws(logits, params, 200, seed=8)
    assert len(set(first)) > 10  # really sampling


def test_a_seeded_row_does_not_depend_on_its_neighbours() -> None:
    logits = random_logits(3, seed=3)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=5)
    for _ in range(20):  # 20 different draws of the same generators
        alone, _ = sample(logits[1:2], [row(params, seed=5)])
        others = [row(SamplingParams(temperature=1.0), seed=s) for s in (11, 12)]
        batched, _ = sample(logits, [others[0], row(params, seed=5), others[1]])
        assert batched[1] == alone[0]


@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_draws_follow_softmax_of_logits_over_temperature(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    n = 5000
    counts = Counter(draws(logits, SamplingParams(temperature=temperature), n, seed=1))
    probs = torch.softmax(logits / temperature, dim=-1)
    # 5 degrees of freedom: 30 is far beyond the 0.999 quantile (20.5), so only a wrong
    # distribution fails; a wrong temperature moves the statistic into the thousands.
    assert chi_square(counts, probs, n) < 30
    assert chi_square(counts, torch.softmax(logits, dim=-1), n) > 200 or temperature == 1.0


# Probabilities 0.5, 0.25, 0.15, 0.1 (then nothing): what each filter keeps, and in what proportions.
FOUR = torch.log(torch.tensor([0.5, 0.25, 0.15, 0.1]))


@pytest.mark.parametrize(
    "params,kept",
    [
        (SamplingParams(temperature=1.0, top_k=2), [0, 1]),
        (SamplingParams(temperature=1.0, top_k=3), [0, 1, 2]),
        (SamplingParams(temperature=1.0, top_k=4), [0, 1, 2, 3]),
        (SamplingParams(temperature=1.0, top_k=100), [0, 1, 2, 3]),  # larger than the vocabulary
        # top_p: the smallest set whose mass reaches p (0.5 + 0.25 >= 0.7).
        (SamplingParams(temperature=1.0, top_p=0.7), [0, 1]),
        (SamplingParams(temperature=1.0, top_p=0.75), [0, 1]),
        (SamplingParams(temperature=1.0, top_p=0.8), [0, 1, 2]),
        (SamplingParams(temperature=1.0, top_p=0.5), [0]),
        # min_p: tokens at least min_p times as likely as the most likely one (0.25 * 0.5).
        (SamplingParams(temperature=1.0, min_p=0.25), [0, 1, 2]),
        (SamplingParams(temperature=1.0, min_p=0.4), [0, 1]),
        (SamplingParams(temperature=1.0, top_k=3, top_p=0.7), [0, 1]),
        (SamplingParams(temperature=1.0, top_k=3, min_p=0.1), [0, 1, 2]),
    ],
)
def test_filters_never_pick_excluded_tokens_and_renormalize_the_rest(
    params: SamplingParams, kept: list[int]
) -> None:
    n = 2000
    counts = Counter(draws(FOUR, params, n, seed=3))
    assert sorted(counts) == kept  # every kept token drawn, no other
    probs = torch.zeros(4)
    probs[kept] = FOUR.exp()[kept]
    probs /= probs.sum()
    assert chi_square(counts, probs, n) < 30


def test_top_k_and_top_p_on_a_large_vocabulary() -> None:
    logits = random_logits(1, seed=4, vocab=1000)[0]
    top10 = set(logits.topk(10).indices.tolist())
    assert set(draws(logits, SamplingParams(temperature=1.5, top_k=10), 1000)) <= top10
    probs, order = torch.softmax(logits, -1).sort(descending=True)
    nucleus = set(order[: int((probs.cumsum(-1) < 0.9).sum()) + 1].tolist())
    assert set(draws(logits, SamplingParams(temperature=1.0, top_p=0.9), 1000)) <= nucleus


def reference_nucleus(logits: torch.Tensor, top_p: float) -> set[int]:
    """The nucleus by the definition, over the whole vocabulary sorted."""
    probs, order = torch.softmax(logits, -1).sort(descending=True)
    return set(order[(probs.cumsum(-1) - probs) < top_p].tolist())


@pytest.mark.parametrize("spread", [6.0, 3.0, 0.05])  # peaked, heavy-tailed, near flat
@pytest.mark.parametrize("top_p", [0.5, 0.9, 0.99])
def test_top_p_keeps_the_nucleus_of_a_whole_vocabulary(spread: float, top_p: float) -> None:
    """The nucleus is sought among the top candidates first and, when it is wider than them (a flat
    distribution), over the whole vocabulary: the same tokens as the definition either way."""
    logits = random_logits(1, seed=7, vocab=49152)[0] * spread / 3  # SmolLM2's vocabulary size
    kept = torch.isfinite(top_p_filter(logits, top_p)).nonzero().flatten().tolist()
    nucleus = reference_nucleus(logits, top_p)
    assert set(kept) == nucleus
    if spread > 5:  # peaked: found among the candidates, no sort of the whole vocabulary
        assert len(nucleus) < TOP_P_CANDIDATES
    if spread < 1:  # flat: the nucleus is far wider than the candidates looked at first
        assert len(nucleus) > 10 * TOP_P_CANDIDATES
    finite = top_p_filter(logits, top_p)[kept]
    assert torch.equal(finite, logits[kept])  # the kept logits are untouched


def expected_penalized(
    logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]
) -> torch.Tensor:
    """The reference formulas, written independently of the sampler."""
    out = logits.clone()
    for token in set(prompt) | set(output):  # CTRL: divide positive logits, multiply negative ones
        value = out[token]
        out[token] = value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
    for token, count in Counter(output).items():  # OpenAI: generated tokens only
        out[token] -= count * params.frequency_penalty + params.presence_penalty
    return out


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0, repetition_penalty=1.7),
        SamplingParams(temperature=0, repetition_penalty=0.6),  # < 1 favours seen tokens
        SamplingParams(temperature=0, presence_penalty=1.3),
        SamplingParams(temperature=0, frequency_penalty=0.9),
        SamplingParams(temperature=0, presence_penalty=-1.0, frequency_penalty=1.5),
        SamplingParams(temperature=0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5),
    ],
)
def test_penalties_follow_the_reference_formulas(params: SamplingParams) -> None:
    # Many random rows with random histories: any deviation from the formula changes some argmax.
    gen = torch.Generator().manual_seed(5)
    logits = random_logits(200, seed=6, vocab=20) / 2
    rows, expected = [], []
    for i in range(200):
        prompt = torch.randint(0, 20, (4,), generator=gen).tolist()
        output = torch.randint(
            0, 20, (int(torch.randint(0, 8, (1,), generator=gen)),), generator=gen
        ).tolist()
        rows.append(row(params, seed=None, prompt=prompt, output=output))
        expected.append(int(expected_penalized(logits[i], params, prompt, output).argmax()))
    tokens, _ = sample(logits, rows)
    assert tokens == expected
    assert tokens != logits.argmax(dim=-1).tolist()  # the penalties did change some choices


def test_repetition_penalty_lowers_seen_tokens_whatever_their_sign() -> None:
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    # Positive: 2.0 / 2 = 1.0 falls below 1.5.
    logits = torch.tensor([[2.0, 1.5, -1.0, -4.0]])
    assert sample(logits, [row(params, seed=None, prompt=[0])])[0] == [1]
    assert sample(logits, [row(params, seed=None, output=[0])])[0] == [1]
    assert sample(logits, [row(params, seed=None, prompt=[2])])[0] == [0]  # unseen best stays
    # Negative: -1.0 * 2 = -2.0 falls below -1.5 (dividing would have raised it).
    logits = torch.tensor([[-1.0, -1.5, -4.0]])
    assert sample(logits, [row(params, seed=None, prompt=[0])])[0] == [1]
    assert sample(logits, [row(params, seed=None, prompt=[1])])[0] == [0]


def test_presence_and_frequency_penalties_ignore_the_prompt() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0, presence_penalty=2.0, frequency_penalty=2.0)
    assert sample(logits, [row(params, seed=None, prompt=[0, 0, 0])])[0] == [0]
    # Generated twice: 3.0 - 2 * 2.0 - 2.0 = -3.0.
    assert sample(logits, [row(params, seed=None, output=[0, 0])])[0] == [1]
    # Frequency scales with the count, presence does not: 3.0 - 0.4 * 2 - 0.3 = 1.9 < 2.0 ...
    params = SamplingParams(temperature=0, presence_penalty=0.3, frequency_penalty=0.4)
    assert sample(logits, [row(params, seed=None, output=[0, 0])])[0] == [1]
    # ... but seen once, 3.0 - 0.4 - 0.3 = 2.3 > 2.0.
    assert sample(logits, [row(params, seed=None, output=[0])])[0] == [0]


def test_penalties_apply_to_sampled_rows_too() -> None:
    # Token 0 dominates (98%) until it has been generated twice; then it is drawn about 11% of the time.
    logits = torch.tensor([5.0, 0.0, 0.0, 0.0])
    params = SamplingParams(
        temperature=1.0, repetition_penalty=5.0, presence_penalty=1.0, frequency_penalty=0.5
    )
    n = 2000
    rows = [row(params, seed=i, output=[0, 0]) for i in range(n)]
    tokens, _ = sample(logits.expand(n, -1).contiguous(), rows)
    probs = torch.softmax(expected_penalized(logits, params, [], [0, 0]), dim=-1)
    assert 0.05 < float(probs[0]) < 0.2
    assert chi_square(Counter(tokens), probs, n) < 30


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_logprobs_are_the_raw_log_softmax_and_top_k_is_sorted(k: int) -> None:
    logits = random_logits(8, seed=9)
    params = [
        SamplingParams(temperature=0, logprobs=k),
        SamplingParams(temperature=0.7, top_k=3, logprobs=k),
        SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=1.0, logprobs=k),
        SamplingParams(temperature=0),  # no logprobs for this one
    ] * 2
    rows = [row(p, seed=i, prompt=[1, 2, 3], output=[4, 4]) for i, p in enumerate(params)]
    tokens, logprobs = sample(logits, rows)
    reference = torch.log_softmax(logits, dim=-1)
    for i, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
        if params[i].logprobs is None:
            assert lp is None
            continue
        assert lp is not None and lp.token_id == token
        # Before penalties and temperature: the model's own distribution.
        assert lp.logprob == pytest.approx(float(reference[i, token]), abs=1e-6)
        assert len(lp.top) == k
        ids = list(lp.top)
        assert ids == reference[i].topk(k).indices.tolist()
        values = list(lp.top.values())
        assert values == sorted(values, reverse=True)
        for token_id, value in lp.top.items():
            assert value == pytest.approx(float(reference[i, token_id]), abs=1e-6)


def test_logit_bias_bans_and_forces_tokens_and_leaves_the_logprobs_raw() -> None:
    logits = random_logits(3)
    best = logits.argmax(dim=-1).tolist()
    banned = SamplingParams(temperature=0, logit_bias={best[0]: -100.0}, logprobs=0)
    forced = SamplingParams(temperature=0.9, logit_bias={7: 100.0})
    plain = SamplingParams(temperature=0)
    tokens, logprobs = sample(logits.clone(), [row(banned, None), row(forced, 1), row(plain, None)])
    second = logits[0].clone()
    second[best[0]] = float("-inf")
    assert tokens[0] == int(second.argmax()) and tokens[1] == 7 and tokens[2] == best[2]
    # The reported logprob is the model's own, before the bias (as vLLM's default).
    assert logprobs[0] is not None
    assert logprobs[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[tokens[0]]))
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={3: 101.0})
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        SamplingParams(logit_bias={-1: 1.0})


def test_min_tokens_bans_eos_and_stop_ids_until_enough_tokens_are_out() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 3] = 50.0  # EOS all but certain
    logits[:, 4] = 40.0  # then the stop id
    held = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[4], logprobs=0)
    rows = [
        SamplingRow(held, None, [], [], (3,)),  # no token out yet: 3 and 4 are banned
        SamplingRow(held, None, [], [7, 8], (3,)),  # two out: it may stop now
        SamplingRow(
            SamplingParams(temperature=0.8, min_tokens=1, ignore_eos=True), row(held).generator, [], [], (3,)
        ),
    ]
    tokens, logprobs = sample(logits.clone(), rows)
    assert tokens[0] not in (3, 4) and tokens[1] == 3
    assert tokens[2] == 3  # ignore_eos: EOS does not end it, so it is not banned either
    # The logprob is still the model's own: the ban is a sampling rule, not the distribution.
    assert logprobs[0] is not None
    assert logprobs[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[tokens[0]]))
