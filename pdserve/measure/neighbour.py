"""A busy neighbour for `pdserve profile` (torch): an engine pinned to another CPU that works
without end, as a second worker of the host would, until its stdin closes. The step sweep run
beside it measures what a worker's steps cost when the host's other cores (their caches and
memory bandwidth) are busy too; `benchmarks/step_neighbours.py` runs one of each kind.

    python -m pdserve.measure.neighbour MODEL CPU DTYPE [KIND]

KIND: `decode` (the default: 16 streams at a few hundred tokens of context), `prefill<N>` (one
N-token prompt a step, one token out) or `spin` (a Python loop, no model: the CPU without the
memory traffic).
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading


def kind_error(kind: str) -> str | None:
    """Why `kind` is no neighbour's kind (None: it is one)."""
    if kind in ("decode", "spin"):
        return None
    tokens = kind.removeprefix("prefill")
    if kind.startswith("prefill") and tokens.isdigit() and int(tokens) > 0:
        return None
    return f"unknown neighbour kind {kind!r}: decode, spin or prefill<N> (N prompt tokens, N > 0)"


def main() -> int:
    model, cpu, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    kind = sys.argv[4] if len(sys.argv) > 4 else "decode"
    if (error := kind_error(kind)) is not None:
        print(error, file=sys.stderr)
        return 2
    os.sched_setaffinity(0, {cpu})
    stop = threading.Event()

    def until_stdin_closes() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    if kind == "spin":
        print("ready", flush=True)
        total = 0
        while not stop.is_set():
            for i in range(100_000):
                total += i
        return 0

    from pdserve.config import EngineConfig, Role
    from pdserve.engine.factory import build_engine
    from pdserve.sampling_params import SamplingParams

    prompt_tokens = 0 if kind == "decode" else int(kind.removeprefix("prefill"))
    config = EngineConfig(
        model=model, device="cpu", dtype=dtype, role=Role.MIXED, threads=1, kv_cache_memory_gib=0.5
    )
    if prompt_tokens:  # a prompt in one step: its chunk as long as the prompt
        config = dataclasses.replace(
            config,
            chunk_size=prompt_tokens,
            max_num_batched_tokens=prompt_tokens + 64,
            kv_cache_memory_gib=1.0,
        )
    engine, _ = build_engine(config, eos_token_ids=(0,))
    vocab = engine.limits.vocab_size
    serial = 0

    def add(tokens: int, max_tokens: int) -> None:
        nonlocal serial
        serial += 1
        prompt = [1 + (serial * 13 + i) % min(5000, vocab - 2) for i in range(tokens)]
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        engine.add_request(f"n{serial}", prompt, params)

    def more_work() -> None:
        if kind == "decode":  # a batch of 16 streams at a few hundred tokens of context
            for _ in range(16):
                add(300, 200)
        else:
            add(prompt_tokens, 1)

    more_work()  # before "ready": a prompt the model cannot take fails here, not after
    print("ready", flush=True)
    while not stop.is_set():
        if not engine.has_unfinished:
            more_work()
        engine.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
