"""A busy neighbour for `pdserve profile` (torch): an engine pinned to another CPU that decodes a
batch without end, as a second worker of the host would, until its stdin closes. The step sweep
run beside it measures what a worker's steps cost when the host's other cores (their caches and
memory bandwidth) are busy too.

    python -m pdserve.measure.neighbour MODEL CPU DTYPE
"""

from __future__ import annotations

import os
import sys
import threading


def main() -> int:
    model, cpu, dtype = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    os.sched_setaffinity(0, {cpu})
    from pdserve.config import EngineConfig, Role
    from pdserve.engine.factory import build_engine
    from pdserve.sampling_params import SamplingParams

    engine, _ = build_engine(
        EngineConfig(
            model=model, device="cpu", dtype=dtype, role=Role.MIXED, threads=1, kv_cache_memory_gib=0.5
        ),
        eos_token_ids=(0,),
    )
    stop = threading.Event()

    def until_stdin_closes() -> None:
        sys.stdin.read()
        stop.set()

    threading.Thread(target=until_stdin_closes, daemon=True).start()
    serial = 0
    print("ready", flush=True)
    while not stop.is_set():
        if not engine.has_unfinished:  # a batch of 16 streams at a few hundred tokens of context
            for _ in range(16):
                serial += 1
                params = SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)
                engine.add_request(f"n{serial}", [1 + (serial * 13 + i) % 5000 for i in range(300)], params)
        engine.step()
    return 0


if __name__ == "__main__":
    sys.exit(main())
