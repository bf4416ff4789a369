"""The engine on a CUDA GPU, on the tiny random models: greedy tokens identical to transformers run
on the same GPU, whatever the chunking, batching, block size or preemption; a KV hand-over between
engines; sampling with per-request CUDA generators and penalties; bfloat16 as the default dtype.

Skipped where torch sees no CUDA device (CPU-only CI): the CPU suite covers the same behaviour
there, and these tests are what say the same holds on a GPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from pdserve import LLM, SamplingParams
from pdserve.config import EngineConfig, Role
from pdserve.engine.core import EngineCore
from pdserve.engine.factory import build_engine
from pdserve.engine.sampler import SamplingRow, sample

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs a CUDA GPU: torch.cuda.is_available() is False (CPU-only torch or no device)",
)

DEVICE = "cuda"
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Around and beyond the block size (4) and the chunk size (16), as in test_llm.py.
PROMPT_LENGTHS = (1, 3, 4, 9, 17, 40)
LOGPROB_TOLERANCE = 1e-4  # fp32 on both sides, as test_llama.py


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 250, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def tokens(outputs: list[Any]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    model: Any = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    model = model.to(DEVICE)
    model.generation_config.eos_token_id = None  # never stop early, like ignore_eos
    return model


def hf_greedy(path: Path, prompt_list: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generation on the same GPU, fp32, one prompt at a time."""
    model = hf_model(path)
    results = []
    for p in prompt_list:
        out = model.generate(
            torch.tensor([p], device=DEVICE), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
        results.append(out[0, len(p) :].tolist())
    return results


def assert_on_cuda(llm: LLM, dtype: torch.dtype) -> None:
    engine = llm.engine
    assert engine.runner.device.type == "cuda" and engine.runner.dtype == dtype
    assert engine.runner.kv_cache.is_cuda and engine.runner.kv_cache.dtype == dtype
    assert all(p.is_cuda and p.dtype == dtype for p in engine.runner.model.parameters())
    # The RoPE tables are plain attributes (not parameters): they must have been built there too.
    assert engine.runner.model.rope.cos.is_cuda and engine.runner.model.rope.cos.dtype == torch.float32


def run_to_end(core: EngineCore) -> dict[str, list[int]]:
    out_tokens: dict[str, list[int]] = {}
    for _ in range(1000):
        if not core.has_unfinished:
            return out_tokens
        for out in core.step():
            out_tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("engine did not finish")


# -- greedy against transformers --------------------------------------------------------------------
@pytest.mark.parametrize("name", ["llama-gqa-untied", "llama-gqa-tied", "qwen2-bias", "llama3-rope"])
def test_greedy_matches_transformers_on_cuda(tiny_models: dict[str, Path], name: str) -> None:
    path = tiny_models[name]
    # Budget 32 with chunks of 16: prompts are prefilled in several chunks, and decodes share
    # steps with prompt chunks (mixed batches).
    llm = LLM(
        str(path), dtype="float32", device=DEVICE, block_size=4, chunk_size=16, max_num_batched_tokens=32
    )
    assert_on_cuda(llm, torch.float32)
    assert tokens(llm.generate(prompts(), GREEDY)) == hf_greedy(path, prompts(), GREEDY.max_tokens)


def test_logprobs_match_transformers_full_forward_on_cuda(tiny_llama: Path) -> None:
    prompt = prompts()[4]  # 17 tokens: 5 blocks of 4, 3 chunks of 8
    llm = LLM(str(tiny_llama), dtype="float32", device=DEVICE, block_size=4, chunk_size=8)
    out = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, logprobs=5, ignore_eos=True))
    completion = out[0].outputs[0]
    assert completion.logprobs is not None
    with torch.no_grad():
        logits = hf_model(tiny_llama)(torch.tensor([prompt + completion.token_ids], device=DEVICE)).logits[0]
    reference = torch.log_softmax(logits.float(), dim=-1).cpu()
    worst = 0.0
    for i, lp in enumerate(completion.logprobs):
        ref = reference[len(prompt) - 1 + i]  # the position that predicts token i
        assert lp.token_id == int(ref.argmax())
        values, ids = ref.topk(5)
        assert list(lp.top) == ids.tolist()
        worst = max(worst, *(abs(a - b) for a, b in zip(lp.top.values(), values.tolist(), strict=True)))
    assert worst < LOGPROB_TOLERANCE, f"max |logprob difference| {worst:.2e}"


# -- the same tokens whatever the batch ---------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[list[int]]:
    llm = LLM(str(tiny_llama), dtype="float32", device=DEVICE)
    return tokens(llm.generate(prompts(), GREEDY))


@pytest.mark.parametrize(
    "options",
    [
        {"block_size": 1, "chunk_size": 1},
        {"block_size": 8, "chunk_size": 5, "max_num_batched_tokens": 7},
        {"block_size": 32, "chunk_size": 512, "max_num_seqs": 1},
        {"block_size": 4, "chunk_size": 3, "max_num_seqs": 2},
    ],
)
def test_chunked_prefill_and_batching_give_the_same_tokens_on_cuda(
    tiny_llama: Path, reference: list[list[int]], options: dict[str, int]
) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", device=DEVICE, **options)
    assert tokens(llm.generate(prompts(), GREEDY)) == reference


def test_each_prompt_alone_gives_the_same_tokens_as_in_a_batch_on_cuda(
    tiny_llama: Path, reference: list[list[int]]
) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", device=DEVICE)
    assert [tokens(llm.generate([p], GREEDY))[0] for p in prompts()] == reference


def test_preempted_requests_give_identical_tokens_on_cuda(
    tiny_llama: Path, reference: list[list[int]]
) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", device=DEVICE, block_size=4, num_kv_blocks=16, chunk_size=16)
    outputs = llm.generate(prompts(), GREEDY)
    assert tokens(outputs) == reference
    assert sum(o.num_preemptions for o in outputs) > 0
    assert llm.engine.kv.num_free_blocks == 16


def test_auto_device_is_cuda_and_auto_dtype_is_bfloat16(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama))  # device="auto", dtype="auto"
    assert_on_cuda(llm, torch.bfloat16)


def test_bfloat16_runs_and_agrees_with_float32_on_cuda(tiny_llama: Path) -> None:
    # Teacher forcing, as test_llama.py does on CPU: both dtypes predict the next token after the
    # same prefixes (fp32's own greedy continuation); bf16 near-ties may flip, most must not.
    prompt = prompts()[3]
    fp32 = LLM(str(tiny_llama), dtype="float32", device=DEVICE, num_kv_blocks=64)
    continuation = tokens(
        fp32.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    )[0]
    prefixes = [prompt + continuation[:i] for i in range(len(continuation))]
    bf16 = LLM(str(tiny_llama), device=DEVICE, num_kv_blocks=64, block_size=4, chunk_size=4)
    assert_on_cuda(bf16, torch.bfloat16)
    picked = [t[0] for t in tokens(bf16.generate(prefixes, SamplingParams(max_tokens=1, temperature=0)))]
    agree = sum(a == b for a, b in zip(picked, continuation, strict=True))
    assert agree >= 8, f"bf16 picked {picked}, fp32 {continuation}"
    # A full chunked, batched bf16 run completes with every token in the vocabulary.
    outputs = tokens(bf16.generate(prompts(), GREEDY))
    assert all(len(t) == GREEDY.max_tokens for t in outputs)
    assert all(0 <= t < bf16.engine.limits.vocab_size for ts in outputs for t in ts)
    assert bf16.engine.kv.num_free_blocks == bf16.engine.kv.num_blocks


# -- moving KV between engines ------------------------------------------------------------------------
def test_prefill_then_decode_through_kv_blocks_on_cuda(tiny_llama: Path) -> None:
    def engine(role: Role, device: str) -> EngineCore:
        core, _ = build_engine(
            EngineConfig(
                model=str(tiny_llama),
                dtype="float32",
                device=device,
                role=role,
                block_size=8,
                num_kv_blocks=64,
            )
        )
        return core

    batch = [list(range(10, 10 + n)) for n in (1, 5, 16, 23, 50)]
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    mixed = engine(Role.MIXED, DEVICE)
    for i, p in enumerate(batch):
        mixed.add_request(f"r{i}", p, params)
    expected = run_to_end(mixed)

    prefill = engine(Role.PREFILL, DEVICE)
    for i, p in enumerate(batch):
        prefill.add_request(f"r{i}", p, params)
    first: dict[str, int] = {}
    while prefill.has_unfinished:
        for out in prefill.step():
            first[out.request_id] = out.new_token_ids[0]
    # To a decode engine on the GPU, and to one on the CPU: write_blocks moves the data across.
    for decode_device in (DEVICE, "cpu"):
        decode = engine(Role.DECODE, decode_device)
        for i, p in enumerate(batch):
            decode.add_request(f"r{i}", p, params, output_token_ids=[first[f"r{i}"]])
        decode.step()  # allocates blocks for the incoming KV
        for request_id, dest_blocks in decode.take_kv_to_receive():
            blocks = prefill.runner.read_blocks(prefill.kv.block_table(request_id))
            assert blocks.is_cuda
            decode.runner.write_blocks(dest_blocks, blocks)
            assert decode.kv_received(request_id, ok=True) is None
        got = run_to_end(decode)
        for request_id, expected_tokens in expected.items():
            assert [first[request_id], *got[request_id]] == expected_tokens, decode_device
    for i in range(len(batch)):
        assert prefill.release(f"r{i}")
    assert prefill.kv.num_used_blocks == 0


# -- sampling -----------------------------------------------------------------------------------------
def test_seeded_sampling_with_penalties_is_reproducible_whatever_the_batch_on_cuda(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", device=DEVICE)
    params = SamplingParams(
        max_tokens=10,
        temperature=1.0,
        top_p=0.9,
        top_k=50,
        min_p=0.01,
        repetition_penalty=1.2,
        presence_penalty=0.3,
        frequency_penalty=0.3,
        seed=1234,
        logprobs=2,
        ignore_eos=True,
    )
    alone = tokens(llm.generate([prompts()[2]], params))[0]
    others = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    batched = tokens(llm.generate([prompts()[0], prompts()[2], prompts()[4]], [others, params, others]))[1]
    assert alone == batched
    different_seed = SamplingParams(
        max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=99, ignore_eos=True
    )
    assert tokens(llm.generate([prompts()[2]], different_seed))[0] != alone


def test_penalties_on_cuda_logits_equal_those_on_cpu() -> None:
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(0)) * 3
    params = SamplingParams(
        temperature=0.0, repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.4, logprobs=3
    )

    def rows() -> list[SamplingRow]:
        return [SamplingRow(params, None, [5, 6, 7, 299], [7, 7, 8, 9 + i]) for i in range(3)]

    cpu_tokens, cpu_logprobs = sample(logits, rows())
    cuda_tokens, cuda_logprobs = sample(logits.to(DEVICE), rows())
    assert cuda_tokens == cpu_tokens
    for a, b in zip(cuda_logprobs, cpu_logprobs, strict=True):
        assert a is not None and b is not None
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-5)
        assert list(a.top) == list(b.top)


# -- CUDA graphs of decode steps and the GPU's step budget --------------------------------------------
def test_decode_steps_replay_cuda_graphs_with_the_tokens_of_eager_steps(
    tiny_llama: Path, reference: list[list[int]]
) -> None:
    eager = LLM(str(tiny_llama), dtype="float32", device=DEVICE, cuda_graphs=False)
    assert eager.engine.runner.decode_graphs is None
    assert tokens(eager.generate(prompts(), GREEDY)) == reference
    llm = LLM(str(tiny_llama), dtype="float32", device=DEVICE)  # cuda_graphs by default
    graphs = llm.engine.runner.decode_graphs
    static = llm.engine.runner.static_decode
    assert graphs is not None and static is not None
    assert set(graphs.graphs) == {(b, c) for b in static.batches for c in static.contexts}
    # Six prompts: batch bucket 8, two padding rows; then fewer rows as requests end early.
    params = [SamplingParams(max_tokens=12 - i, temperature=0.0, ignore_eos=True) for i in range(6)]
    expected = [r[: 12 - i] for i, r in enumerate(reference)]
    assert tokens(llm.generate(prompts(), params)) == expected
    assert static.steps >= 10
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_sampling_on_replayed_steps_equals_sampling_on_eager_steps(tiny_llama: Path) -> None:
    params = [
        SamplingParams(max_tokens=10, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=10, temperature=0.0, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_tokens=6, temperature=1.2, top_k=20, seed=3, ignore_eos=True),
    ] * 2
    runs = []
    for graphs in (False, True):
        llm = LLM(str(tiny_llama), dtype="float32", device=DEVICE, cuda_graphs=graphs, block_size=4)
        outputs = llm.generate(prompts(), params)
        runs.append(
            [(o.outputs[0].token_ids, [lp.top for lp in o.outputs[0].logprobs or []]) for o in outputs]
        )
    assert [r[0] for r in runs[0]] == [r[0] for r in runs[1]]
    for (_, eager_top), (_, graph_top) in zip(runs[0], runs[1], strict=True):
        for a, b in zip(eager_top, graph_top, strict=True):
            assert list(a) == list(b)
            assert all(abs(a[k] - b[k]) < LOGPROB_TOLERANCE for k in a)


def test_a_gpu_engine_takes_gpu_sized_steps_unless_told_otherwise(tiny_llama: Path) -> None:
    from pdserve.config import GPU_CHUNK_SIZE, GPU_MAX_NUM_BATCHED_TOKENS

    llm = LLM(str(tiny_llama), dtype="float32", device=DEVICE)
    assert (llm.engine.max_num_batched_tokens, llm.engine.chunk_size) == (
        GPU_MAX_NUM_BATCHED_TOKENS,
        GPU_CHUNK_SIZE,
    )
    told = LLM(str(tiny_llama), dtype="float32", device=DEVICE, chunk_size=64, max_num_batched_tokens=256)
    assert (told.engine.max_num_batched_tokens, told.engine.chunk_size) == (256, 64)
