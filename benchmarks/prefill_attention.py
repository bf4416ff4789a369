"""Prefill attention per layer: the C++ paged-attention op the engine runs for prompt chunks, on one
prompt prefilled in chunks as the scheduler cuts it, against the matmul rate of this core.

SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64), bf16 (or --dtype float32), 64-token
blocks in order.
Each chunk's queries attend to the chunk (causally) and to every earlier chunk, read in place from
the cache: the work of one layer of a whole prefill is 4 * heads * head_dim * T^2 / 2 FLOP.
`--layers` caches are cycled over so that the K/V come from memory as in a real forward pass.

    .venv/bin/python benchmarks/prefill_attention.py                  # 2048 tokens, 512 a chunk
    .venv/bin/python benchmarks/prefill_attention.py --tokens 4096 --chunk 256 --threads 2
    PDSERVE_CPU_ISA=avx2 .venv/bin/python benchmarks/prefill_attention.py --dtype float32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from pdserve.ops.cpu import kernels as cpu_kernels

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 64


def matmul_gflops(dtype: torch.dtype, seconds: float = 1.0) -> float:
    """torch's own matmul rate on this core (the prefill's limit), [2048 x 576] x [576 x 1536]."""
    a, b = torch.randn(2048, 576, dtype=dtype), torch.randn(576, 1536, dtype=dtype)
    a @ b  # warm-up
    runs, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        a @ b
        runs += 1
    return 2 * 2048 * 576 * 1536 * runs / (time.perf_counter() - started) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--layers", type=int, default=4, help="caches cycled over (to defeat the LLC)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if cpu_kernels.decode_attention_kernel() is None:
        sys.exit(f"the C++ kernel is unavailable: {cpu_kernels.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    blocks = -(-args.tokens // BLOCK_SIZE)
    caches = [  # [blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM] each, K and V
        (
            torch.randn(blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(dtype),
            torch.randn(blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(dtype),
        )
        for _ in range(args.layers)
    ]
    table = torch.arange(blocks).view(1, blocks)
    chunks = [(start, min(args.chunk, args.tokens - start)) for start in range(0, args.tokens, args.chunk)]
    queries = [torch.randn(n, HEADS, HEAD_DIM).to(dtype) for _, n in chunks]  # [n, H, D]
    scale = HEAD_DIM**-0.5
    per_layer: list[float] = []
    with torch.inference_mode():
        for _ in range(args.repeats):
            started = time.perf_counter()
            for k_cache, v_cache in caches:
                for (start, n), q in zip(chunks, queries, strict=True):
                    torch.ops.pdserve.paged_attention(
                        q, k_cache, v_cache, table, torch.tensor([start + n]), torch.tensor([0, n]), scale, 0
                    )
            per_layer.append((time.perf_counter() - started) / args.layers)
    seconds = statistics.median(per_layer)
    flop = 4 * HEADS * HEAD_DIM * args.tokens * args.tokens / 2
    print(
        f"{args.dtype}, {args.tokens} tokens in chunks of {args.chunk}, {args.threads} thread(s), "
        f"kernels {torch.ops.pdserve.kernel_isa()}: "
        f"{seconds * 1e3:.1f} ms a layer (median of {args.repeats}), {flop / seconds / 1e9:.0f} GFLOP/s; "
        f"torch {args.dtype} matmul here: {matmul_gflops(dtype):.0f} GFLOP/s"
    )


if __name__ == "__main__":
    main()
