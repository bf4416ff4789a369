"""Decode steps on fixed-shape buffers (what a CUDA graph captures), run eagerly on CPU: the same
tokens as the ordinary path whatever the batch's padding, context bucket, window or sampling.
The capture and replay themselves need a GPU: tests/test_cuda.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_tiny_model

from pdserve import LLM, SamplingParams
from pdserve.engine.decode_graphs import (
    MAX_GATHERED_BYTES,
    StaticDecode,
    batch_buckets,
    context_buckets,
    gathered_bytes,
    smallest_at_least,
)
from pdserve.ops.layer_ops import TorchLayerOps

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
PROMPT_LENGTHS = (1, 3, 4, 9, 17, 40)  # six decodes: a batch bucket of 8, two of its rows padding


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 250, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def portable_llm(path: Path, static: bool, max_num_seqs: int = 64, **options: int) -> LLM:
    """An engine on the portable torch ops (the path a GPU runs), with or without fixed-shape decodes."""
    llm = LLM(str(path), dtype="float32", device="cpu", max_num_seqs=max_num_seqs, **options)
    runner = llm.engine.runner
    runner.model.ops = TorchLayerOps()
    if static:
        runner.use_static_decode(max_num_seqs, llm.engine.max_model_len, capture=False)
    return llm


def tokens(llm: LLM, params: SamplingParams | list[SamplingParams] = GREEDY) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts(), params)]


def test_buckets_cover_every_batch_and_context_up_to_the_largest() -> None:
    assert batch_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert batch_buckets(5) == [1, 2, 4, 5]
    assert batch_buckets(1) == [1]
    assert context_buckets(128) == [8, 16, 32, 64, 128]
    assert context_buckets(100) == [8, 16, 32, 64, 100]
    assert context_buckets(3) == [3]
    assert smallest_at_least([1, 2, 4, 8], 3) == 4
    assert smallest_at_least([1, 2, 4, 8], 9) is None


def test_no_bucket_gathers_more_than_the_limit_and_a_step_takes_the_smallest_that_holds_it(
    tiny_llama: Path,
) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu")
    model = llm.engine.runner.model
    shape = (model.config.num_heads, model.config.num_kv_heads, model.config.head_dim)  # 4, 2, 16
    # 64-token blocks, 2048 of them (a 131072-token context, as Llama 3.2 1B's), 128 rows at most
    kv_cache = torch.zeros(1, 2, 1, 64, 1, 1)
    step = StaticDecode(model, kv_cache, max_batch=128, max_blocks=2048, sliding_window=None)
    assert all(gathered_bytes(b, c * 64, *shape) <= MAX_GATHERED_BYTES for b, c in step.buckets)
    # 800 bytes a token of context: 128 rows x 256 blocks of 64 tokens is 1.6 GiB, 512 blocks 3.1
    assert (1, 2048) in step.buckets and (128, 256) in step.buckets and (128, 512) not in step.buckets
    assert step.buckets == sorted(step.buckets, reverse=True)  # captured largest first
    assert step.bucket(3, 9) == (4, 16)
    assert step.bucket(128, 256) == (128, 256)
    assert step.bucket(100, 600) is None  # (104, 1024) gathers too much: the ordinary path
    assert step.bucket(129, 1) is None and step.bucket(1, 2049) is None


def test_padding_rows_write_into_a_free_block_and_leave_the_cache_of_every_request_alone(
    tiny_llama: Path,
) -> None:
    llm = portable_llm(tiny_llama, static=True, block_size=4, num_kv_blocks=64)
    runner, kv = llm.engine.runner, llm.engine.kv
    spare = kv.spare_block()
    assert spare is not None
    before = runner.kv_cache.clone()
    outputs = llm.generate(prompts()[:3], GREEDY)  # three decodes a step: a bucket of 4, one padding row
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outputs)
    assert runner.static_decode is not None and runner.static_decode.steps > 0
    changed = (runner.kv_cache != before).flatten(3).any(dim=-1)  # [L, 2, blocks]: written
    assert bool(changed[:, :, spare].any())  # the padding row's K/V went to the spare block
    assert kv.num_free_blocks == kv.num_blocks and kv.spare_block() == spare


@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_padded_decode_steps_give_the_ordinary_paths_tokens(tiny_llama: Path, block_size: int) -> None:
    reference = tokens(portable_llm(tiny_llama, static=False, block_size=block_size))
    llm = portable_llm(tiny_llama, static=True, block_size=block_size)
    assert tokens(llm) == reference
    static = llm.engine.runner.static_decode
    assert static is not None and static.steps >= GREEDY.max_tokens - 1  # every decode step ran padded
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_a_batch_larger_than_every_bucket_runs_the_ordinary_way(tiny_llama: Path) -> None:
    reference = tokens(portable_llm(tiny_llama, static=False))
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu")
    runner = llm.engine.runner
    runner.model.ops = TorchLayerOps()
    runner.use_static_decode(4, llm.engine.max_model_len, capture=False)  # buckets up to 4 rows
    assert tokens(llm) == reference
    static = runner.static_decode
    assert static is not None and static.steps == 0  # six decodes a step: none fitted


def test_sliding_window_decodes_in_buckets_give_the_ordinary_paths_tokens(tmp_path: Path) -> None:
    window = {
        "use_sliding_window": True,
        "sliding_window": 5,
        "tie_word_embeddings": False,
        "max_window_layers": 0,
    }
    path = make_tiny_model(tmp_path / "sliding", "qwen2", window, seed=1)
    reference = tokens(portable_llm(path, static=False, block_size=4))
    llm = portable_llm(path, static=True, block_size=4)
    assert tokens(llm) == reference
    assert llm.engine.runner.static_decode is not None and llm.engine.runner.static_decode.steps > 0


def test_seeded_sampling_and_penalties_are_the_same_on_padded_steps(tiny_llama: Path) -> None:
    params = [
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
        SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, ignore_eos=True, logprobs=3),
        SamplingParams(max_tokens=4, temperature=1.2, top_k=20, seed=3, ignore_eos=True),
    ] * 2
    reference = tokens(portable_llm(tiny_llama, static=False), params)
    assert tokens(portable_llm(tiny_llama, static=True), params) == reference


def test_fixed_shape_decodes_refuse_the_cpu_kernels_metadata(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", device="cpu")
    if not llm.engine.runner.model.ops.varlen:
        pytest.skip("the CPU kernels did not build here: the engine already runs the portable ops")
    with pytest.raises(ValueError, match="portable layer ops"):
        llm.engine.runner.use_static_decode(8, llm.engine.max_model_len, capture=False)
