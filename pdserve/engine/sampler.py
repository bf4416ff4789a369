"""Turn the logits of one step into tokens (torch).

Per-request parameters are applied row by row where they differ (penalties, temperature, top-k,
top-p, min-p) and each sampled row draws from its request's own generator, so a seeded request
gives the same tokens whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from pdserve.outputs import TokenLogprob
from pdserve.sampling_params import SamplingParams


@dataclass
class SamplingRow:
    params: SamplingParams
    generator: torch.Generator | None  # None for greedy rows
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: tuple[int, ...] = ()

    @property
    def banned_for_min_tokens(self) -> list[int]:
        """The ids that would end the request while it is still short of min_tokens."""
        if len(self.output_token_ids) >= self.params.min_tokens:
            return []
        eos = () if self.params.ignore_eos else self.eos_token_ids
        return sorted({*eos, *self.params.stop_token_ids})


def torch_argmax(logits: torch.Tensor) -> torch.Tensor:  # [S, V] -> [S] int64
    return logits.argmax(dim=-1)


def sample(
    logits: torch.Tensor,
    rows: list[SamplingRow],
    argmax: Callable[[torch.Tensor], torch.Tensor] = torch_argmax,
) -> tuple[list[int], list[TokenLogprob | None]]:
    """logits: [S, vocab] in the model's dtype, one row per entry of `rows`. Returns token ids and
    logprobs. `argmax` picks the greedy rows' tokens (the first of equal maxima, as torch.argmax):
    the layer ops' own, a C++ one on CPU."""
    banned = [row.banned_for_min_tokens for row in rows]
    processed = any(r.params.needs_penalties or r.params.logit_bias for r in rows) or any(banned)
    wants_logprobs = any(r.params.logprobs is not None for r in rows)
    if processed or wants_logprobs or not all(r.params.greedy for r in rows):
        # Float32 for everything past a plain argmax. A batch of greedy rows skips the copy: the
        # argmax of bf16 logits is that of their exact float32 values.
        logits = logits.float()
    raw_logprobs = None
    if wants_logprobs:
        raw_logprobs = torch.log_softmax(logits, dim=-1)  # [S, V] the model's own distribution
    if processed:
        logits = logits.clone()
        for i, row in enumerate(rows):
            if banned[i]:  # -inf stays -inf under the bias and penalties below
                logits[i, banned[i]] = float("-inf")
            if row.params.logit_bias:  # as OpenAI: on the logits, before everything else
                ids = torch.tensor(list(row.params.logit_bias), dtype=torch.long, device=logits.device)
                bias = torch.tensor(
                    list(row.params.logit_bias.values()), dtype=logits.dtype, device=logits.device
                )
                logits[i].index_add_(0, ids, bias)
            if row.params.needs_penalties:
                _apply_penalties(logits[i], row)

    greedy_tokens = argmax(logits).tolist()  # [S]
    tokens: list[int] = []
    for i, row in enumerate(rows):
        if row.params.greedy:
            tokens.append(greedy_tokens[i])
        else:
            tokens.append(_sample_row(logits[i], row))

    logprobs: list[TokenLogprob | None] = [None] * len(rows)
    if raw_logprobs is not None:
        for i, row in enumerate(rows):
            k = row.params.logprobs
            if k is None:
                continue
            top: dict[int, float] = {}
            if k > 0:
                values, ids = raw_logprobs[i].topk(k)
                top = dict(zip(ids.tolist(), values.tolist(), strict=True))
            logprobs[i] = TokenLogprob(tokens[i], float(raw_logprobs[i, tokens[i]]), top)
    return tokens, logprobs


def _apply_penalties(logits: torch.Tensor, row: SamplingRow) -> None:  # logits [V], in place
    params = row.params
    vocab = logits.shape[0]
    if params.repetition_penalty != 1.0:
        # As in CTRL / HF: every token seen in prompt or output is made less likely.
        # Built on the logits' device: on CUDA a CPU index would be copied over at each use.
        seen = torch.tensor(
            sorted(set(row.prompt_token_ids) | set(row.output_token_ids)),
            dtype=torch.long,
            device=logits.device,
        )
        seen = seen[seen < vocab]
        picked = logits[seen]
        logits[seen] = torch.where(
            picked > 0, picked / params.repetition_penalty, picked * params.repetition_penalty
        )
    if row.output_token_ids and (params.presence_penalty or params.frequency_penalty):
        # As in OpenAI's API: over the generated tokens only.
        # On the logits' device: a CPU count vector subtracted from CUDA logits is a device error.
        output_ids = torch.tensor(row.output_token_ids, dtype=torch.long, device=logits.device)
        counts = torch.bincount(output_ids, minlength=vocab)[:vocab]
        logits -= params.frequency_penalty * counts.to(logits.dtype)
        logits -= params.presence_penalty * (counts > 0).to(logits.dtype)


def _sample_row(logits: torch.Tensor, row: SamplingRow) -> int:  # logits [V]
    params = row.params
    logits = logits / params.temperature
    top_k = params.effective_top_k
    if top_k and top_k < logits.shape[0]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = top_p_filter(logits, params.top_p)
    probs = logits.softmax(dim=-1)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    # Exponential race (Gumbel-max equivalent): argmax(p / E) with E ~ Exp(1) draws from p,
    # and takes one draw per vocabulary entry from the request's generator per token. E is -log(U):
    # torch's exponential_ took 1.2 ms for 49k entries on a 2-vCPU EPYC, a uniform and its log 0.3.
    # (U = 0 makes E infinite: that one entry cannot win, a chance of 2^-24 per entry.)
    noise = -torch.rand(probs.shape, generator=row.generator, dtype=probs.dtype, device=probs.device).log_()
    return int((probs / noise).argmax())


# The candidates a nucleus is looked for in first. Sorting the whole vocabulary (49k for SmolLM2)
# for every row made a decode step of 8 top_p requests 110 ms where 67 with this cut (2-vCPU EPYC,
# benchmarks/sampling_cost.py, docs/performance.md); a nucleus is usually far smaller.
TOP_P_CANDIDATES = 256


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:  # logits [V] -> [V]
    """The logits with every token outside the nucleus at -inf: a token is dropped once the more
    likely tokens before it already reach top_p (the first always stays). The nucleus is sought
    among the top TOP_P_CANDIDATES first; when they hold less than top_p of the mass it is wider
    than them, and the whole vocabulary is sorted: the same nucleus either way."""
    probs = logits.softmax(dim=-1)  # [V]
    candidates = min(TOP_P_CANDIDATES, probs.shape[0])
    top_probs, order = probs.topk(candidates)  # [C] descending, [C] their ids
    cumulative = top_probs.cumsum(dim=-1)  # [C]
    # The first token past the candidates has their whole mass ahead of it: dropped if it reaches top_p.
    if candidates < probs.shape[0] and float(cumulative[-1]) < top_p:
        top_probs, order = probs.sort(descending=True)  # [V], [V]
        cumulative = top_probs.cumsum(dim=-1)
    keep = order[(cumulative - top_probs) < top_p]  # [N] the nucleus's ids: the mass ahead short of top_p
    filtered = torch.full_like(logits, float("-inf"))  # [V]
    filtered[keep] = logits[keep]
    return filtered
