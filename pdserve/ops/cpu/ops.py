"""The C++ layer ops (ops/cpu/kernels.py builds them): the same work as the portable
`TorchLayerOps`, one pass each instead of several torch ops and their dispatch: `add_rms_norm` (the
residual add fused into the next norm), `rotary_and_cache` (RoPE on q and k, k and v written to
their cache slots), `silu_and_mul`, `argmax_rows` (greedy sampling), and `paged_attention` for
decodes and prompt chunks alike, reading K and V in place from their blocks."""

from __future__ import annotations

import torch

from pdserve.ops.attention import AttentionMetadata
from pdserve.ops.layer_ops import RMSNorm, RotaryEmbedding, TorchLayerOps


class CpuKernelOps(TorchLayerOps):
    """The C++ ops; the caller checked the library loaded and the dtype is float32 or bfloat16."""

    name = "cpu-kernels"
    varlen = True  # the runner builds the kernel's metadata (lengths, starts, one table per sequence)

    def __init__(self, decode_kernel_for_fp32: bool = True) -> None:
        # The older decode-only kernel is faster on fp32 caches (its AVX2 loops need no transpose);
        # the step's decodes go to it then, its prompt chunks to paged_attention.
        self.decode_kernel_for_fp32 = decode_kernel_for_fp32

    def norm(self, x: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
        out: torch.Tensor = torch.ops.pdserve.rms_norm(x, norm.weight, norm.eps)
        return out

    def add_norm(
        self, x: torch.Tensor, residual: torch.Tensor, norm: RMSNorm
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out: torch.Tensor = torch.ops.pdserve.add_rms_norm(x, residual, norm.weight, norm.eps)
        return out, residual  # residual += x in place

    def attention(
        self,
        qkv: torch.Tensor,
        positions: torch.Tensor,
        rope: RotaryEmbedding,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        num_heads: int,
        num_kv_heads: int,
        scale: float,
    ) -> torch.Tensor:
        tokens, head_dim = qkv.shape[0], k_cache.shape[-1]
        torch.ops.pdserve.rotary_and_cache(
            qkv, positions, rope.cos, rope.sin, k_cache, v_cache, meta.slot_mapping, num_heads, num_kv_heads
        )
        q = qkv[:, : num_heads * head_dim].view(tokens, num_heads, head_dim)  # rotated in place
        assert (
            meta.seq_lens is not None and meta.query_start_loc is not None and meta.block_tables is not None
        )
        window = meta.sliding_window or 0
        decodes = meta.num_decode_tokens
        if decodes and self.decode_kernel_for_fp32 and k_cache.dtype == torch.float32:
            out = torch.empty(tokens, num_heads, head_dim, dtype=q.dtype)
            out[:decodes] = torch.ops.pdserve.paged_decode_attention(
                q[:decodes],
                k_cache,
                v_cache,
                meta.block_tables[:decodes],
                meta.seq_lens[:decodes],
                scale,
                window,
            )
            if decodes < tokens:
                out[decodes:] = torch.ops.pdserve.paged_attention(
                    q[decodes:],
                    k_cache,
                    v_cache,
                    meta.block_tables[decodes:],
                    meta.seq_lens[decodes:],
                    meta.query_start_loc[decodes:] - decodes,
                    scale,
                    window,
                )
            return out.view(tokens, num_heads * head_dim)
        attn: torch.Tensor = torch.ops.pdserve.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, scale, window
        )
        return attn.view(tokens, num_heads * head_dim)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.pdserve.silu_and_mul(gate_up)
        return out

    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = torch.ops.pdserve.argmax_rows(logits)
        return out
