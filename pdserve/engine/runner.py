"""The model runner (torch): one scheduler step in, sampled tokens out.

It owns the KV cache, preallocated once as a single tensor
[num_layers, 2 (K/V), num_blocks, block_size, num_kv_heads, head_dim], so that a block is one
index on axis 2 whatever the layer (what a KV transfer moves), and builds the step's flat batch:
decode tokens first, then prompt chunks, with their positions and cache slots.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable

import torch

from pdserve.engine.core import RunnerOutput
from pdserve.engine.decode_graphs import DecodeGraphs, StaticDecode
from pdserve.engine.kv import KVCacheManager
from pdserve.engine.request import Request
from pdserve.engine.sampler import SamplingRow, sample
from pdserve.engine.sched_types import SchedulerOutput
from pdserve.modelfiles.config import ModelConfig
from pdserve.models.llama import LlamaForCausalLM
from pdserve.ops.attention import AttentionMetadata, PrefillChunkMeta
from pdserve.ops.cpu import huge_pages

# (shape, dtype) -> a zeroed tensor of that shape: where the KV cache lives.
KVAllocator = Callable[[tuple[int, ...], torch.dtype], torch.Tensor]


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int = 0,
        kv_allocator: KVAllocator | None = None,
    ) -> None:
        self.model = model
        self.config = config
        self.block_size = block_size
        self.device = device
        self.dtype = dtype
        shape = (config.num_layers, 2, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # Whether the cache asked for 2 MiB pages and the kernel's setting grants them (huge_pages.py).
        self.kv_huge_pages = False
        if kv_allocator is not None:  # e.g. in shared memory, for the `shm` KV transport; zeroed
            self.kv_cache = kv_allocator(shape, dtype)
            if self.kv_cache.device != device:
                raise ValueError(
                    f"the KV cache was placed on {self.kv_cache.device} but the model runs on {device} "
                    "(the shm transport keeps it in host shared memory: a GPU worker needs tcp or nixl)"
                )
        elif device.type == "cpu" and huge_pages.wanted():
            self.kv_cache, self.kv_huge_pages = huge_pages.zeros_on_huge_pages(shape, dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=dtype, device=device)
        self._generators: dict[str, torch.Generator] = {}
        self._seed_source = random.Random(seed)  # seeds for requests that did not ask for one
        # Decode-only steps on fixed-shape buffers, and their CUDA graphs (use_static_decode).
        self.static_decode: StaticDecode | None = None
        self.decode_graphs: DecodeGraphs | None = None

    def use_static_decode(self, max_batch: int, max_model_len: int, capture: bool) -> None:
        """Run decode-only steps padded to fixed shapes (decode_graphs.py); with `capture` (CUDA),
        replay them from CUDA graphs, all captured now. Before any request: the capture's warm-up
        writes into the first block's first slot."""
        if self.model.ops.varlen:
            raise ValueError(
                f"fixed-shape decode steps need the portable layer ops, not {self.model.ops.name}"
            )
        max_blocks = -(-max_model_len // self.block_size)
        self.static_decode = StaticDecode(
            self.model, self.kv_cache, max_batch, max_blocks, self.config.sliding_window
        )
        if capture:
            graphs = DecodeGraphs(self.static_decode)
            try:
                graphs.capture_all()
            except RuntimeError as exc:  # said, not worked around: eager steps are the user's choice
                raise RuntimeError(
                    f"capturing CUDA graphs of decode steps failed ({exc}); start the engine with "
                    "cuda_graphs=False (pdserve serve --no-cuda-graphs) to run every step eagerly"
                ) from exc
            self.decode_graphs = graphs

    @staticmethod
    def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return config.num_layers * 2 * block_size * config.num_kv_heads * config.head_dim * element

    def release(self, request_id: str) -> None:
        """Forget per-request state (the sampling generator) of a finished request."""
        self._generators.pop(request_id, None)

    def generator_state(self, request_id: str) -> bytes | None:
        """The request's sampling generator state (None if it has none: greedy, or not sampled
        here yet), for the engine that continues the request to restore."""
        generator = self._generators.get(request_id)
        if generator is None:
            return None
        return bytes(generator.get_state().numpy().tobytes())

    # -- KV blocks in and out (for moving a request's KV between engines) ---------------------------
    def read_blocks(self, block_ids: list[int]) -> torch.Tensor:
        """[num_layers, 2, len(block_ids), block_size, KVH, D] copy of the given blocks."""
        return self.kv_cache[:, :, torch.tensor(block_ids, device=self.device)]

    def write_blocks(self, block_ids: list[int], data: torch.Tensor) -> None:
        self.kv_cache[:, :, torch.tensor(block_ids, device=self.device)] = data.to(self.kv_cache.device)

    # -- the step ------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(
        self,
        out: SchedulerOutput,
        kv: KVCacheManager,
        between_layers: Callable[[int], None] | None = None,
    ) -> RunnerOutput:
        """Run one step. `between_layers(n)`: called after each layer but the last (see
        `LlamaForCausalLM.forward`); it may call `execute` for another step."""
        if self.static_decode is not None and between_layers is None:
            static = self._execute_static(out, kv, self.static_decode)
            if static is not None:
                return static
        input_ids, positions, _, meta, sample_index, rows, sampled_ids = self._prepare(out, kv)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, between_layers)  # [T, hidden]
        if not rows:
            return RunnerOutput()
        logits = self.model.compute_logits(hidden[sample_index])  # [S, vocab] in the model dtype
        return self._sample(logits, rows, sampled_ids)

    def _execute_static(
        self, out: SchedulerOutput, kv: KVCacheManager, static: StaticDecode
    ) -> RunnerOutput | None:
        """A decode-only step within the largest bucket, on the fixed-shape path (a CUDA graph's
        replay where captured); None for any other step (the caller runs it the ordinary way)."""
        chunks = out.chunks
        if not chunks or not all(chunk.is_decode for chunk in chunks):
            return None
        block_size = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []
        for chunk in chunks:
            position = chunk.start
            table = kv.block_table(chunk.request.request_id)
            token_ids.extend(chunk.request.token_ids_slice(position, position + 1))
            positions.append(position)
            slots.append(table[position // block_size] * block_size + position % block_size)
            tables.append(table[: position // block_size + 1])
        bucket = static.bucket(len(chunks), max(len(t) for t in tables))
        if bucket is None:
            return None
        spare = kv.spare_block()
        pad_slot = None if spare is None else spare * block_size
        static.load(bucket, token_ids, positions, slots, tables, [p + 1 for p in positions], pad_slot)
        graphs = self.decode_graphs
        logits = graphs.replay(bucket) if graphs is not None else static.forward(bucket)  # [bucket B, V]
        static.steps += 1
        sampled = [i for i, chunk in enumerate(chunks) if chunk.sample]
        if not sampled:
            return RunnerOutput()
        if len(sampled) == len(chunks):
            logits = logits[: len(chunks)]
        else:
            logits = logits[torch.tensor(sampled, device=self.device)]
        rows = [self._sampling_row(chunks[i].request.request_id, chunks[i].request) for i in sampled]
        return self._sample(logits, rows, [chunks[i].request.request_id for i in sampled])

    def _sample(self, logits: torch.Tensor, rows: list[SamplingRow], sampled_ids: list[str]) -> RunnerOutput:
        result = RunnerOutput()
        tokens, logprobs = sample(logits, rows, self.model.ops.argmax_rows)
        for request_id, token, logprob in zip(sampled_ids, tokens, logprobs, strict=True):
            result.sampled[request_id] = token
            if logprob is not None:
                result.logprobs[request_id] = logprob
        return result

    def _prepare(
        self, out: SchedulerOutput, kv: KVCacheManager
    ) -> tuple[
        torch.Tensor,
        torch.Tensor,
        torch.Tensor,
        AttentionMetadata,
        torch.Tensor,
        list[SamplingRow],
        list[str],
    ]:
        block_size = self.block_size
        window = self.config.sliding_window
        device = self.device
        varlen = self.model.ops.varlen  # the kernels' metadata, not the portable path's masks
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        tables: list[list[int]] = []  # per sequence (decodes first): its blocks up to this step's end
        seq_lens: list[int] = []
        starts: list[int] = [0]
        prefills: list[PrefillChunkMeta] = []
        sample_index: list[int] = []
        rows: list[SamplingRow] = []
        sampled_ids: list[str] = []
        num_decodes = 0

        row = 0
        for chunk in out.chunks:
            request = chunk.request
            table = kv.block_table(request.request_id)
            end = chunk.start + chunk.num_tokens
            token_ids.extend(request.token_ids_slice(chunk.start, end))
            used_blocks = table[: -(-end // block_size)]
            chunk_positions = range(chunk.start, end)
            positions.extend(chunk_positions)
            slots.extend(table[pos // block_size] * block_size + pos % block_size for pos in chunk_positions)
            tables.append(used_blocks)
            seq_lens.append(end)
            starts.append(row + chunk.num_tokens)
            if chunk.is_decode:
                num_decodes += 1
            elif not varlen:
                prefills.append(self._chunk_meta(row, chunk.start, end, used_blocks))
            row += chunk.num_tokens
            if chunk.sample:
                sample_index.append(row - 1)
                rows.append(self._sampling_row(request.request_id, request))
                sampled_ids.append(request.request_id)

        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
        meta = AttentionMetadata(
            slot_mapping=slot_mapping, num_decode_tokens=num_decodes, prefills=prefills, sliding_window=window
        )
        if tables:
            max_blocks = max(len(t) for t in tables)
            padded = torch.tensor([t + [0] * (max_blocks - len(t)) for t in tables], dtype=torch.long)
            lengths = torch.tensor(seq_lens, dtype=torch.long)
            if varlen:
                meta.block_tables = padded.to(device)  # [S, MB]
                meta.seq_lens = lengths.to(device)  # [S]
                meta.query_start_loc = torch.tensor(starts, dtype=torch.long, device=device)  # [S + 1]
                meta.max_query_len = max(b - a for a, b in itertools.pairwise(starts))
            elif num_decodes:
                mb = max(len(t) for t in tables[:num_decodes])
                meta.decode_block_tables = padded[:num_decodes, :mb].contiguous().to(device)  # [B, MB]
                decode_lens = lengths[:num_decodes, None]  # [B, 1]
                meta.decode_seq_lens = decode_lens[:, 0].to(device)  # [B]
                keys = torch.arange(mb * block_size)[None, :]  # [1, ctx]
                mask = keys < decode_lens
                if window is not None:
                    mask &= keys >= decode_lens - window
                meta.decode_mask = mask[:, None, None, :].to(device)  # [B, 1, 1, ctx]
        return (
            torch.tensor(token_ids, dtype=torch.long, device=device),
            torch.tensor(positions, dtype=torch.long, device=device),
            slot_mapping,
            meta,
            torch.tensor(sample_index, dtype=torch.long, device=device),
            rows,
            sampled_ids,
        )

    def _chunk_meta(self, row: int, start: int, end: int, used_blocks: list[int]) -> PrefillChunkMeta:
        """A prompt chunk for the portable path: its blocks, and its mask when the window cuts it
        (else causal attention over its context and itself, without a mask: attention.py)."""
        window = self.config.sliding_window
        mask = None
        if window is not None and end > window:
            pos = torch.arange(start, end)
            keys = torch.arange(end)  # [S]
            mask = keys[None, :] <= pos[:, None]  # [L, S] causal with an offset
            mask &= keys[None, :] > pos[:, None] - window
            mask = mask.to(self.device)
        table = torch.tensor(used_blocks, dtype=torch.long, device=self.device)
        return PrefillChunkMeta(row, row + end - start, start, table, mask)

    def _sampling_row(self, request_id: str, request: Request) -> SamplingRow:
        params = request.sampling_params
        generator = None
        if not params.greedy:
            generator = self._generators.get(request_id)
            if generator is None:
                seed = params.seed if params.seed is not None else self._seed_source.getrandbits(63)
                generator = torch.Generator(device=self.device).manual_seed(seed)
                if request.sampler_state is not None:  # it moved here: go on where it stopped
                    state = torch.frombuffer(bytearray(request.sampler_state), dtype=torch.uint8)
                    generator.set_state(state)
                    request.sampler_state = None
                self._generators[request_id] = generator
        return SamplingRow(
            params, generator, request.prompt_token_ids, request.output_token_ids, request.eos_token_ids
        )
