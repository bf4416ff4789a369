"""Does the kind of work a neighbour does slow a decode step? A decode batch is stepped on one CPU
while another engine on the other CPU does nothing, decodes, prefills short or long prompts, or a
plain Python loop spins; every kind is run in turn, round after round (a shared machine drifts).

    .venv/bin/python benchmarks/step_neighbours.py --streams 30 --context 1024 --rounds 3

The capacity simulator slows a worker's step by how busy its neighbours were (pdserve.sim.host),
not by what they ran: this measures whether that is enough. Needs two CPUs or more (the probe on
the last, the neighbour on the first). Prints each kind's median step time and its ratio to the
step with an idle neighbour; `--out` keeps every step's time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
from pathlib import Path

from pdserve.measure.neighbour import kind_error
from pdserve.measure.steps import StepProbe, busy_neighbour


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--streams", type=int, default=30, help="decode streams in the probe's batch")
    p.add_argument("--context", type=int, default=1024, help="each stream's prompt tokens")
    p.add_argument("--steps", type=int, default=40, help="decode steps a round, per kind")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--kinds", default="none,decode,prefill256,prefill2048,spin")
    p.add_argument("--out", type=Path, help="every step's seconds, by kind (JSON)")
    args = p.parse_args()
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind != "none" and (error := kind_error(kind)) is not None:
            p.error(f"{error}, or none")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        p.error("needs two CPUs: the probe on one, the neighbour on another")
    os.sched_setaffinity(0, {cpus[-1]})
    probe = StepProbe(args.model, args.dtype, 1, 1024, 2.0)
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_ in range(args.rounds):
        for kind in kinds:
            beside = busy_neighbour(args.model, args.dtype, cpus[0], kind) if kind != "none" else None
            with beside or contextlib.nullcontext():
                for _ in range(args.streams):
                    probe.add(args.context, args.steps + 1)
                probe.samples.clear()
                probe.run_all()
            full = [
                s.seconds
                for s in probe.samples
                if s.step.prefill_tokens == 0 and s.step.decode_streams == args.streams
            ]
            seconds[kind].extend(full)
            print(
                f"round {round_ + 1}: {kind:12s} {statistics.median(full) * 1000:8.2f} ms ({len(full)} steps)"
            )
    alone = statistics.median(seconds[kinds[0]])
    print(f"\n{args.streams} streams x {args.context} tokens of context, median of {args.rounds} rounds:")
    for kind in kinds:
        median = statistics.median(seconds[kind])
        print(f"  beside {kind:12s} {median * 1000:8.2f} ms  x{median / alone:.3f} of beside {kinds[0]}")
    if args.out is not None:
        args.out.write_text(json.dumps(seconds))


if __name__ == "__main__":
    main()
