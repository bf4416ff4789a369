"""What sampling costs a decode step: greedy, temperature alone, and top_p, on the real model.

top_p needs the tokens in order of probability. The sampler looks for the nucleus among the
top `pdserve.engine.sampler.TOP_P_CANDIDATES` tokens first and sorts the whole vocabulary only
when the nucleus is wider than them; "whole sort" below sets the candidates to the vocabulary
size, which sorts every row every step (what the sampler did before). Both are timed in the same
process, alternating, on the same prompts:

    .venv/bin/python benchmarks/sampling_cost.py --batches 1,8 --tokens 64 --repeats 5

A step's time: (time for N tokens - time for 1 token) / (N - 1), from outside `LLM.generate`;
medians of the repeats. Prompts are English text (real distributions: how wide a nucleus is
depends on them), the same for every setting; `ignore_eos` keeps every row to N tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

PROMPTS = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a refrigerator keeps food cold, step by step.",
    "What are the main differences between a list and a tuple in Python?",
    "Describe the water cycle to a ten-year-old.",
    "Give me three ideas for a weekend trip near the mountains.",
    "Summarize the causes of the French Revolution in a paragraph.",
    "How do I make a simple tomato sauce for pasta?",
    "Why is the sky blue? Answer in plain words.",
)
SETTINGS = {  # name -> SamplingParams fields
    "greedy": {"temperature": 0.0},
    "temperature 1": {"temperature": 1.0},
    "temperature 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 1, top_p 0.95": {"temperature": 1.0, "top_p": 0.95},
}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", default=None, help="write the results as JSON here")
    args = p.parse_args()

    from pdserve import LLM, SamplingParams
    from pdserve.engine import sampler

    llm = LLM(args.model, kv_cache_memory_gib=1.0, prefix_cache=False)
    vocab = llm.engine.limits.vocab_size
    candidates = sampler.TOP_P_CANDIDATES

    def step_ms(prompts: list[str], fields: dict[str, float], whole_sort: bool) -> float:
        sampler.TOP_P_CANDIDATES = vocab if whole_sort else candidates
        times = []
        for tokens in (1, args.tokens):
            params = SamplingParams(max_tokens=tokens, ignore_eos=True, seed=0, **fields)
            started = time.perf_counter()
            llm.generate(prompts, params)
            times.append(time.perf_counter() - started)
        return (times[1] - times[0]) / (args.tokens - 1) * 1000

    results: dict[str, dict[str, float]] = {}
    for batch in [int(b) for b in args.batches.split(",")]:
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(batch)]
        step_ms(prompts, SETTINGS["greedy"], False)  # warm-up at this batch size
        for name, fields in SETTINGS.items():
            sorts = (False, True) if "top_p" in fields else (False,)
            runs: dict[bool, list[float]] = {whole_sort: [] for whole_sort in sorts}
            for _ in range(args.repeats):  # alternating: a drifting host slows both alike
                for whole_sort in sorts:
                    runs[whole_sort].append(step_ms(prompts, fields, whole_sort))
            for whole_sort, times in runs.items():
                label = f"b{batch} {name}" + (", whole sort" if whole_sort else "")
                results[label] = {"median_ms": statistics.median(times), "min_ms": min(times)}
                print(f"{label}: {statistics.median(times):.1f} ms a step (min {min(times):.1f})", flush=True)
    sampler.TOP_P_CANDIDATES = candidates
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
