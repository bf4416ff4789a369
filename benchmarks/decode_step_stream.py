"""A whole decode step (SmolLM2, bf16, one thread) at a few streams, with the stream GEMV as this
machine's plan chooses it, as plan version 6 chose it (up to `--old-rows` rows, the logits too),
and without it; the engines take turns, round after round, and each step time is the median of
each round's steps, then the median over rounds.

    .venv/bin/python benchmarks/decode_step_stream.py --old-rows 4 --rounds 5

The plan used to time the stream on one 1536x576 weight; a real step also runs the wide gate+up
projection and the vocabulary-wide logits, where reading the weight again for each row costs more
than oneDNN's packed matmul: the plan now times a layer's projections and the logits apart.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics

from pdserve.engine import factory
from pdserve.measure.steps import StepProbe
from pdserve.ops.cpu.plan import cpu_plan


def probe_with(stream_rows: int | None, logits_rows: int | None) -> StepProbe:
    """An engine built under the machine's plan (None, None) or with these stream row limits."""
    plan = cpu_plan()
    if stream_rows is not None:
        plan = dataclasses.replace(
            plan, stream_rows={"bfloat16": stream_rows}, logits_stream_rows={"bfloat16": logits_rows or 0}
        )
    saved = factory.cpu_plan
    factory.cpu_plan = lambda: plan  # type: ignore[assignment]
    try:
        return StepProbe("smollm2-135m", "bfloat16", 1, 1024, 0.5)
    finally:
        factory.cpu_plan = saved  # type: ignore[assignment]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=16, help="decode steps a round, per engine and width")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--old-rows", type=int, default=4, help="what plan version 6 chose here (pdserve info)")
    args = p.parse_args()
    os.sched_setaffinity(0, {sorted(os.sched_getaffinity(0))[-1]})
    plan = cpu_plan()
    print(
        f"this machine's plan: stream up to {plan.stream_rows.get('bfloat16', 0)} rows, "
        f"the logits' up to {plan.logits_stream_rows.get('bfloat16', 0)}"
    )
    engines = {
        "plan": probe_with(None, None),
        f"old (up to {args.old_rows}, logits too)": probe_with(args.old_rows, args.old_rows),
        "no stream": probe_with(0, 0),
    }
    medians: dict[tuple[str, int], list[float]] = {}
    for _ in range(args.rounds):
        for streams in args.streams:
            for name, probe in engines.items():
                for _ in range(streams):
                    probe.add(args.context, args.steps + 1)
                probe.samples.clear()
                probe.run_all()
                full = [
                    s.seconds
                    for s in probe.samples
                    if s.step.prefill_tokens == 0 and s.step.decode_streams == streams
                ]
                medians.setdefault((name, streams), []).append(statistics.median(full))
    print(f"decode step ms at {args.context} tokens of context, median of {args.rounds} rounds:")
    print("streams | " + " | ".join(engines))
    for streams in args.streams:
        cells = [f"{statistics.median(medians[(name, streams)]) * 1000:.1f}" for name in engines]
        print(f"{streams} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
