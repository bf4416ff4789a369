"""How often storing an fp32 model's matrices in bf16 (the AVX2 stream GEMV, cpu/linear.py) changes
the greedy answer: SmolLM2 in fp32 with the full weights (PDSERVE_STREAM_GEMV=0) against the same
engine with bf16-rounded weights (the stream for steps of up to 256 rows, F.linear over the rounded
copy above), over a fixed set of chat questions (greedy, up to --tokens, stopping at EOS). Prints how many answers differ and where each
first diverges.

    .venv/bin/python benchmarks/bf16_weights_fidelity.py [--tokens 64] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in two sentences.",
    "Write a haiku about the sea.",
    "What is 17 times 23?",
    "Give three tips for learning a new language.",
    "Who wrote Romeo and Juliet?",
    "Write a Python function that reverses a string.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Cinderella.",
    "What is the difference between a virus and a bacterium?",
    "Name five fruits that are red.",
    "How does a bicycle stay upright?",
    "Translate 'good morning' into Spanish and German.",
    "What is a prime number? Give an example.",
    "Describe the water cycle.",
    "Why is the sky blue?",
    "List the planets of the solar system in order.",
    "What is the boiling point of water at sea level in Fahrenheit?",
    "Write a short apology email for missing a meeting.",
    "What is machine learning, in one paragraph?",
]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    from pdserve import LLM, SamplingParams
    from pdserve.engine import factory
    from pdserve.ops.cpu.plan import cpu_plan

    params = SamplingParams(max_tokens=args.tokens, temperature=0)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]

    def answers(bf16_weights: bool) -> list[list[int]]:
        os.environ["PDSERVE_STREAM_GEMV"] = "1" if bf16_weights else "0"
        plan = dataclasses.replace(
            cpu_plan(),
            prepack={"float32": False},
            stream_rows={"float32": 256},
            logits_stream_rows={"float32": 256},
        )
        factory.cpu_plan = lambda: plan  # type: ignore[assignment]  # the stream whatever this CPU chose
        llm = LLM("smollm2-135m", dtype="float32", kv_cache_memory_gib=0.5)
        assert llm.engine.runner.model.weights_in_bf16 == bf16_weights
        return [out.outputs[0].token_ids for out in llm.chat(conversations, params)]

    full, rounded = answers(False), answers(True)
    diverged = []
    for question, a, b in zip(QUESTIONS, full, rounded, strict=True):
        first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
        if first is None and len(a) != len(b):
            first = min(len(a), len(b))  # one stopped (EOS) where the other went on
        if first is not None:
            diverged.append({"question": question, "first_different_token": first})
    result = {"answers": len(QUESTIONS), "tokens": args.tokens, "differ": len(diverged), "diverged": diverged}
    print(json.dumps(result, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
