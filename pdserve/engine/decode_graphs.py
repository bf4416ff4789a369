"""Decode steps with fixed shapes, replayed from CUDA graphs on a GPU (torch).

A decode step of a 135M-parameter model is ~450 small kernels (30 layers of norms, projections,
RoPE, attention, the MLP) that an H200 runs in well under a millisecond; launched one by one from
Python the step takes tens of milliseconds. A CUDA graph records the kernels of a step once and
replays them with one launch. A graph has fixed shapes, so a decode-only step is padded to a
bucket: its batch up to the next of `batch_buckets`, its context up to the next power of two of
blocks (`context_buckets`). Each (batch, blocks) bucket within MAX_GATHERED_TOKENS is captured
once, at start-up, into one shared memory pool.

The step itself (`StaticDecode.forward`) is plain torch and runs on any device: on CPU it runs
eagerly (what the CPU tests check: padded rows, buckets and the in-step mask give the same tokens
as the ordinary path); on CUDA the same function is what is captured. Padding rows repeat the
batch's first row (its token, position, cache slot, table and length): they compute and write the
same K/V to the same slot as that row, so the cache is unchanged by them, and their logits are
dropped.

Steps with a prompt chunk, or that no bucket holds (more rows or context than any bucket within
MAX_GATHERED_TOKENS) run on the ordinary path (runner.py), as do steps that run other steps
between their layers (a graph cannot call back into Python).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from pdserve.models.llama import LlamaForCausalLM
from pdserve.ops.attention import AttentionMetadata

logger = logging.getLogger(__name__)

MIN_CONTEXT_BLOCKS = 8  # the smallest context bucket, in blocks (512 tokens with 64-token blocks)
# A bucket's step gathers batch x context tokens of K and V per layer and attends over them in
# float32 (attention.py): buckets whose attention would hold more than this are not made (SmolLM2:
# ~459k tokens, Llama 3.2 1B: ~171k). Such steps run the ordinary way, which gathers only what they have.
MAX_GATHERED_BYTES = 2**31


def gathered_bytes(batch: int, tokens: int, num_heads: int, num_kv_heads: int, head_dim: int) -> int:
    """What a decode step's attention holds for `tokens` of context per sequence, at most: K and V
    gathered, widened to float32 and laid out for the products (24 bytes a value), and the scores
    and probabilities (8 bytes a query head)."""
    return batch * tokens * (24 * num_kv_heads * head_dim + 8 * num_heads)


def batch_buckets(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8, up to and including max_batch (as vLLM's GPU runner)."""
    buckets = [b for b in (1, 2, 4) if b < max_batch]
    buckets += list(range(8, max_batch, 8))
    return sorted({*buckets, max_batch})


def context_buckets(max_blocks: int) -> list[int]:
    """Powers of two of blocks from MIN_CONTEXT_BLOCKS, the last one max_blocks itself."""
    buckets: list[int] = []
    blocks = MIN_CONTEXT_BLOCKS
    while blocks < max_blocks:
        buckets.append(blocks)
        blocks *= 2
    return [*buckets, max_blocks]


def smallest_at_least(buckets: Sequence[int], n: int) -> int | None:
    return next((b for b in buckets if b >= n), None)


class StaticDecode:
    """A decode-only step over fixed input buffers, padded to (batch, blocks) buckets."""

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: torch.Tensor,  # [num_layers, 2, num_blocks, block_size, KVH, D]
        max_batch: int,
        max_blocks: int,  # blocks of the longest context a request may have (max_model_len)
        sliding_window: int | None,
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = kv_cache.shape[3]
        config = model.config
        self.sliding_window = sliding_window
        self.batches = batch_buckets(max_batch)
        self.contexts = context_buckets(max_blocks)
        # (batch, blocks), largest first: those within MAX_GATHERED_BYTES
        self.buckets = [
            (b, c)
            for b in reversed(self.batches)
            for c in reversed(self.contexts)
            if gathered_bytes(b, c * self.block_size, config.num_heads, config.num_kv_heads, config.head_dim)
            <= MAX_GATHERED_BYTES
        ]
        self._bucket_set = set(self.buckets)
        device = kv_cache.device
        # Block tables on the host, pinned on a GPU (an asynchronous copy), written row by row up to
        # each table's length: what lies past it is masked (stale ids of real blocks, or zeros).
        self.host_tables = torch.zeros(
            max_batch, max_blocks, dtype=torch.long, pin_memory=device.type == "cuda"
        )
        # The step's inputs, written before each run (at most the largest bucket of each).
        self.input_ids = torch.zeros(max_batch, dtype=torch.long, device=device)  # [Bmax]
        self.positions = torch.zeros(max_batch, dtype=torch.long, device=device)  # [Bmax]
        self.slots = torch.zeros(max_batch, dtype=torch.long, device=device)  # [Bmax]
        self.seq_lens = torch.ones(max_batch, dtype=torch.long, device=device)  # [Bmax]
        self.tables = torch.zeros(max_batch, max_blocks, dtype=torch.long, device=device)  # [Bmax, MB]
        # [MB * block_size]: each context position's index, for the mask built inside the step
        self.key_index = torch.arange(max_blocks * self.block_size, device=device)
        self.steps = 0  # decode steps run on this path (the runner counts them)

    def bucket(self, batch: int, blocks: int) -> tuple[int, int] | None:
        """The smallest (batch, blocks) bucket that holds a step, or None if none does."""
        b = smallest_at_least(self.batches, batch)
        c = smallest_at_least(self.contexts, blocks)
        if b is None or c is None or (b, c) not in self._bucket_set:
            return None
        return b, c

    def load(
        self,
        bucket: tuple[int, int],
        token_ids: Sequence[int],
        positions: Sequence[int],
        slots: Sequence[int],
        tables: Sequence[Sequence[int]],
        seq_lens: Sequence[int],
        pad_slot: int | None,
    ) -> None:
        """Write one step's inputs (one entry per decode) into the buffers, padded to `bucket`.
        Padding rows repeat the first row but write their K/V to `pad_slot` (a slot of a free block);
        without one (a full cache) to the first row's own slot, which then gets one of two
        computations of the same K/V (equal unless the GEMM rounds rows differently)."""
        batch, blocks = bucket
        real, pad = len(token_ids), batch - len(token_ids)
        rows = [list(token_ids) + [token_ids[0]] * pad]
        rows.append(list(positions) + [positions[0]] * pad)
        rows.append(list(slots) + [slots[0] if pad_slot is None else pad_slot] * pad)
        rows.append(list(seq_lens) + [seq_lens[0]] * pad)
        host = torch.tensor(rows, dtype=torch.long)  # [4, batch]
        staged = host.to(self.input_ids.device, non_blocking=True)  # [4, batch]
        self.input_ids[:batch].copy_(staged[0])
        self.positions[:batch].copy_(staged[1])
        self.slots[:batch].copy_(staged[2])
        self.seq_lens[:batch].copy_(staged[3])
        host_tables = self.host_tables
        for i, table in enumerate(tables):
            host_tables[i, : len(table)] = torch.tensor(table, dtype=torch.long)
        host_tables[real:batch] = host_tables[0]
        # [batch, blocks]; on a GPU it waits for nothing, and the next load comes after this step's
        # sampling has synchronized, so the pinned rows are not rewritten while they are copied.
        self.tables[:batch, :blocks].copy_(host_tables[:batch, :blocks], non_blocking=True)

    def forward(self, bucket: tuple[int, int]) -> torch.Tensor:  # [batch, vocab] in the model dtype
        """The step on the buffers: what a CUDA graph captures (fixed shapes, no host reads)."""
        batch, blocks = bucket
        lens = self.seq_lens[:batch]  # [B]
        keys = self.key_index[: blocks * self.block_size]  # [ctx]
        mask = keys[None, :] < lens[:, None]  # [B, ctx]
        if self.sliding_window is not None:
            mask &= keys[None, :] >= lens[:, None] - self.sliding_window
        meta = AttentionMetadata(
            slot_mapping=self.slots[:batch],
            num_decode_tokens=batch,
            decode_block_tables=self.tables[:batch, :blocks],
            decode_mask=mask[:, None, None, :],  # [B, 1, 1, ctx]
            decode_seq_lens=lens,
            sliding_window=self.sliding_window,
        )
        hidden = self.model(self.input_ids[:batch], self.positions[:batch], self.kv_cache, meta)
        logits: torch.Tensor = self.model.compute_logits(hidden)
        return logits


class DecodeGraphs:
    """One CUDA graph per (batch, blocks) bucket of a StaticDecode, captured at start-up."""

    def __init__(self, step: StaticDecode) -> None:
        self.step = step
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    @torch.inference_mode()
    def capture_all(self) -> float:
        """Capture every bucket, largest first (its memory then serves the smaller ones from the
        shared pool: one graph runs at a time). The capture's warm-up runs write K/V to the slot of the buffers' rows (slot 0
        of block 0): harmless at start-up, as a block's slot is always written before it is read.
        Returns the seconds taken."""
        started = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()  # type: ignore[no-untyped-call]  # the warm-ups, off the capture
        step = self.step
        step.seq_lens.fill_(1)
        step.slots.zero_()
        step.tables.zero_()
        for bucket in step.buckets:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # cuBLAS picks its kernels and workspace here
                step.forward(bucket)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = step.forward(bucket)
            self.graphs[bucket] = (graph, logits)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        logger.info(
            "captured %d CUDA graphs of decode steps (batches %s, context blocks %s) in %.1f s",
            len(self.graphs),
            step.batches,
            step.contexts,
            seconds,
        )
        return seconds

    def replay(self, bucket: tuple[int, int]) -> torch.Tensor:
        """[batch, vocab] logits, valid until the next replay of any graph: the graphs share one
        memory pool, and another graph's intermediates may lie where these logits are."""
        graph, logits = self.graphs[bucket]
        graph.replay()
        return logits
