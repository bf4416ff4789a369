"""The C++ CPU decode attention kernel against the portable torch path (the reference): ragged
lengths, block sizes, GQA ratios, head sizes, sliding windows, padded block tables, fp32 and bf16;
input validation; the fallback when the kernel is disabled or cannot be built; concurrent builds.

Skipped, with the reason, where the kernel cannot be built (no compiler, no ninja)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from pdserve.ops.attention import AttentionMetadata, paged_attention
from pdserve.ops.cpu import kernels as cpu_kernels

Op = Callable[..., torch.Tensor]


@pytest.fixture(scope="module")
def op() -> Op:
    kernel = cpu_kernels.decode_attention_kernel()
    if kernel is None:
        pytest.skip(f"the C++ CPU kernel is unavailable: {cpu_kernels.unavailable_reason()}")
    return kernel


def make_case(
    seq_lens: list[int],
    block_size: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    window: int | None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A random cache with each sequence's blocks scattered over it, a padded block table, the
    step's new q/k/v and the metadata the runner would build (mask and lengths)."""
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(needed) + 3  # a few blocks nobody uses
    max_blocks = max(needed) + 1  # one more column than anyone needs: every row is padded
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen).to(dtype)
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables, slots = [], []
    for n, count in zip(seq_lens, needed, strict=True):
        own, ids = ids[:count], ids[count:]
        # Padding points at real blocks (other sequences' data): only masking/lengths may hide it.
        tables.append(own + [ids[0]] * (max_blocks - count))
        slots.append(own[(n - 1) // block_size] * block_size + (n - 1) % block_size)
    num = len(seq_lens)
    q = torch.randn(num, heads, head_dim, generator=gen).to(dtype)
    k = torch.randn(num, kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num, kv_heads, head_dim, generator=gen).to(dtype)
    lengths = torch.tensor(seq_lens, dtype=torch.long)
    keys = torch.arange(max_blocks * block_size)[None, :]  # as the runner builds it
    mask = keys < lengths[:, None]
    if window is not None:
        mask &= keys >= lengths[:, None] - window
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        num_decode_tokens=num,
        decode_block_tables=torch.tensor(tables, dtype=torch.long),
        decode_mask=mask[:, None, None, :],
        decode_seq_lens=lengths,
        sliding_window=window,
    )
    return q, k, v, k_cache, v_cache, meta


def portable(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    meta: AttentionMetadata,
) -> torch.Tensor:
    """The reference: the portable gather + SDPA path."""
    return paged_attention(q, k, v, kc, vc, meta, q.shape[-1] ** -0.5)


def kernel_out(
    op: Op, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, meta: AttentionMetadata
) -> torch.Tensor:
    assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
    return op(
        q,
        kc,
        vc,
        meta.decode_block_tables,
        meta.decode_seq_lens,
        q.shape[-1] ** -0.5,
        meta.sliding_window or 0,
    )


def lengths_for(num_seqs: int, block_size: int) -> list[int]:
    # 1 token, exact block multiples, one past a multiple, lengths that are neither.
    pool = [1, block_size, 3 * block_size, 2 * block_size + 1, 50, 23, 7, 64, 33]
    return [pool[i % len(pool)] for i in range(num_seqs)]


@pytest.mark.parametrize("num_seqs", [1, 3, 9])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3), (8, 2)])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 6])
def test_fp32_kernel_matches_portable_path(
    op: Op, num_seqs: int, block_size: int, heads: int, kv_heads: int, head_dim: int, window: int | None
) -> None:
    lens = lengths_for(num_seqs, block_size)
    q, k, v, kc, vc, meta = make_case(lens, block_size, heads, kv_heads, head_dim, window)
    expected = portable(q, k, v, kc, vc, meta)  # also writes this step's k/v into the cache
    got = kernel_out(op, q, kc, vc, meta)
    assert got.dtype == torch.float32 and got.shape == q.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128)])
@pytest.mark.parametrize("window", [None, 20])
def test_bf16_kernel_matches_portable_path(
    op: Op, block_size: int, heads: int, kv_heads: int, head_dim: int, window: int | None
) -> None:
    lens = [*lengths_for(7, block_size), 300]
    q, k, v, kc, vc, meta = make_case(lens, block_size, heads, kv_heads, head_dim, window, torch.bfloat16)
    expected_bf16 = portable(q, k, v, kc, vc, meta)
    # The same inputs in fp32: what the kernel computes before rounding its output to bf16.
    exact = portable(q.float(), k.float(), v.float(), kc.float(), vc.float(), meta)
    got = kernel_out(op, q, kc, vc, meta)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), exact, atol=1e-2, rtol=1e-2)  # one bf16 rounding
    torch.testing.assert_close(got.float(), expected_bf16.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("head_dim", [8, 40, 80, 96, 256, 36, 100])
def test_other_head_sizes(op: Op, head_dim: int) -> None:
    # Multiples of 8 exercise every column split of the AVX2 path; 36 and 100 take the generic one.
    q, k, v, kc, vc, meta = make_case([1, 16, 45, 130], 4, 8, 2, head_dim, None, seed=head_dim)
    expected = portable(q, k, v, kc, vc, meta)
    torch.testing.assert_close(kernel_out(op, q, kc, vc, meta), expected, atol=1e-5, rtol=1e-5)


def test_fp32_query_over_a_bf16_cache(op: Op) -> None:
    q, k, v, kc, vc, meta = make_case([3, 77], 16, 9, 3, 64, None, torch.bfloat16)
    portable(q, k, v, kc, vc, meta)  # stores this step's k/v into the bf16 cache
    expected = portable(q.float(), k.float(), v.float(), kc.float(), vc.float(), meta)
    got = kernel_out(op, q.float(), kc, vc, meta)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 16])
def test_work_split_by_sequence_or_by_kv_head(op: Op, threads: int) -> None:
    # Few sequences per thread: one KV head per work item; many: all KV heads of a sequence.
    q, k, v, kc, vc, meta = make_case(lengths_for(6, 4), 4, 12, 4, 64, 9)
    expected = portable(q, k, v, kc, vc, meta)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = kernel_out(op, q, kc, vc, meta)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_long_context_and_q_as_a_strided_view(op: Op) -> None:
    # Many tiles with a running max that moves; q a view of a fused qkv row, as the model passes it.
    q, k, v, kc, vc, meta = make_case([1000, 517, 1, 64], 16, 9, 3, 64, None, seed=3)
    kc[:, 5] *= 8  # a few much larger scores later in the context force rescaling
    qkv = torch.cat([q.flatten(1), torch.zeros(4, 100)], dim=1)  # [B, H * D + 100]
    q_view = qkv[:, : 9 * 64].view(4, 9, 64)
    assert not q_view.is_contiguous()
    expected = portable(q, k, v, kc, vc, meta)
    torch.testing.assert_close(kernel_out(op, q_view, kc, vc, meta), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"q": lambda t: t.to(torch.float16)}, "q must be float32 or bfloat16"),
        ({"kc": lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)}, "contiguous"),
        ({"vc": lambda t: t.to(torch.bfloat16)}, "dtypes differ"),
        ({"tables": lambda t: t.to(torch.int32)}, "int64"),
        ({"tables": lambda t: t + 1000}, "is outside"),
        ({"lens": lambda t: t * 0}, "seq_lens"),
        ({"lens": lambda t: t + 1000}, "seq_lens"),
        ({"q": lambda t: t[:, :5]}, "multiple of KV heads"),
        ({"q": lambda t: t[:2]}, "one row per sequence"),
    ],
)
def test_bad_inputs_are_rejected(
    op: Op, change: dict[str, Callable[[torch.Tensor], torch.Tensor]], message: str
) -> None:
    q, _, _, kc, vc, meta = make_case([5, 9, 3], 4, 9, 3, 64, None)
    assert meta.decode_block_tables is not None and meta.decode_seq_lens is not None
    args = {"q": q, "kc": kc, "vc": vc, "tables": meta.decode_block_tables, "lens": meta.decode_seq_lens}
    for name, fn in change.items():
        args[name] = fn(args[name])
    with pytest.raises(RuntimeError, match=message):
        op(args["q"], args["kc"], args["vc"], args["tables"], args["lens"], 0.125, 0)


@pytest.fixture
def fresh_kernel_cache() -> Iterator[None]:
    cpu_kernels.decode_attention_kernel.cache_clear()
    yield
    cpu_kernels.decode_attention_kernel.cache_clear()  # later tests see the real kernel again


def test_disabled_by_environment(fresh_kernel_cache: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDSERVE_CPU_KERNELS", "0")
    assert cpu_kernels.decode_attention_kernel() is None
    assert cpu_kernels.unavailable_reason() == "disabled by PDSERVE_CPU_KERNELS"


def test_build_failure_warns_once_and_falls_back(
    fresh_kernel_cache: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> None:
        raise RuntimeError("Error building extension 'x'\nfoo.cpp:1: error: no compiler here")

    monkeypatch.delenv("PDSERVE_CPU_KERNELS", raising=False)
    monkeypatch.setattr(cpu_kernels, "_load_library", broken)
    with caplog.at_level(logging.WARNING, logger="pdserve.ops.cpu.kernels"):
        assert cpu_kernels.decode_attention_kernel() is None
        assert cpu_kernels.decode_attention_kernel() is None
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no compiler here" in warnings[0].getMessage()
    # The portable path still answers.
    q, k, v, kc, vc, meta = make_case([3, 8], 4, 4, 2, 64, None)
    out = paged_attention(q, k, v, kc, vc, meta, 0.125)
    torch.testing.assert_close(out, portable(q, k, v, kc, vc, meta))


@pytest.mark.slow
def test_two_processes_building_at_once_both_get_the_kernel(op: Op, tmp_path: Path) -> None:
    # A fresh cache folder: both processes race to build; one compiles, the other waits and loads.
    script = textwrap.dedent(
        """
        from pdserve.ops.cpu.kernels import decode_attention_kernel, unavailable_reason
        assert decode_attention_kernel() is not None, unavailable_reason()
        """
    )
    env = {**os.environ, "PDSERVE_CACHE_DIR": str(tmp_path), "PDSERVE_CPU_KERNELS": "1"}
    procs = [
        subprocess.Popen([sys.executable, "-c", script], env=env, stderr=subprocess.PIPE) for _ in range(2)
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err.decode()
    (build_dir,) = (tmp_path / "torch_extensions").iterdir()
    assert (build_dir / "ready").exists() and not (build_dir / "lock").exists()


def test_a_second_cache_folder_in_one_process_keeps_the_loaded_library(
    op: Op, fresh_kernel_cache: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Loaded once (the `op` fixture); then asked again under an empty cache folder. Building and
    # loading a second copy would register torch.ops.pdserve again and abort the process (a test
    # suite on an AVX2 machine died so): the library already loaded is kept, nothing is built.
    monkeypatch.delenv("PDSERVE_CPU_KERNELS", raising=False)
    monkeypatch.setenv("PDSERVE_CACHE_DIR", str(tmp_path))
    again = cpu_kernels.decode_attention_kernel()
    assert again is not None and cpu_kernels.unavailable_reason() is None
    assert not any(tmp_path.iterdir())  # no second build
