"""Mixed steps and ragged decode batches against the sum of their parts: the real engine (as a
worker builds it), stepped by hand (pdserve.measure.steps.StepProbe), every step timed as served.

- mixed: B streams decoding (context ~256), then a P-token prompt joins one step. Its time against
  the line through its parts: decode(B) + prompt alone(P) - a 1-token step (the step's fixed cost,
  counted once). A decode worker prefilling a chat prompt itself, or a colocated worker, runs these.
- ragged: B streams of which one has a long context, against B streams of the short one's.

    .venv/bin/python benchmarks/mixed_step.py
    .venv/bin/python benchmarks/mixed_step.py --batches 8,32 --prompts 32 --repeats 5

Prints one line per case with medians over `--repeats` rounds (a round builds the batch anew).
"""

from __future__ import annotations

import argparse
import statistics

import torch

from pdserve.measure.steps import StepProbe


def alone(probe: StepProbe, tokens: int, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        probe.samples.clear()
        probe.add(tokens, 1)
        probe.run_all()
        times.append(probe.samples[0].seconds)
    return statistics.median(times)


def decode_then(probe: StepProbe, contexts: list[int], prompt: int, repeats: int) -> tuple[float, float]:
    """(median decode step of the batch, median step with `prompt` tokens joining it); prompt 0:
    the decode steps only."""
    decodes, mixed = [], []
    for _ in range(repeats):
        for context in contexts:
            probe.add(context, 64)
        stepping = probe.steps()
        while not probe.samples or probe.samples[-1].step.decode_streams < len(contexts):
            next(stepping)  # until every stream decodes
        probe.samples.clear()
        for _ in range(4):
            next(stepping)
        if prompt:
            probe.add(prompt, 1)
            next(stepping)
        decodes += [s.seconds for s in probe.samples if not s.step.prefill_tokens]
        mixed += [s.seconds for s in probe.samples if s.step.prefill_tokens == prompt and prompt]
        for _ in stepping:
            pass
        probe.samples.clear()
    return statistics.median(decodes), statistics.median(mixed) if mixed else 0.0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--batches", default="8,16,32")
    p.add_argument("--prompts", default="16,32,64")
    p.add_argument("--long-context", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    probe = StepProbe(args.model, args.dtype, None, 1024, 1.0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, dtype {probe.engine.runner.dtype}")
    probe.add(64, 8)  # warm-up
    probe.run_all()
    batches = [int(b) for b in args.batches.split(",")]
    prompts = [int(t) for t in args.prompts.split(",")]
    base = alone(probe, 1, 2 * args.repeats)
    for prompt in prompts:
        prompt_s = alone(probe, prompt, 2 * args.repeats)
        for batch in batches:
            decode_s, mixed_s = decode_then(probe, [256] * batch, prompt, args.repeats)
            line = decode_s + prompt_s - base
            print(
                f"mixed B={batch:3d} P={prompt:3d}: decode {decode_s * 1e3:6.1f} ms, prompt alone "
                f"{prompt_s * 1e3:6.1f}, 1 token {base * 1e3:5.1f}, mixed {mixed_s * 1e3:6.1f}, "
                f"line {line * 1e3:6.1f}: {(mixed_s - line) * 1e3:+5.1f} ms",
                flush=True,
            )
    for batch in batches:
        even, _ = decode_then(probe, [256] * batch, 0, args.repeats)
        ragged, _ = decode_then(probe, [args.long_context] + [256] * (batch - 1), 0, args.repeats)
        print(
            f"ragged B={batch:3d}: all at 256 {even * 1e3:6.1f} ms, one at {args.long_context} "
            f"{ragged * 1e3:6.1f} ms: {(ragged - even) * 1e3:+5.1f} ms",
            flush=True,
        )


if __name__ == "__main__":
    main()
