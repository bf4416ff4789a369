"""Does the kind of work a neighbour does slow a decode step? A decode batch is stepped on one CPU
while another engine on the other CPU does nothing, decodes, prefills short or long prompts, or a
plain Python loop spins; every kind is run in turn, round after round (a shared machine drifts).

    .venv/bin/python benchmarks/step_neighbours.py --streams 30 --context 1024 --rounds 3

The capacity simulator slows a worker's step by how busy its neighbours were (pdserve.sim.host),
not by what they ran: this measures whether that is enough. Needs two CPUs or more (the probe on
the last, the neighbour on the first). Prints each kind's median step time and its ratio to the
step with an idle neighbour; `--out` keeps every step's time.

`--start`: instead, how long an engine takes to load (to its first step) on the neighbour's own CPU,
as a worker the planner adds shares a CPU with one already there:

    .venv/bin/python benchmarks/step_neighbours.py --start --rounds 2 --kinds none,spin,prefill2048,decode
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from pathlib import Path

from pdserve.measure.neighbour import kind_error
from pdserve.measure.steps import StepProbe, busy_neighbour


def beside(args: argparse.Namespace, kind: str, cpu: int) -> contextlib.AbstractContextManager[object]:
    """The neighbour of `kind` on `cpu` meanwhile ("none": no neighbour)."""
    return busy_neighbour(args.model, args.dtype, cpu, kind) if kind != "none" else contextlib.nullcontext()


def starts(args: argparse.Namespace, kinds: list[str], cpu: int) -> None:
    """An engine loaded on the neighbour's CPU (the busy neighbour's own start: model, cache,
    first batch), timed to its "ready", beside each kind in turn."""
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_ in range(args.rounds):
        for kind in kinds:
            with beside(args, kind, cpu):
                started = time.monotonic()
                with busy_neighbour(args.model, args.dtype, cpu, "decode"):
                    seconds[kind].append(time.monotonic() - started)
            print(f"round {round_ + 1}: {kind:12s} {seconds[kind][-1]:6.1f} s to load")
    alone = statistics.median(seconds[kinds[0]])
    print(f"\nan engine's load on a CPU shared with the neighbour, median of {args.rounds} rounds:")
    for kind in kinds:
        median = statistics.median(seconds[kind])
        print(f"  beside {kind:12s} {median:6.1f} s  x{median / alone:.2f} of beside {kinds[0]}")


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
    p.add_argument("--start", action="store_true", help="time an engine's load beside each kind instead")
    args = p.parse_args()
    kinds = args.kinds.split(",")
    for kind in kinds:
        if kind != "none" and (error := kind_error(kind)) is not None:
            p.error(f"{error}, or none")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        p.error("needs two CPUs: the probe on one, the neighbour on another")
    os.sched_setaffinity(0, {cpus[-1]})
    if args.start:
        starts(args, kinds, cpus[0])
        return
    probe = StepProbe(args.model, args.dtype, 1, 1024, 2.0)
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_ in range(args.rounds):
        for kind in kinds:
            with beside(args, kind, cpus[0]):
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
