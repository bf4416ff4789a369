"""Why `dtype="auto"` is float32 on a CPU without native bf16: matmul speed per dtype.

    .venv/bin/python benchmarks/matmul_dtypes.py

Times SmolLM2's MLP-sized matmul ([M, 576] x [576, 1536]) in float32 and bfloat16 at M = 1, 32
and 2048 with one and two threads, and prints GFLOP/s (median of 5 runs of a timed loop).
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F


def gflops(m: int, dtype: torch.dtype) -> float:
    a = torch.randn(m, 576, dtype=dtype)
    w = torch.randn(1536, 576, dtype=dtype)
    loops = 200 if m < 100 else 5
    for _ in range(3):
        F.linear(a, w)
    runs = []
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(loops):
            F.linear(a, w)
        runs.append((time.perf_counter() - started) / loops)
    return 2 * m * 576 * 1536 / statistics.median(runs) / 1e9


def main() -> None:
    print(f"torch {torch.__version__}, CPU capability {torch.backends.cpu.get_cpu_capability()}")
    print("| threads | M | float32 GFLOP/s | bfloat16 GFLOP/s | bf16 / fp32 |")
    print("|---|---|---|---|---|")
    for threads in (1, 2):
        torch.set_num_threads(threads)
        for m in (1, 32, 2048):
            fp32, bf16 = gflops(m, torch.float32), gflops(m, torch.bfloat16)
            print(f"| {threads} | {m} | {fp32:.1f} | {bf16:.1f} | {bf16 / fp32:.2f} |")


if __name__ == "__main__":
    main()
