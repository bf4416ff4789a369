"""The offline API on the real built-in model (SmolLM2-135M-Instruct, Q4_1 GGUF dequantized to
fp32): it answers like a language model, chat works end to end, stop strings cut the text, and
batching does not change greedy outputs."""

from __future__ import annotations

import pytest

from pdserve import LLM, SamplingParams

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("smollm2-135m", dtype="float32", kv_cache_memory_gib=0.25)


def test_greedy_completion_knows_the_capital_of_france(llm: LLM) -> None:
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0))[0]
    completion = out.outputs[0]
    assert completion.text.lstrip().startswith("Paris"), completion.text
    assert out.prompt_token_ids == llm.get_tokenizer().encode("The capital of France is")


def test_chat_reply_is_coherent_and_finishes(llm: LLM) -> None:
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    out = llm.chat(messages, SamplingParams(max_tokens=40, temperature=0))[0]
    completion = out.outputs[0]
    assert "Paris" in completion.text, completion.text
    assert completion.finish_reason in ("stop", "length")
    if completion.finish_reason == "stop":  # ended by the model's end-of-turn token
        assert completion.token_ids[-1] in llm.engine.eos_token_ids
    assert "<|im_end|>" not in completion.text and "<|im_start|>" not in completion.text
    assert out.prompt is not None and out.prompt.rstrip().endswith("assistant")


def test_a_stop_string_cuts_the_text(llm: LLM) -> None:
    prompt = "The capital of France is"
    full = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0))[0].outputs[0]
    assert "Paris" in full.text
    out = llm.generate(prompt, SamplingParams(max_tokens=8, temperature=0, stop=["aris"]))[0].outputs[0]
    assert out.text == full.text[: full.text.index("aris")]
    assert out.finish_reason == "stop" and out.stop_reason == "aris"
    assert len(out.token_ids) <= len(full.token_ids)
    included = llm.generate(
        prompt, SamplingParams(max_tokens=8, temperature=0, stop=["aris"], include_stop_str_in_output=True)
    )[0].outputs[0]
    assert included.text == full.text[: full.text.index("aris") + 4]
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


PROMPTS = [
    "Hi",
    "The capital of France is",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    "def fibonacci(n):",
    "Water boils at",
    "List three colors: red,",
    "Translate to French: Good morning, how are you today? I hope you slept well and",
    "1, 2, 3, 4,",
]


def test_a_batch_gives_the_same_greedy_tokens_as_each_prompt_alone(llm: LLM) -> None:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    alone = [llm.generate(p, params)[0].outputs[0].token_ids for p in PROMPTS]
    assert batched == alone
    assert all(len(t) == 8 for t in batched)


def test_the_text_is_transformers_decode_of_the_tokens(llm: LLM) -> None:
    """The offline text comes from the Rust tokenizer under transformers' (faster); it must read
    exactly as transformers' own decode of the same tokens, accents, CJK and emoji included."""
    assert llm._decoder is llm.tokenizer.backend_tokenizer
    prompts = [
        "Translate to Japanese: good morning",
        "Write 'café' and an emoji:",
        "Ça va? Réponds en français.",
    ]
    params = SamplingParams(max_tokens=24, temperature=0.0)
    for out in llm.generate(prompts, params):
        completion = out.outputs[0]
        decoded = llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        # A character cut by max_tokens (its first bytes only) is not shown, as in vLLM; transformers
        # shows U+FFFD for it.
        assert completion.text == decoded.removesuffix("\ufffd")


def test_a_conversation_s_turns_are_the_same_with_the_prefix_cache_as_without(llm: LLM) -> None:
    """Three chat turns, each resending the conversation: the cached engine (the module's, on by
    default) reuses most of every later turn and answers token for token as one that computes it all."""
    computed = LLM("smollm2-135m", dtype="float32", kv_cache_memory_gib=0.25, prefix_cache=False)
    params = SamplingParams(max_tokens=24, temperature=0)
    questions = [
        "Name three planets of the solar system and say one thing about each of them, please.",
        "Which of them is the largest?",
        "And which is closest to the Sun?",
    ]
    answers: dict[str, list[list[int]]] = {"cached": [], "computed": []}
    hits_before = llm.engine.kv.prefix_hits
    for name, engine in (("cached", llm), ("computed", computed)):
        messages: list[dict[str, str]] = []
        for question in questions:
            messages.append({"role": "user", "content": question})
            out = engine.chat(messages, params)[0].outputs[0]
            answers[name].append(out.token_ids)
            messages.append({"role": "assistant", "content": out.text})
    assert answers["cached"] == answers["computed"]
    assert llm.engine.kv.prefix_hits - hits_before >= 64  # later turns found their conversation
    assert computed.engine.kv.prefix_hits == 0
