"""Decode attention per layer: the C++ CPU kernel against the portable torch path (gather + SDPA).

The kernel is what the engine's CpuKernelOps calls for a batch of decodes: `paged_attention` (bf16),
or the older `paged_decode_attention` for fp32 caches. Shapes are SmolLM2-135M's (9 query heads, 3 KV heads, head_dim 64), blocks of 16 tokens scattered
over the cache as a long-running engine leaves them, ~540 tokens of context per sequence (ragged).
Each timed call is one layer's `paged_attention` for the decode batch (this step's K/V store
included), cycling over `--layers` layers of one [layers, 2, blocks, 16, 3, 64] cache so the K/V
come from memory as in a real forward pass rather than staying in the last-level cache.

    .venv/bin/python benchmarks/decode_attention.py
    .venv/bin/python benchmarks/decode_attention.py --batches 32 --threads 2 --dtypes float32
    .venv/bin/python benchmarks/decode_attention.py --build-times   # also: first build, cached load
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from pdserve.ops.attention import AttentionMetadata, paged_attention
from pdserve.ops.cpu import kernels as cpu_kernels
from pdserve.ops.cpu.ops import CpuKernelOps

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
ROUNDS = 3


Attention = Callable[..., torch.Tensor]


def kernel_attention(
    q: torch.Tensor,  # [B, H, D]
    k: torch.Tensor,  # [B, KVH, D]
    v: torch.Tensor,
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [B, H, D]
    """The engine's kernel path for a step of decodes (CpuKernelOps.attention, less RoPE): this
    step's K/V stored, then the C++ op the engine picks for the cache's dtype."""
    _, _, num_kv_heads, head_dim = k_cache.shape
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    assert meta.block_tables is not None and meta.seq_lens is not None and meta.query_start_loc is not None
    if k_cache.dtype == torch.float32 and CpuKernelOps().decode_kernel_for_fp32:
        out: torch.Tensor = torch.ops.pdserve.paged_decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, 0
        )
        return out
    out = torch.ops.pdserve.paged_attention(
        q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, 0
    )
    return out


def make_layers(
    num_seqs: int, context: int, num_layers: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, AttentionMetadata, AttentionMetadata]:
    """The cache [L, 2, NB, BS, KVH, D] and the step's metadata for the kernel (lengths, starts,
    one table per sequence) and for the portable path (padded tables and a mask)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [context + int(x) for x in torch.randint(-10, 11, (num_seqs,), generator=gen)]
    needed = [-(-n // BLOCK_SIZE) for n in lens]
    num_blocks = sum(needed) + 8
    cache = torch.randn(num_layers, 2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(needed)
    tables, slots = [], []
    for n, count in zip(lens, needed, strict=True):
        own, ids = ids[:count], ids[count:]
        tables.append(own + [0] * (max_blocks - count))
        slots.append(own[(n - 1) // BLOCK_SIZE] * BLOCK_SIZE + (n - 1) % BLOCK_SIZE)
    lengths = torch.tensor(lens, dtype=torch.long)
    mask = torch.arange(max_blocks * BLOCK_SIZE)[None, :] < lengths[:, None]  # [B, ctx]
    table_tensor = torch.tensor(tables, dtype=torch.long)
    portable = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        num_decode_tokens=num_seqs,
        decode_block_tables=table_tensor,
        decode_mask=mask[:, None, None, :],
        decode_seq_lens=lengths,
    )
    kernel = AttentionMetadata(
        slot_mapping=portable.slot_mapping,
        num_decode_tokens=num_seqs,
        seq_lens=lengths,
        query_start_loc=torch.arange(num_seqs + 1, dtype=torch.long),
        block_tables=table_tensor,
    )
    return cache, kernel, portable


def time_per_layer(
    attention: Attention, cache: torch.Tensor, meta: AttentionMetadata, dtype: torch.dtype, seconds: float
) -> list[float]:
    """Milliseconds per layer of `attention` over the decode batch, one sample per pass."""
    num_seqs, num_layers = meta.num_decode_tokens, cache.shape[0]
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(num_seqs, HEADS, HEAD_DIM, generator=gen).to(dtype)
    k = torch.randn(num_seqs, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    v = torch.randn(num_seqs, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    scale = HEAD_DIM**-0.5
    for layer in range(num_layers):  # warm-up: first-call costs, the other path's data out of cache
        attention(q, k, v, cache[layer, 0], cache[layer, 1], meta, scale)
    samples: list[float] = []
    started = time.perf_counter()
    while time.perf_counter() - started < seconds or len(samples) < 3:
        t0 = time.perf_counter()
        for layer in range(num_layers):  # one pass over the layers, like a forward pass
            attention(q, k, v, cache[layer, 0], cache[layer, 1], meta, scale)
        samples.append((time.perf_counter() - t0) / num_layers * 1e3)
    return samples


def check_agreement(
    cache: torch.Tensor, kernel_meta: AttentionMetadata, portable_meta: AttentionMetadata
) -> float:
    n = kernel_meta.num_decode_tokens
    q = torch.randn(n, HEADS, HEAD_DIM).to(cache.dtype)
    k = torch.randn(n, KV_HEADS, HEAD_DIM).to(cache.dtype)
    v = torch.randn(n, KV_HEADS, HEAD_DIM).to(cache.dtype)
    a = kernel_attention(q, k, v, cache[0, 0], cache[0, 1], kernel_meta, HEAD_DIM**-0.5)
    b = paged_attention(q, k, v, cache[0, 0], cache[0, 1], portable_meta, HEAD_DIM**-0.5)
    return float((a.float() - b.float()).abs().max())


def build_times() -> None:
    """First build into an empty cache folder, then a cached load, each in a fresh process."""
    code = (
        "import time, torch; t = time.perf_counter()\n"
        "from pdserve.ops.cpu.kernels import decode_attention_kernel\n"
        "assert decode_attention_kernel() is not None\n"
        "print(time.perf_counter() - t)"
    )
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "PDSERVE_CACHE_DIR": folder, "PDSERVE_CPU_KERNELS": "1"}
        for label in ("first build", "cached load"):
            out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
            if out.returncode:
                print(f"{label}: failed\n{out.stderr[-2000:]}")
                return
            print(f"{label}: {float(out.stdout.strip()) * 1e3:.1f} ms (after `import torch`)")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=540)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--layers", type=int, default=8, help="layers cycled over (to defeat the LLC)")
    parser.add_argument("--seconds", type=float, default=1.5, help="timing per path and configuration")
    parser.add_argument(
        "--build-times", action="store_true", help="also time a first build and a cached load"
    )
    args = parser.parse_args()

    if args.build_times:
        build_times()
    if cpu_kernels.decode_attention_kernel() is None:
        sys.exit(f"the C++ kernel is unavailable: {cpu_kernels.unavailable_reason()}")

    print(
        f"H={HEADS} KVH={KV_HEADS} D={HEAD_DIM} block_size={BLOCK_SIZE} context~{args.context} "
        f"layers={args.layers}, load average before: {os.getloadavg()[0]:.2f} (other work skews timings)"
    )
    columns = (
        ("dtype", 9),
        ("threads", 7),
        ("batch", 5),
        ("portable ms", 11),
        ("kernel ms", 9),
        ("speedup", 7),
    )
    header = " ".join(f"{name:>{width}}" for name, width in columns) + f" {'max|diff|':>9}"
    print(header)
    print("-" * len(header))
    with torch.inference_mode():
        for dtype_name in args.dtypes:
            dtype = getattr(torch, dtype_name)
            for threads in args.threads:
                torch.set_num_threads(threads)
                for batch in args.batches:
                    cache, kernel_meta, portable_meta = make_layers(batch, args.context, args.layers, dtype)
                    diff = check_agreement(cache, kernel_meta, portable_meta)
                    # Alternating rounds, so that load from elsewhere on the machine hits both alike.
                    portable_ms: list[float] = []
                    kernel_ms: list[float] = []
                    for _ in range(ROUNDS):
                        portable_ms += time_per_layer(
                            paged_attention, cache, portable_meta, dtype, args.seconds / ROUNDS
                        )
                        kernel_ms += time_per_layer(
                            kernel_attention, cache, kernel_meta, dtype, args.seconds / ROUNDS
                        )
                    portable, kernel = statistics.median(portable_ms), statistics.median(kernel_ms)
                    print(
                        f"{dtype_name:>9} {threads:>7} {batch:>5} {portable:>11.3f} {kernel:>9.3f} "
                        f"{portable / kernel:>6.1f}x {diff:>9.1e}"
                    )


if __name__ == "__main__":
    main()
