"""Prepacked oneDNN linear layers: the same results as F.linear (bit for bit in bf16, both being
oneDNN), every projection of a model packed, the model's logits unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from pdserve.ops.cpu import isa as cpu_isa
from pdserve.ops.cpu import linear as cpu_linear
from pdserve.ops.cpu.linear import PackedLinear, pack_linears, pack_weight, packed_linear

pytestmark = pytest.mark.skipif(not cpu_linear.onednn_available(), reason="torch was built without oneDNN")
_isa = cpu_isa.probe()
# oneDNN refuses bf16 reorders elsewhere (the plan records that and never asks, test_cpu_choice.py)
needs_onednn_bf16 = pytest.mark.skipif(
    not (_isa.has("avx512bw", "avx512vl", "avx512dq") or _isa.has("avx_ne_convert")),
    reason="oneDNN's bf16 needs AVX512-BW/VL/DQ or AVX-NE-CONVERT",
)


@pytest.mark.parametrize("rows", [0, 1, 7, 300])
@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(torch.bfloat16, marks=needs_onednn_bf16)])
def test_a_packed_weight_computes_what_f_linear_does(rows: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen).to(dtype)
    bias = torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 40, generator=gen).to(dtype)
    want = F.linear(x, weight, bias)
    got = packed_linear(x, pack_weight(weight), bias)
    assert got.shape == (rows, 96) and got.dtype == dtype
    if dtype == torch.bfloat16:
        assert torch.equal(got, want)
    else:  # MKL's summation order against oneDNN's
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_every_projection_of_a_module_is_packed() -> None:
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Sequential(nn.Linear(16, 4, bias=False)))
    x = torch.randn(3, 8)
    want = model(x)
    assert pack_linears(model) == 2
    assert isinstance(model[0], PackedLinear) and isinstance(model[2][0], PackedLinear)
    torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)
    assert "prepacked" in repr(model[0])


@needs_onednn_bf16
def test_a_packed_model_gives_the_same_logits(tiny_llama: Path) -> None:
    from pdserve.models.llama import LlamaForCausalLM
    from pdserve.models.loader import iter_weights, load_config, resolve_model

    source = resolve_model(str(tiny_llama))
    config = load_config(source)
    model = LlamaForCausalLM(config, 64)
    with torch.no_grad():
        model.load_weights(iter_weights(source))
    model.to(torch.bfloat16)
    hidden = torch.randn(5, config.hidden_size).to(torch.bfloat16)
    want = model.compute_logits(hidden)
    layers = model.pack_for_cpu()
    assert layers == 4 * config.num_layers + 1  # qkv, o, gate_up, down per layer, and the logits
    assert torch.equal(model.compute_logits(hidden), want)
