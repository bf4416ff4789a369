"""Decode attention over a serving-sized KV cache on 4 KiB pages (torch.zeros) against the same cache
on 2 MiB pages (ops/cpu/huge_pages.py), through the C++ kernel the engine calls.

One cache [layers, 2, blocks, `--block-size`, 3, 64] per kind (SmolLM2-135M's shapes, `--cache-gib`
each), a batch of decodes of ~`--context` tokens whose blocks are spread at random over the whole
cache (as a long-running engine leaves them) or taken in order (a fresh engine); one sample = one
pass over every layer, as a forward pass makes. The two kinds alternate, so load from elsewhere hits both.

    .venv/bin/python benchmarks/kv_huge_pages.py
    .venv/bin/python benchmarks/kv_huge_pages.py --batches 8 --order in-order --rounds 9
    .venv/bin/python benchmarks/kv_huge_pages.py --block-size 64 --batches 8 32
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from pdserve.ops.cpu import huge_pages
from pdserve.ops.cpu import kernels as cpu_kernels

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64


def one_pass(
    cache: torch.Tensor,  # [L, 2, NB, BS, KVH, D]
    q: torch.Tensor,  # [B, H, D]
    tables: torch.Tensor,  # [B, MB]
    lengths: torch.Tensor,  # [B]
) -> float:
    """Milliseconds for one layer after another of the kernel over this batch of decodes."""
    starts = torch.arange(q.shape[0] + 1, dtype=torch.long)
    started = time.perf_counter()
    for layer in range(cache.shape[0]):
        torch.ops.pdserve.paged_attention(
            q, cache[layer, 0], cache[layer, 1], tables, lengths, starts, HEAD_DIM**-0.5, 0
        )
    return (time.perf_counter() - started) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--context", type=int, default=520)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--cache-gib", type=float, default=1.5, help="size of each of the two caches")
    parser.add_argument("--order", choices=["scattered", "in-order"], default="scattered")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--block-size", type=int, default=16, help="tokens per block (the engine's default: 16)"
    )
    args = parser.parse_args()
    if cpu_kernels.decode_attention_kernel() is None:
        sys.exit(f"the C++ kernel is unavailable: {cpu_kernels.unavailable_reason()}")
    torch.set_num_threads(args.threads)
    block_size = args.block_size
    dtype = getattr(torch, args.dtype)
    element = torch.empty((), dtype=dtype).element_size()
    block_bytes = args.layers * 2 * block_size * KV_HEADS * HEAD_DIM * element
    num_blocks = int(args.cache_gib * 2**30) // block_bytes
    shape = (args.layers, 2, num_blocks, block_size, KV_HEADS, HEAD_DIM)

    small = torch.zeros(shape, dtype=dtype)
    huge, granted = huge_pages.zeros_on_huge_pages(shape, dtype)
    gen = torch.Generator().manual_seed(0)
    for cache in (small, huge):
        cache.normal_(generator=gen)
    backed = huge_pages.anon_huge_bytes(huge)
    print(
        f"{args.layers} layers, {num_blocks} blocks of {block_size} tokens ({args.cache_gib} GiB per cache), "
        f"{args.dtype}, {args.threads} thread(s), blocks {args.order}; transparent_hugepage="
        f"{huge_pages.thp_setting()}, 2 MiB cache: {(backed or 0) / 2**20:.0f} MiB on huge pages "
        f"(granted: {granted}); load average before: {os.getloadavg()[0]:.2f}"
    )
    print(f"{'batch':>5} {'4 KiB ms':>9} {'2 MiB ms':>9} {'ratio':>6}   (per pass over all layers, medians)")
    with torch.inference_mode():
        for batch in args.batches:
            blocks_each = -(-args.context // block_size)
            if batch * blocks_each > num_blocks:
                sys.exit(f"batch {batch} needs {batch * blocks_each} blocks; the cache has {num_blocks}")
            order = (
                torch.randperm(num_blocks, generator=gen)
                if args.order == "scattered"
                else torch.arange(num_blocks)
            )
            tables = order[: batch * blocks_each].view(batch, blocks_each).contiguous()  # [B, MB]
            lengths = torch.full((batch,), args.context, dtype=torch.long)
            q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(dtype)  # [B, H, D]
            times: dict[str, list[float]] = {"4k": [], "2m": []}
            one_pass(small, q, tables, lengths), one_pass(huge, q, tables, lengths)  # warm-up
            for _ in range(args.rounds):
                times["4k"].append(one_pass(small, q, tables, lengths))
                times["2m"].append(one_pass(huge, q, tables, lengths))
            a, b = statistics.median(times["4k"]), statistics.median(times["2m"])
            print(f"{batch:>5} {a:>9.2f} {b:>9.2f} {b / a:>5.2f}x")


if __name__ == "__main__":
    main()
