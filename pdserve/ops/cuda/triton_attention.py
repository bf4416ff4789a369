"""Paged attention for a whole step in one Triton kernel: decodes and prompt chunks (with their cached
context) alike, K and V read in place from their cache blocks (no gather, no padding to a bucket's
context), GQA by attending a KV head's G query heads together, a sliding window, bf16 or fp32 in and
fp32 accumulation. The contract is the C++ CPU op's (torch.ops.pdserve.paged_attention): the
runner's varlen metadata (block tables, lengths, query starts).

One program per (sequence, KV head, tile of BLOCK_Q queries): its rows are the tile's queries x G
heads, padded to a power of two of at least 16 (tl.dot's smallest tile); it walks the keys the
tile needs, BLOCK_N at a time, with an online softmax (running max and sum per row). Programs
past a sequence's queries return at once. The probabilities are rounded to the cache's dtype
before the V product, as the flash kernels and the CPU kernel do.

Runs compiled on a CUDA GPU, and on a CPU under Triton's interpreter (TRITON_INTERPRET=1, set
before triton is imported): that is how the CPU suite tests it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton

from pdserve.ops.attention import AttentionMetadata
from pdserve.ops.cuda.triton_kernels import paged_attention_kernel
from pdserve.ops.layer_ops import TorchLayerOps

if TYPE_CHECKING:
    pass

BLOCK_N = 32  # keys per tile
MAX_BLOCK_Q = 16  # queries per program


def paged_attention(
    q: torch.Tensor,  # [T, H, D] (rows may be strided, heads contiguous)
    k_cache: torch.Tensor,  # [NB, BS, KVH, D]
    v_cache: torch.Tensor,  # [NB, BS, KVH, D]
    block_tables: torch.Tensor,  # [S, MB] int64
    seq_lens: torch.Tensor,  # [S] int64: tokens in the cache, this step's included
    query_start_loc: torch.Tensor,  # [S + 1] int64: rows of each sequence in q
    scale: float,
    sliding_window: int,  # 0: none
    max_query_len: int,  # the most rows any sequence has (sizes the grid without a device sync)
) -> torch.Tensor:  # [T, H, D]
    tokens, heads, head_dim = q.shape
    _, kv_block, kv_heads, _ = k_cache.shape
    if q.stride(2) != 1 or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("q needs contiguous heads and the caches must be contiguous")
    if heads % kv_heads:
        raise ValueError(f"{heads} query heads are not a multiple of {kv_heads} KV heads")
    group = heads // kv_heads
    out = torch.empty(tokens, heads, head_dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    block_q = min(MAX_BLOCK_Q, triton.next_power_of_2(max(1, max_query_len)))
    grid = (seq_lens.shape[0], kv_heads, triton.cdiv(max_query_len, block_q))
    paged_attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        block_tables,
        seq_lens,
        query_start_loc,
        q.stride(0),
        q.stride(1),
        block_tables.shape[1],
        scale,
        sliding_window,
        NUM_KV_HEADS=kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        KV_BLOCK=kv_block,
        BLOCK_Q=block_q,
        BLOCK_M=max(16, triton.next_power_of_2(block_q * group)),
        BLOCK_N=BLOCK_N,
        FP32=q.dtype == torch.float32,
    )
    return out


class TritonLayerOps(TorchLayerOps):
    """The portable ops with the step's attention (`attend`) in the Triton kernel above; RoPE and
    the cache write stay torch's."""

    name = "triton-attention"
    varlen = True  # the runner builds the kernel's metadata (lengths, starts, one table per sequence)

    def attend(
        self,
        q: torch.Tensor,  # [T, H, D], rotated
        k: torch.Tensor,  # [T, KVH, D], rotated
        v: torch.Tensor,  # [T, KVH, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, H, D]
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
        assert (
            meta.block_tables is not None and meta.seq_lens is not None and meta.query_start_loc is not None
        )
        return paged_attention(
            q.contiguous(),
            k_cache,
            v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            scale,
            meta.sliding_window or 0,
            meta.max_query_len,
        )
