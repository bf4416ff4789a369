"""Write a pdserve bench workload as a `vllm bench serve --dataset-name timed_trace` file, so both
clients send the same requests at the same times (the like-for-like open-loop check in
docs/benchmarking.md). No torch.

    python benchmarks/vllm_timed_trace.py --workload "trace(../shared/traces/azure_conv_2023.csv, \\
        rate=0.4, max_prompt_tokens=384, max_output_tokens=48)" --max-requests 40 --out trace.jsonl

Each line: timestamp (s), input_length, output_length, and hash_ids that vLLM expands into random
token ids 16 at a time; every request gets hash ids of its own, so no two prompts share a prefix
(pdserve's prompts never do either).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from pdserve.bench.workload import parse_workload

CHUNK = 16  # vLLM's --timed-trace-chunk-hash-size default


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--duration", type=float, default=None)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    workload = parse_workload(args.workload, args.seed, args.max_requests, args.duration)
    next_hash = 0
    with args.out.open("w") as f:
        for spec in workload.requests:
            if spec.arrival_s is None:
                raise SystemExit("a timed trace needs arrival times: use an open-loop workload")
            chunks = math.ceil(spec.prompt_tokens / CHUNK)
            hash_ids = list(range(next_hash, next_hash + chunks))
            next_hash += chunks
            line = {
                "timestamp": spec.arrival_s,
                "input_length": spec.prompt_tokens,
                "output_length": spec.output_tokens,
                "hash_ids": hash_ids,
            }
            f.write(json.dumps(line) + "\n")
    print(f"{len(workload.requests)} requests over {workload.requests[-1].arrival_s:.1f} s -> {args.out}")


if __name__ == "__main__":
    main()
