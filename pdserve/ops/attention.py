"""Attention over the paged KV cache (torch). The portable path: plain torch ops, CPU and CUDA.

The flat batch of one step holds `num_decode_tokens` decode tokens first (one per sequence), then
prompt chunks. Decodes are attended together: their blocks are gathered into a padded
[B, max_blocks * block_size] view and masked, each KV head's group of query heads at once. Each prompt chunk is attended on its own: with no
earlier context its fresh K/V are used directly under a causal mask; otherwise its earlier tokens
are gathered from the cache, and a lower-right causal bias (no mask tensor) lets CUDA use its
fused kernels; only a sliding window needs a mask.

This path is the reference. On CPU the C++ kernels do the same work without gathering blocks
(layer_ops.CpuKernelOps, chosen when the model is built); this module runs where they do not
(CUDA, a dtype they do not take, no compiler).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right


@dataclass
class PrefillChunkMeta:
    start: int  # first row of this chunk in the step's flat batch
    end: int
    num_context: int  # tokens of this request already in the cache before this chunk
    block_table: torch.Tensor  # [num_blocks_of_request] int64
    # [q_len, num_context + q_len] bool, True = attend (a sliding window); None = causal, each query
    # seeing the context and the chunk up to itself (flash-eligible: no mask tensor)
    mask: torch.Tensor | None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot of each new token's K/V
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int64
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size] bool
    # [num_decodes] int64: tokens in the cache per decode, this step's included (position + 1).
    # With the window below, what the CPU kernel needs instead of decode_mask.
    decode_seq_lens: torch.Tensor | None = None
    sliding_window: int | None = None  # the model's window (keys j > pos - window); None = full
    prefills: list[PrefillChunkMeta] = field(default_factory=list)
    # For the CPU kernels (layer_ops.CpuKernelOps), every sequence of the step, decodes first:
    seq_lens: torch.Tensor | None = None  # [S] int64: its tokens in the cache after this step
    query_start_loc: torch.Tensor | None = None  # [S + 1] int64: its rows in the flat batch
    block_tables: torch.Tensor | None = None  # [S, max_blocks] int64, padded with 0
    max_query_len: int = 0  # the most rows of any sequence (sizes a GPU kernel's grid)


def paged_attention(
    q: torch.Tensor,  # [T, H, D]
    k: torch.Tensor,  # [T, KVH, D]
    v: torch.Tensor,  # [T, KVH, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, H, D]
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    # Store this step's K/V first: decodes and later chunks read them back from the cache.
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)

    num_decodes = meta.num_decode_tokens
    if num_decodes:
        assert meta.decode_block_tables is not None and meta.decode_mask is not None
        tables = meta.decode_block_tables
        ctx = tables.shape[1] * block_size
        # [B, ctx, KVH, D]: whole blocks gathered at once (contiguous rows of block_size tokens).
        keys = k_cache.index_select(0, tables.reshape(-1)).view(num_decodes, ctx, num_kv_heads, head_dim)
        values = v_cache.index_select(0, tables.reshape(-1)).view(num_decodes, ctx, num_kv_heads, head_dim)
        # One query per sequence: its heads grouped by KV head, so that K and V are read as they
        # are (SDPA's masked math kernel would repeat them to every query head, in float32). Scores,
        # softmax and the weighted sum in float32, as the fused kernels accumulate.
        groups = q.shape[1] // num_kv_heads
        q_grouped = (
            q[:num_decodes].view(num_decodes, num_kv_heads, groups, head_dim).float()
        )  # [B, KVH, G, D]
        scores = torch.einsum("bkgd,bskd->bkgs", q_grouped, keys.float()) * scale  # [B, KVH, G, ctx]
        scores = scores.masked_fill(~meta.decode_mask.view(num_decodes, 1, 1, ctx), float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        attn = torch.einsum("bkgs,bskd->bkgd", probs, values.float())  # [B, KVH, G, D]
        out[:num_decodes] = attn.reshape(num_decodes, -1, head_dim).to(out.dtype)

    num_heads = q.shape[1]
    for chunk in meta.prefills:
        q_chunk = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, H, L, D]
        q_len = chunk.end - chunk.start
        if chunk.num_context == 0:
            keys = k[chunk.start : chunk.end]  # [L, KVH, D]
            values = v[chunk.start : chunk.end]
        else:
            total = chunk.num_context + q_len
            keys = k_cache.index_select(0, chunk.block_table).view(-1, num_kv_heads, head_dim)[:total]
            values = v_cache.index_select(0, chunk.block_table).view(-1, num_kv_heads, head_dim)[:total]
        keys_h = keys.transpose(0, 1).unsqueeze(0)  # [1, KVH, S, D]
        values_h = values.transpose(0, 1).unsqueeze(0)
        if chunk.mask is None and chunk.num_context > 0:
            # Causal aligned to the last key (query i sees keys up to num_context + i): a CausalBias,
            # which CUDA runs in the flash or memory-efficient kernel instead of a masked math one.
            # Those take no GQA here: the KV heads are repeated to the query heads first.
            groups = num_heads // num_kv_heads
            attn = F.scaled_dot_product_attention(
                q_chunk,
                keys_h.repeat_interleave(groups, dim=1),  # [1, H, S, D]
                values_h.repeat_interleave(groups, dim=1),
                attn_mask=causal_lower_right(q_len, keys.shape[0]),
                scale=scale,
            )  # [1, H, L, D]
        else:
            attn = F.scaled_dot_product_attention(
                q_chunk,
                keys_h,
                values_h,
                attn_mask=chunk.mask,
                is_causal=chunk.mask is None,
                scale=scale,
                enable_gqa=True,
            )  # [1, H, L, D]
        out[chunk.start : chunk.end] = attn[0].transpose(0, 1)
    return out
