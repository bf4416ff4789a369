"""The Triton kernels themselves (see triton_attention.py for what they compute and how they are
called). Apart so that the typed wrappers are type-checked while the kernels, whose parameters
Triton types itself, are not (pyproject's mypy overrides)."""

import triton
import triton.language as tl


@triton.jit
def paged_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    seq_lens_ptr,
    starts_ptr,
    q_stride_t,
    q_stride_h,
    max_blocks,
    scale,
    window,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_BLOCK: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    first_q = tl.program_id(2) * BLOCK_Q
    q_start = tl.load(starts_ptr + seq)
    q_len = tl.load(starts_ptr + seq + 1) - q_start
    if first_q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        rows = tl.arange(0, BLOCK_M)
        query = first_q + rows // GROUP
        head = kv_head * GROUP + rows % GROUP
        row_ok = (rows < BLOCK_Q * GROUP) & (query < q_len)
        pos = seq_len - q_len + query  # [M] each row's position: it sees keys (pos - window, pos]
        d = tl.arange(0, BLOCK_D)
        d_ok = d < HEAD_DIM
        q_rows = (q_start + query)[:, None] * q_stride_t + head[:, None] * q_stride_h + d[None, :]
        q = tl.load(q_ptr + q_rows, mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [M, D]

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        first_pos = seq_len - q_len + first_q
        last_pos = seq_len - q_len + tl.minimum(first_q + BLOCK_Q, q_len) - 1
        # The first key any row needs (a window's start), down to a tile edge. Branch-free: a
        # variable given different types in two branches does not compile.
        lo = tl.where(window > 0, tl.maximum(first_pos - window + 1, 0), 0)
        lo = (lo // BLOCK_N) * BLOCK_N
        for key0 in range(lo, last_pos + 1, BLOCK_N):
            keys = key0 + tl.arange(0, BLOCK_N)
            key_ok = keys <= last_pos
            block = tl.load(tables_ptr + seq * max_blocks + keys // KV_BLOCK, mask=key_ok, other=0)
            slot = block * KV_BLOCK + keys % KV_BLOCK  # [N] cache slot of each key
            kv = slot[:, None] * (NUM_KV_HEADS * HEAD_DIM) + kv_head * HEAD_DIM + d[None, :]
            kv_ok = key_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kv, mask=kv_ok, other=0.0)  # [N, D]
            if FP32:  # noqa: SIM108 (a compile-time branch)  exact fp32 products, not TF32's
                scores = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                scores = tl.dot(q, tl.trans(k))
            scores = scores * scale  # [M, N] fp32
            allowed = (keys[None, :] <= pos[:, None]) & key_ok[None, :]
            allowed = allowed & ((window <= 0) | (keys[None, :] > pos[:, None] - window))
            scores = tl.where(allowed, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: no NaN
            alpha = tl.exp(m - m_safe)
            p = tl.exp(scores - m_safe[:, None])
            l_sum = l_sum * alpha + tl.sum(p, 1)
            v = tl.load(v_ptr + kv, mask=kv_ok, other=0.0)  # [N, D]
            if FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        l_safe = tl.where(row_ok, l_sum, 1.0)  # padding rows: never written
        out = acc / l_safe[:, None]
        out_rows = (
            (q_start + query)[:, None] * (NUM_KV_HEADS * GROUP * HEAD_DIM)
            + head[:, None] * HEAD_DIM
            + d[None, :]
        )
        tl.store(out_ptr + out_rows, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
