"""Build an engine from an `EngineConfig`: find the model, load weights and tokenizer (torch)."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from typing import Any

import torch

from pdserve.config import EngineConfig, Role
from pdserve.engine import kv_sizing
from pdserve.engine.core import EngineCore, engine_core
from pdserve.engine.runner import KVAllocator, ModelRunner
from pdserve.modelfiles.config import ModelConfig
from pdserve.models.llama import LlamaForCausalLM
from pdserve.models.loader import generation_eos_ids, iter_weights, load_config, load_tokenizer, resolve_model
from pdserve.ops.cpu import huge_pages
from pdserve.ops.cpu.kernels import decode_attention_kernel
from pdserve.ops.cpu.linear import onednn_available, stream_linear_available, stream_linear_f32_available
from pdserve.ops.cpu.ops import CpuKernelOps
from pdserve.ops.cpu.plan import cpu_plan

logger = logging.getLogger(__name__)
_OFF = ("0", "false", "no", "off")


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            "device 'cuda' asked for, but torch sees no CUDA GPU (is a CUDA build of torch installed?)"
        )
    return device


def cpu_has_native_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        from pdserve.ops.cpu.plan import cpu_plan  # measured once per machine, cached

        return torch.bfloat16 if cpu_plan().auto_dtype == "bfloat16" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def build_engine(
    config: EngineConfig,
    kv_allocator: KVAllocator | None = None,
    eos_token_ids: Sequence[int] | None = None,
) -> tuple[EngineCore[ModelRunner], Any]:
    """Returns the engine core and the model's tokenizer (with its chat template).

    `kv_allocator` places the KV cache (in shared memory for the `shm` transport). With
    `eos_token_ids` given (a worker: the router has the tokenizer) no tokenizer is loaded (None is
    returned for it): loading one with transformers takes seconds of every worker's start."""
    started = time.perf_counter()
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    source = resolve_model(config.model)
    model_config = load_config(source)
    device = pick_device(config.device)
    dtype = pick_dtype(config.dtype, device)
    max_positions = config.max_model_len or model_config.max_position_embeddings
    with torch.device(device):
        model = LlamaForCausalLM(model_config, max_positions)
    with torch.no_grad():
        model.load_weights(iter_weights(source))
    model.to(dtype)  # the RoPE tables are not parameters: they stay float32, as in HF
    model.eval()
    tokenizer = None
    if eos_token_ids is None:
        tokenizer = load_tokenizer(source)
        eos_ids = generation_eos_ids(source, model_config, tokenizer)
    else:
        eos_ids = tuple(eos_token_ids)
    if config.attention_backend == "triton":
        model.ops = triton_ops(device)
    if device.type == "cuda":
        logger.info("attention on %s: %s", device, model.ops.name)
    if device.type == "cpu":
        # Build (first time on this machine, ~20 s) or load the CPU kernels now, at start-up,
        # rather than stalling the first step of the first request.
        if decode_attention_kernel() is not None and dtype in (torch.float32, torch.bfloat16):
            model.ops = CpuKernelOps()
        plan, name = cpu_plan(), str(dtype).removeprefix("torch.")
        onednn = plan.prepack.get(name, False) and onednn_available()
        available = {"bfloat16": stream_linear_available, "float32": stream_linear_f32_available}
        stream_rows = plan.stream_rows.get(name, 0) if name in available and available[name]() else 0
        if stream_rows and os.environ.get("PDSERVE_STREAM_GEMV", "1").strip().lower() in _OFF:
            # The stream layout is a second copy of the weights (in fp32 it also rounds them to bf16):
            # an operator short of memory, or who wants the full fp32 weights, opts out.
            logger.info("stream GEMV disabled by PDSERVE_STREAM_GEMV")
            stream_rows = 0
        logits_rows = min(stream_rows, plan.logits_stream_rows.get(name, 0))
        if onednn or stream_rows:
            model.pack_for_cpu(onednn, stream_rows, logits_rows)
        logger.info("CPU plan: %s; layer ops: %s", plan.summary(dtype, stream_rows), model.ops.name)
    engine = _engine_core(config, model_config, model, eos_ids, device, dtype, kv_allocator)
    logger.info("loaded %s in %.1f s", config.model, time.perf_counter() - started)
    return engine, tokenizer


def _engine_core(
    config: EngineConfig,
    model_config: ModelConfig,
    model: LlamaForCausalLM,
    eos_ids: tuple[int, ...],
    device: torch.device,
    dtype: torch.dtype,
    kv_allocator: KVAllocator | None,
) -> EngineCore[ModelRunner]:
    """Sizes the KV cache (engine/kv_sizing.py), builds the runner around the model and the
    engine core around the runner, and on a GPU captures the decode steps' CUDA graphs."""
    block_bytes = ModelRunner.kv_bytes_per_block(model_config, config.block_size, dtype)
    step_tokens, _ = config.step_budget(device.type)
    activations = kv_sizing.activation_bytes(model_config, step_tokens, config.max_num_seqs, dtype)
    num_blocks = kv_sizing.kv_blocks(
        config.num_kv_blocks,
        config.kv_cache_memory_gib,
        config.gpu_memory_utilization,
        block_bytes,
        device,
        activations,
    )
    runner = ModelRunner(
        model, model_config, num_blocks, config.block_size, dtype, device, config.seed, kv_allocator
    )
    salt = f"{config.model}|{str(dtype).removeprefix('torch.')}"
    engine = engine_core(config, model_config, runner, eos_ids, num_blocks, device.type, cache_salt=salt)
    if device.type == "cuda" and model.ops.varlen and config.cuda_graphs:
        logger.info(
            "CUDA graphs off: the %s attention runs every step eagerly (not captured yet)", model.ops.name
        )
    elif device.type == "cuda" and config.cuda_graphs and config.role is not Role.PREFILL:
        # A prefill engine samples one token per prompt, in steps with its chunk: no decode steps.
        runner.use_static_decode(config.max_num_seqs, engine.max_model_len, capture=True)
    logger.info(
        "engine ready: %s on %s, %s, %d KV blocks of %d tokens (%.0f MiB%s), max_model_len %d, "
        "role %s, steps of up to %d tokens in chunks of %d%s",
        config.model,
        device,
        dtype,
        num_blocks,
        config.block_size,
        num_blocks * block_bytes / 2**20,
        _kv_pages_note(runner, device, kv_allocator is not None),
        engine.max_model_len,
        config.role.value,
        engine.max_num_batched_tokens,
        engine.chunk_size,
        _graphs_note(runner, config, device),
    )
    return engine


def _graphs_note(runner: ModelRunner, config: EngineConfig, device: torch.device) -> str:
    if device.type != "cuda" or config.role is Role.PREFILL:
        return ""
    if runner.decode_graphs is None:
        return ", CUDA graphs off"
    return f", {len(runner.decode_graphs.graphs)} CUDA graphs of decode steps"


def _kv_pages_note(runner: ModelRunner, device: torch.device, custom_allocator: bool) -> str:
    """What the startup line says of the cache's pages (cpu/huge_pages.py), on CPU."""
    if device.type != "cpu" or custom_allocator:
        return ""
    if runner.kv_huge_pages:
        huge = huge_pages.anon_huge_bytes(runner.kv_cache)
        if huge is None:
            return ", asked for 2 MiB pages"
        total = runner.kv_cache.numel() * runner.kv_cache.element_size()
        return f", {huge / 2**20:.0f} of {total / 2**20:.0f} MiB on 2 MiB pages"
    if not huge_pages.wanted():
        return ", 4 KiB pages: PDSERVE_KV_HUGE_PAGES=0"
    return f", 4 KiB pages: transparent_hugepage is {huge_pages.thp_setting()}"


def triton_ops(device: torch.device) -> Any:
    """The Triton attention's layer ops, or a clear error where it cannot run."""
    if device.type != "cuda":
        raise ValueError("attention_backend 'triton' runs on CUDA GPUs only (this engine runs on the CPU)")
    try:
        from pdserve.ops.cuda.triton_attention import TritonLayerOps
    except ImportError as exc:
        raise ValueError(f"attention_backend 'triton' needs the triton package ({exc})") from None
    return TritonLayerOps()
