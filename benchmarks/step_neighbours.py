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
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from pdserve.measure.steps import StepProbe

# The neighbour: its own process, pinned; it works until its stdin closes.
NEIGHBOUR = r"""
import os, sys, threading
model, kind, cpu, dtype = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
os.sched_setaffinity(0, {cpu})
stop = threading.Event()
def until_stdin_closes():
    sys.stdin.read()
    stop.set()
threading.Thread(target=until_stdin_closes, daemon=True).start()
if kind == "spin":
    print("ready", flush=True)
    total = 0
    while not stop.is_set():
        for i in range(100000):
            total += i
    sys.exit(0)
from pdserve.config import EngineConfig, Role
from pdserve.engine.factory import build_engine
from pdserve.sampling_params import SamplingParams
engine, _ = build_engine(
    EngineConfig(model=model, device="cpu", dtype=dtype, role=Role.MIXED, threads=1, chunk_size=2048,
                 max_num_batched_tokens=2112, max_num_seqs=256, kv_cache_memory_gib=1.0),
    eos_token_ids=(0,),
)
serial = 0
def add(tokens, max_tokens):
    global serial
    serial += 1
    prompt = [1 + (serial * 7919 + i) % 40000 for i in range(tokens)]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(f"n{serial}", prompt, params)
print("ready", flush=True)
while not stop.is_set():
    if not engine.has_unfinished:
        if kind == "decode":  # 16 streams at a few hundred tokens of context
            for _ in range(16):
                add(300, 200)
        else:  # "prefill<N>": one N-token prompt a step, one token out
            add(int(kind.removeprefix("prefill")), 1)
    engine.step()
"""


def start_neighbour(model: str, kind: str, cpu: int, dtype: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", NEIGHBOUR, model, kind, str(cpu), dtype],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    if process.stdout.readline().strip() != "ready":  # it loads a model: a readline, no timeout race
        raise SystemExit(f"the {kind} neighbour exited with {process.wait(timeout=30)} before it was ready")
    return process


def stop_neighbour(process: subprocess.Popen[str]) -> None:
    assert process.stdin is not None
    process.stdin.close()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)


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
        if kind not in ("none", "decode", "spin") and not kind.removeprefix("prefill").isdigit():
            p.error(f"unknown neighbour kind {kind!r}: none, decode, spin or prefill<N>")
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        p.error("needs two CPUs: the probe on one, the neighbour on another")
    os.sched_setaffinity(0, {cpus[-1]})
    probe = StepProbe(args.model, args.dtype, 1, 1024, 2.0)
    seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
    for round_ in range(args.rounds):
        for kind in kinds:
            neighbour = start_neighbour(args.model, kind, cpus[0], args.dtype) if kind != "none" else None
            try:
                for _ in range(args.streams):
                    probe.add(args.context, args.steps + 1)
                probe.samples.clear()
                probe.run_all()
            finally:
                if neighbour is not None:
                    stop_neighbour(neighbour)
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
