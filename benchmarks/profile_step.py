"""Where one engine step spends its time: torch.profiler over decode steps (batch B, 512-token
prompts) or over a 2048-token prefill, with the wall time of a step.

    .venv/bin/python benchmarks/profile_step.py --batch 1 --dtype bfloat16 --threads 1
    .venv/bin/python benchmarks/profile_step.py --prefill --dtype bfloat16 --threads 1

Prints the ops that took the most self CPU time (the table issue 13 asks for next to each missed
target) and the median step time without the profiler.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from pdserve.config import EngineConfig, Role
from pdserve.engine.factory import build_engine
from pdserve.sampling_params import SamplingParams


def prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    rng = random.Random(count * 7919 + length)
    return [[rng.randrange(100, vocab - 100) for _ in range(length)] for _ in range(count)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--prefill", action="store_true", help="profile a 2048-token prefill instead")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed (and profiled)")
    p.add_argument("--rows", type=int, default=25)
    args = p.parse_args()

    config = EngineConfig(model=args.model, dtype=args.dtype, threads=args.threads, role=Role.MIXED)
    engine, _ = build_engine(config)
    vocab = engine.limits.vocab_size
    print(
        f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}, "
        f"dtype {engine.runner.dtype}, threads {torch.get_num_threads()}"
    )

    if args.prefill:
        params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

        def run() -> float:
            engine.add_request(f"p{time.perf_counter_ns()}", prompts(1, 2048, vocab)[0], params)
            started = time.perf_counter()
            while engine.has_unfinished:
                engine.step()
            return time.perf_counter() - started

        run()  # warm-up
        times = [run() for _ in range(3)]
        print(
            f"prefill 2048: median {statistics.median(times) * 1000:.0f} ms "
            f"({2048 / statistics.median(times):.0f} tokens/s)"
        )
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            run()
    else:
        params = SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts(args.batch, 512, vocab)):
            engine.add_request(f"d{i}", prompt, params)
        while engine.scheduler.waiting or any(r.num_tokens_to_compute > 1 for r in engine.scheduler.running):
            engine.step()
        for _ in range(5):
            engine.step()
        times = []
        for _ in range(args.steps):
            started = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - started)
        step = statistics.median(times)
        print(f"decode b{args.batch}: median step {step * 1000:.2f} ms ({args.batch / step:.1f} tokens/s)")
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(args.steps):
                engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.rows))


if __name__ == "__main__":
    main()
