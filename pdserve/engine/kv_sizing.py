"""How many KV blocks an engine gets: `num_kv_blocks` if given, else `kv_cache_memory_gib`, else
(on a CPU) 1 GiB, or (on a GPU) what is left of its share of the device's memory
(`gpu_memory_utilization`, vLLM's meaning: the share of the whole GPU this worker may use, weights
and activations included) once its weights are loaded and its largest step's activations are set
aside. Two pools on one GPU each take their own share.

The arithmetic is pure (`gpu_kv_blocks`, tested with made-up devices); `gpu_memory` reads a real
device. The activation peak is estimated from the model's shape and the step budget, not measured
by a profiling step: `ACTIVATION_MARGIN` covers what the estimate leaves out (the allocator's
fragmentation, cuBLAS workspaces)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pdserve.modelfiles.config import ModelConfig

CPU_DEFAULT_GIB = 1.0
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
ACTIVATION_MARGIN = 2.0  # the estimate below, doubled
CUDA_CONTEXT_BYTES = 512 << 20  # the CUDA context and kernels of a process, outside torch's allocator


class KVSizingError(ValueError):
    """No room for a KV cache under the settings given: says which setting to change."""


@dataclass(frozen=True)
class GpuMemory:
    total: int  # bytes of the device
    free: int  # bytes no process holds now
    this_process: int  # bytes this process holds through torch (its weights, by now)


def gpu_memory(device: torch.device) -> GpuMemory:
    free, total = torch.cuda.mem_get_info(device)
    return GpuMemory(total=total, free=free, this_process=torch.cuda.memory_reserved(device))


def activation_bytes(model: ModelConfig, step_tokens: int, max_seqs: int, dtype: torch.dtype) -> int:
    """A step's largest temporaries: one layer's widest tensors over `step_tokens` rows (the fused
    qkv, the attention output, gate and up, the activation), the residual stream, and fp32 logits of
    one row per sequence. Times ACTIVATION_MARGIN."""
    size = torch.empty((), dtype=dtype).element_size()
    qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    per_token = qkv + 2 * model.hidden_size + 3 * model.intermediate_size
    logits = max_seqs * model.vocab_size * 4
    return int(ACTIVATION_MARGIN * (step_tokens * per_token * size + logits))


def gpu_kv_blocks(memory: GpuMemory, utilization: float, activations: int, block_bytes: int) -> int:
    """Blocks that fit in `utilization` of the device, after what this process holds (weights),
    the CUDA context and `activations`; never more than is free on the device now."""
    if not 0 < utilization <= 1:
        raise KVSizingError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    budget = int(memory.total * utilization) - memory.this_process - CUDA_CONTEXT_BYTES - activations
    budget = min(budget, memory.free - activations)
    blocks = budget // block_bytes
    if blocks < 1:
        gib = 2**-30
        raise KVSizingError(
            f"no room for a KV cache: {utilization:.0%} of this GPU's {memory.total * gib:.1f} GiB, less "
            f"{memory.this_process * gib:.2f} GiB of weights, {activations * gib:.2f} GiB set aside for a "
            f"step's activations and {CUDA_CONTEXT_BYTES * gib:.1f} GiB for the CUDA context, leaves "
            f"{max(budget, 0) * gib:.2f} GiB ({memory.free * gib:.1f} GiB free on the device): raise "
            "--gpu-memory-utilization, lower --max-num-batched-tokens, or give --num-kv-blocks"
        )
    return int(blocks)


def kv_blocks(
    num_kv_blocks: int | None,
    kv_cache_memory_gib: float | None,
    gpu_memory_utilization: float | None,
    block_bytes: int,
    device: torch.device,
    activations: int,
) -> int:
    """The engine's KV blocks (see the module's comment for the order of the settings)."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    if kv_cache_memory_gib is not None or device.type != "cuda":
        return max(1, int((kv_cache_memory_gib or CPU_DEFAULT_GIB) * 2**30) // block_bytes)
    share = DEFAULT_GPU_MEMORY_UTILIZATION if gpu_memory_utilization is None else gpu_memory_utilization
    return gpu_kv_blocks(gpu_memory(device), share, activations, block_bytes)
