"""The offline API end to end on tiny random models: identical to Hugging Face, whatever the
chunking, batching, block size or preemption; clear errors for bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import load_hf_reference

from pdserve import LLM, SamplingParams
from pdserve.errors import InvalidRequestError

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Lengths around and beyond the block size (4) and the chunk size (16): 1 block, partial blocks,
# several chunks.
PROMPT_LENGTHS = (1, 3, 4, 9, 17, 40)


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 250, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


def hf_greedy(
    path: Path, prompt_list: list[list[int]], max_new_tokens: int, weights_in_bf16: bool = False
) -> list[list[int]]:
    model = load_hf_reference(path, weights_in_bf16)
    model.generation_config.eos_token_id = None  # never stop early, like ignore_eos
    results = []
    for p in prompt_list:
        out = model.generate(
            torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0
        )
        results.append(out[0, len(p) :].tolist())
    return results


def tokens(outputs: list) -> list[list[int]]:  # type: ignore[type-arg]
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("name", ["llama-gqa-untied", "llama-gqa-tied", "qwen2-bias", "llama3-rope"])
def test_greedy_matches_transformers_for_a_batch(tiny_models: dict[str, Path], name: str) -> None:
    path = tiny_models[name]
    llm = LLM(str(path), dtype="float32", block_size=4, chunk_size=16, max_num_batched_tokens=32)
    ours = tokens(llm.generate(prompts(), GREEDY))
    # The same weights: bf16-rounded where the engine stores them so (this CPU's plan).
    assert ours == hf_greedy(path, prompts(), GREEDY.max_tokens, llm.engine.runner.model.weights_in_bf16)


@pytest.fixture(scope="module")
def reference(tiny_llama: Path) -> list[list[int]]:
    llm = LLM(str(tiny_llama), dtype="float32")
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
def test_greedy_tokens_do_not_depend_on_chunking_batching_or_block_size(
    tiny_llama: Path, reference: list[list[int]], options: dict[str, int]
) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", **options)
    assert tokens(llm.generate(prompts(), GREEDY)) == reference


def test_each_prompt_alone_gives_the_same_tokens_as_in_a_batch(
    tiny_llama: Path, reference: list[list[int]]
) -> None:
    llm = LLM(str(tiny_llama), dtype="float32")
    alone = [tokens(llm.generate([p], GREEDY))[0] for p in prompts()]
    assert alone == reference


def test_preempted_and_recomputed_requests_give_identical_tokens(
    tiny_llama: Path, reference: list[list[int]]
) -> None:
    # 16 blocks of 4 tokens cannot hold all six requests at once: some are preempted.
    llm = LLM(str(tiny_llama), dtype="float32", block_size=4, num_kv_blocks=16, chunk_size=16)
    outputs = llm.generate(prompts(), GREEDY)
    assert tokens(outputs) == reference
    assert sum(o.num_preemptions for o in outputs) > 0
    assert llm.engine.kv.num_free_blocks == 16  # nothing leaked


def test_prefix_caching_gives_the_greedy_tokens_of_computing_every_turn_again(tiny_llama: Path) -> None:
    # A conversation of four turns (each resends the whole conversation, then new tokens) and, in
    # the same batches, prompts that share its prefix: the cache skips most of each prompt.
    options = {"block_size": 4, "chunk_size": 16, "num_kv_blocks": 64}
    cached = LLM(str(tiny_llama), dtype="float32", **options)  # on by default
    computed = LLM(str(tiny_llama), dtype="float32", prefix_cache=False, **options)
    results = []
    for llm in (cached, computed):
        conversation, turns = prompts()[4], []
        for turn in range(4):
            batch = [conversation, [*conversation[:10], 7, 8, 9], prompts()[5]]
            outs = tokens(llm.generate(batch, GREEDY))
            turns.append(outs)
            conversation = conversation + outs[0] + [11 + turn, 12, 13]
        results.append(turns)
    assert results[0] == results[1]
    kv = cached.engine.kv
    assert kv.prefix_hits > kv.prefix_queries / 2  # most of every later turn was found
    assert computed.engine.kv.prefix_hits == 0 and kv.num_free_blocks == 64  # held by none
    kv.check_consistency()


def test_text_prompts_chat_and_outputs(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32")
    out = llm.generate("hello world", SamplingParams(max_tokens=5, temperature=0))[0]
    assert out.prompt == "hello world"
    assert out.prompt_token_ids[0] == llm.get_tokenizer().bos_token_id
    completion = out.outputs[0]
    assert len(completion.token_ids) <= 5 and completion.finish_reason in ("stop", "length")
    assert completion.text == llm.get_tokenizer().decode(
        [t for t in completion.token_ids if t != llm.get_tokenizer().eos_token_id]
    )
    chats = llm.chat(
        [[{"role": "user", "content": "hi"}], [{"role": "user", "content": "bye"}]],
        SamplingParams(max_tokens=3, temperature=0),
    )
    assert len(chats) == 2 and chats[0].prompt.endswith("<s>assistant: ")  # type: ignore[union-attr]
    assert chats[0].prompt_token_ids.count(llm.get_tokenizer().bos_token_id) == 2  # no BOS added twice


def test_max_tokens_and_finish_reason_length(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32")
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 7 and out.outputs[0].finish_reason == "length"


def test_stop_token_ids_and_stop_strings(tiny_llama: Path, reference: list[list[int]]) -> None:
    llm = LLM(str(tiny_llama), dtype="float32")
    prompt = prompts()[3]
    expected = reference[3]
    stop_token = expected[4]
    first = expected.index(stop_token)
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_token]))[0]
    assert out.outputs[0].token_ids == expected[: first + 1]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop_token

    # Random byte tokens are often invalid UTF-8; compare with our own text of the same run.
    full_text = llm.generate([prompt], GREEDY)[0].outputs[0].text
    stop = full_text[len(full_text) // 2 : len(full_text) // 2 + 2]
    out = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop=[stop]))[
        0
    ]
    assert out.outputs[0].text == full_text[: full_text.index(stop)]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32")
    params = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=1234, ignore_eos=True)
    alone = tokens(llm.generate([prompts()[2]], params))[0]
    others = SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True)
    batched = tokens(llm.generate([prompts()[0], prompts()[2], prompts()[4]], [others, params, others]))[1]
    assert alone == batched
    different_seed = SamplingParams(
        max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=99, ignore_eos=True
    )
    assert tokens(llm.generate([prompts()[2]], different_seed))[0] != alone


def test_logprobs_of_chosen_tokens(tiny_llama: Path) -> None:
    llm = LLM(str(tiny_llama), dtype="float32")
    out = llm.generate(
        [prompts()[1]], SamplingParams(max_tokens=4, temperature=0, logprobs=3, ignore_eos=True)
    )
    completion = out[0].outputs[0]
    assert completion.logprobs is not None and len(completion.logprobs) == 4
    for token, lp in zip(completion.token_ids, completion.logprobs, strict=True):
        assert lp.token_id == token and lp.logprob <= 0
        assert len(lp.top) == 3 and max(lp.top.values()) == pytest.approx(lp.logprob)  # greedy = top-1


@pytest.mark.parametrize(
    "prompt,params,message",
    [
        ([], SamplingParams(), "empty"),
        ("", SamplingParams(), "empty"),
        ([1, 2, 999_999], SamplingParams(), "outside the vocabulary"),
        ([1, -1], SamplingParams(), "outside the vocabulary"),
        ([1] * 5000, SamplingParams(), "context"),
    ],
)
def test_bad_prompts_get_clear_errors(
    tiny_llama: Path, prompt: object, params: SamplingParams, message: str
) -> None:
    llm = LLM(str(tiny_llama), dtype="float32", max_model_len=1024)
    with pytest.raises(InvalidRequestError, match=message):
        llm.generate([[5, 6], prompt] if prompt != "" else [prompt], params)  # type: ignore[list-item]
    assert not llm.engine.has_unfinished  # the good prompt was not queued either
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_bad_sampling_params_get_clear_errors() -> None:
    for kwargs, message in [
        ({"max_tokens": 0}, "max_tokens"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1}, "temperature"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            SamplingParams(**kwargs)  # type: ignore[arg-type]
