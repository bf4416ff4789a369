"""The fp32 stream GEMV over weights stored in bf16 (cpu_gemv_f32.cpp): what float32 F.linear computes
over the bf16-rounded weight, to fp32 summation order, for every shape (outputs that are no multiple
of its 16-wide tiles, an odd number of inputs, rows past its four a pass, a bias, a strided input),
the same on any thread count, clear errors for what it cannot take; a PackedLinear in that mode
rounds its wide-step weight the same way; and SmolLM2 in fp32 through it gives the greedy text of
the same engine with those rounded weights and no stream.

Skipped where the C++ kernels are unavailable or were built without AVX2 and FMA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pdserve import LLM, SamplingParams
from pdserve.ops.cpu.linear import (
    STREAM_F32_COLS,
    PackedLinear,
    stream_linear_f32,
    stream_linear_f32_available,
    stream_pack,
)

pytestmark = pytest.mark.skipif(
    not stream_linear_f32_available(), reason="the C++ kernels are unavailable or have no AVX2/FMA here"
)


def case(rows: int, out_features: int, in_features: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=gen) / in_features**0.5).to(torch.bfloat16)
    x = torch.randn(rows, in_features, generator=gen)
    return x, weight  # x fp32, weight bf16


@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 8, 9, 21])
@pytest.mark.parametrize(
    ("out_features", "in_features"), [(8, 32), (13, 70), (96, 40), (40, 33), (100, 64), (576, 1536), (5, 1)]
)
@pytest.mark.parametrize("with_bias", [False, True])
def test_it_computes_f_linear_over_the_rounded_weight(
    rows: int, out_features: int, in_features: int, with_bias: bool
) -> None:
    x, weight = case(rows, out_features, in_features)
    bias = torch.randn(out_features) if with_bias else None
    got = stream_linear_f32(x, stream_pack(weight, STREAM_F32_COLS), out_features, bias)
    want = F.linear(x, weight.float(), bias)
    assert got.shape == (rows, out_features) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_strided_input_and_any_thread_count_give_the_same_result() -> None:
    x, weight = case(7, 200, 96, seed=1)
    packed = stream_pack(weight, STREAM_F32_COLS)
    wide = torch.randn(7, 300)
    wide[:, 10:106] = x
    strided = wide[:, 10:106]
    assert not strided.is_contiguous()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = stream_linear_f32(x, packed, 200, None)
        torch.set_num_threads(2)
        assert torch.equal(stream_linear_f32(x, packed, 200, None), one)
        assert torch.equal(stream_linear_f32(strided, packed, 200, None), one)
    finally:
        torch.set_num_threads(threads)


def test_what_it_cannot_take_is_a_clear_error() -> None:
    x, weight = case(2, 32, 16)
    packed = stream_pack(weight, STREAM_F32_COLS)
    with pytest.raises(RuntimeError, match="float32"):
        stream_linear_f32(x.to(torch.bfloat16), packed, 32, None)
    with pytest.raises(RuntimeError, match="N does not match"):
        stream_linear_f32(x, packed, 64, None)
    with pytest.raises(RuntimeError, match="columns"):
        stream_linear_f32(torch.randn(2, 18), packed, 32, None)
    with pytest.raises(RuntimeError, match="contiguous"):
        stream_linear_f32(x, stream_pack(weight), 32, None)  # the bf16 kernel's 48-wide layout
    with pytest.raises(RuntimeError, match="bias"):
        stream_linear_f32(x, packed, 32, torch.randn(31))


@pytest.mark.parametrize("onednn", [False, True])
def test_a_packed_linear_stores_its_weight_in_bf16_for_every_width(onednn: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    weight, bias = torch.randn(40, 24, generator=gen), torch.randn(40, generator=gen)
    layer = PackedLinear(weight, bias, onednn=onednn, stream_rows=4)
    assert layer.bf16_weights and "weights stored in bf16" in repr(layer)
    rounded = weight.to(torch.bfloat16).float()
    for rows in (1, 4, 5, 64):  # the stream's rows, then the wide path's
        x = torch.randn(rows, 24, generator=gen)
        torch.testing.assert_close(layer(x), F.linear(x, rounded, bias), rtol=1e-5, atol=1e-5)
    assert not PackedLinear(weight, bias, onednn=onednn, stream_rows=0).bf16_weights


def test_an_untied_lm_head_without_its_own_stream_is_rounded_with_the_rest(tiny_llama: Path) -> None:
    """The logits may take no stream where the layers do (the plan measures them apart): an fp32
    model still computes with one set of bf16-rounded matrices, its untied lm_head's included, as
    the transformers reference of tests/conftest.py (load_hf_reference) rounds them."""
    from pdserve.models.llama import LlamaForCausalLM
    from pdserve.models.loader import iter_weights, load_config, resolve_model

    source = resolve_model(str(tiny_llama))
    config = load_config(source)
    model = LlamaForCausalLM(config, 64)
    with torch.no_grad():
        model.load_weights(iter_weights(source))
    assert model.lm_head is not None  # the untied case
    full = model.lm_head.weight.detach().clone()
    model.pack_for_cpu(onednn=False, stream_rows=4, logits_stream_rows=0)
    assert model.weights_in_bf16 and model.packed_logits is not None and model.packed_logits.stream is None
    rounded = full.to(torch.bfloat16).float()
    hidden = torch.randn(3, config.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.compute_logits(hidden), F.linear(hidden, rounded), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_smollm2_in_fp32_gives_the_same_greedy_text_through_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import dataclasses

    from pdserve.engine import factory
    from pdserve.ops.cpu.plan import cpu_plan

    # The stream for any step of up to 256 rows, whatever this machine's plan chose.
    plan = dataclasses.replace(
        cpu_plan(),
        prepack={"float32": False},
        stream_rows={"float32": 256},
        logits_stream_rows={"float32": 256},
    )
    monkeypatch.setattr(factory, "cpu_plan", lambda: plan)
    monkeypatch.setenv("PDSERVE_STREAM_GEMV", "1")
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    llm = LLM("smollm2-135m", dtype="float32", kv_cache_memory_gib=0.25)
    model = llm.engine.runner.model
    assert model.weights_in_bf16
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    # The reference: the same engine, the same rounded weights, through F.linear (no stream).
    for layer in model.modules():
        if isinstance(layer, PackedLinear):
            assert layer.bf16_weights
            layer.stream_rows = 0
    reference = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert ours == reference
