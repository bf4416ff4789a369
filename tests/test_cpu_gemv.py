"""The stream GEMV (cpu_gemv.cpp) for a decode step's rows: what F.linear computes, to bf16's
rounding, for every shape (outputs that are no multiple of its 48-wide tiles, an odd number of
inputs, rows past its eight a pass, a bias, a strided input), the same on any thread count, clear
errors for what it cannot take; and SmolLM2 in bf16 gives the same greedy text through it as
through oneDNN.

Skipped where the C++ kernels are unavailable or were built without AVX512-BF16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve import LLM, SamplingParams
from pdserve.ops.cpu.linear import (
    PackedLinear,
    packed_linear,
    stream_linear,
    stream_linear_available,
    stream_pack,
)

pytestmark = pytest.mark.skipif(
    not stream_linear_available(), reason="the C++ kernels are unavailable or have no AVX512-BF16 here"
)


def case(rows: int, out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=gen).to(torch.bfloat16)
    return x, weight


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 8, 9, 21])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(8, 32), (13, 70), (96, 40), (40, 33), (100, 64), (576, 1536), (5, 1)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_it_computes_f_linear_to_bf16_rounding(
    rows: int, out_features: int, in_features: int, with_bias: bool
) -> None:
    x, weight = case(rows, out_features, in_features)
    bias = torch.randn(out_features).to(torch.bfloat16) if with_bias else None
    got = stream_linear(x, stream_pack(weight), out_features, bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())  # [rows, out]
    # One rounding of an fp32 sum: within half a bf16 step of the exact value, plus the fp32
    # summation's own error (another order than oneDNN's).
    torch.testing.assert_close(got.float(), exact, rtol=2**-8, atol=1e-5)
    want = F.linear(x, weight, bias)  # oneDNN's bf16: at most a last-bit difference, rarely
    if rows:
        assert (got != want).float().mean() <= 0.02


def test_a_strided_input_and_any_thread_count_give_the_same_bits() -> None:
    x, weight = case(2, 200, 96)
    packed = stream_pack(weight)
    wide = torch.cat([x, torch.ones(2, 7, dtype=torch.bfloat16)], dim=1)[:, :96]  # [2, 96], row stride 103
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = stream_linear(x, packed, 200, None)
        torch.set_num_threads(2)
        two = stream_linear(wide, packed, 200, None)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)
    assert torch.equal(stream_linear(x.t().contiguous().t(), packed, 200, None), one)  # column-major x


def test_what_it_cannot_take_is_refused_clearly() -> None:
    x, weight = case(1, 16, 64)
    packed = stream_pack(weight)
    with pytest.raises(RuntimeError, match="bfloat16"):
        stream_linear(x.float(), packed, 16, None)
    with pytest.raises(RuntimeError, match="columns"):
        stream_linear(torch.zeros(1, 100, dtype=torch.bfloat16), packed, 16, None)
    with pytest.raises(RuntimeError, match="N does not match"):
        stream_linear(x, packed, 70, None)
    with pytest.raises(RuntimeError, match="bias"):
        stream_linear(x, packed, 16, torch.zeros(3, dtype=torch.bfloat16))


def test_a_packed_layer_takes_the_stream_only_for_its_few_rows() -> None:
    _, weight = case(0, 48, 64)
    bias = torch.randn(48).to(torch.bfloat16)
    layer = PackedLinear(weight, bias, onednn=True, stream_rows=2)
    assert "stream GEMV up to 2 rows" in repr(layer)
    for rows in (1, 2, 3, 9):
        x, _ = case(rows, 48, 64, seed=rows)
        expected = (
            stream_linear(x, stream_pack(weight), 48, bias)
            if rows <= 2
            else packed_linear(x, layer.packed, bias)  # type: ignore[arg-type]
        )
        assert torch.equal(layer(x), expected)
    plain = PackedLinear(weight, bias, onednn=False, stream_rows=1)  # where oneDNN's layout does not pay
    x3, _ = case(3, 48, 64, seed=3)
    assert torch.equal(plain(x3), F.linear(x3, weight, bias))


@pytest.mark.parametrize("logits_rows", [0, 4, 8])
def test_the_logits_take_the_stream_only_as_far_as_it_won_on_them(
    tiny_llama: Path, logits_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A vocabulary-wide weight gains less from the stream than a layer's projections (on an AMX
    Xeon it lost at every width): the plan measures it apart and the logits follow that."""
    import dataclasses

    from pdserve.engine import factory
    from pdserve.ops.cpu.plan import cpu_plan

    plan = dataclasses.replace(
        cpu_plan(), stream_rows={"bfloat16": 4}, logits_stream_rows={"bfloat16": logits_rows}
    )
    monkeypatch.setattr(factory, "cpu_plan", lambda: plan)
    monkeypatch.setenv("PDSERVE_STREAM_GEMV", "1")
    llm = LLM(str(tiny_llama), dtype="bfloat16", kv_cache_memory_gib=0.05)
    model = llm.engine.runner.model
    assert model.layers[0].qkv_proj.stream is not None and model.layers[0].qkv_proj.stream_rows == 4
    assert model.packed_logits is not None
    assert (model.packed_logits.stream is not None) == (logits_rows > 0)
    assert model.packed_logits.stream_rows == min(logits_rows, 4)  # never wider than the layers'
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    assert len(llm.generate(["a b c", "d e"], params)[0].outputs[0].token_ids) == 4


def test_smollm2_in_bf16_gives_the_same_greedy_text_through_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same tokens with and without the stream, up to bf16's ties: the two sum each row's
    products in different orders (oneDNN's AMX tiles, the stream's lanes) and round the outputs to
    bf16, so where two tokens are within a few roundings of each other either may win (seen on an
    AMX Xeon: 10 tokens alike, then '2' and '1' 0.25 nats apart). Where the texts part, the token
    each path chose must be one the other path ranked within such a margin."""
    from pdserve.ops.cpu.plan import cpu_plan

    if cpu_plan().stream_rows.get("bfloat16", 0) == 0:
        pytest.skip("this machine's measurement did not choose the stream GEMV")
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=5)
    outs = {}
    for setting in ("1", "0"):
        monkeypatch.setenv("PDSERVE_STREAM_GEMV", setting)
        llm = LLM("smollm2-135m", dtype="bfloat16", kv_cache_memory_gib=0.25)
        layer = llm.engine.runner.model.layers[0].qkv_proj
        assert (getattr(layer, "stream", None) is not None) == (setting == "1")  # nn.Linear if unpacked
        # One prompt at a time: every decode step has one row, the stream's case.
        outs[setting] = [llm.generate(p, params)[0].outputs[0] for p in prompts]
    for streamed, plain in zip(outs["1"], outs["0"], strict=True):
        same = 0
        while same < len(streamed.token_ids) and streamed.token_ids[same] == plain.token_ids[same]:
            same += 1
        if same == len(streamed.token_ids):
            continue
        assert same >= 8, (streamed.text, plain.text)  # a tie, not a wrong layer, parts them
        assert streamed.logprobs is not None and plain.logprobs is not None
        for mine, other in (
            (streamed.logprobs[same], plain.logprobs[same]),
            (plain.logprobs[same], streamed.logprobs[same]),
        ):
            assert mine.token_id in other.top, (streamed.text, plain.text)
            # bf16 logits of SmolLM2 (magnitude 16-32) are 0.125 apart: a few steps of rounding.
            assert other.logprob - other.top[mine.token_id] <= 0.5, (streamed.text, plain.text)
    assert "Paris" in outs["1"][0].text
