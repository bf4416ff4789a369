"""How many KV blocks an engine gets (pdserve.engine.kv_sizing): the settings in their order, and a
GPU's share worked out on made-up devices - weights, activations, the CUDA context and memory held
by other processes (another pool on the same GPU) all taken off, a clear error where nothing is left."""

from __future__ import annotations

import pytest
import torch

from pdserve.config import EngineConfig
from pdserve.engine import kv_sizing
from pdserve.engine.kv_sizing import GpuMemory, KVSizingError
from pdserve.modelfiles.config import ModelConfig

GIB = 2**30
CPU = torch.device("cpu")
BLOCK = 64 * 2 * 30 * 3 * 64 * 2  # SmolLM2's 64-token block in bf16: K and V, 30 layers, 3 KV heads
SMOLLM2 = ModelConfig(
    model_type="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
    num_heads=9, num_kv_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5,
    rope_theta=100000.0, rope_scaling=None, tie_word_embeddings=True, attention_bias=False,
    sliding_window=None,
)  # fmt: skip


def test_on_a_cpu_the_settings_in_their_order() -> None:
    assert kv_sizing.kv_blocks(None, None, None, BLOCK, CPU, 0) == GIB // BLOCK  # 1 GiB
    assert kv_sizing.kv_blocks(None, 0.5, None, BLOCK, CPU, 0) == GIB // 2 // BLOCK
    assert kv_sizing.kv_blocks(7, 0.5, 0.9, BLOCK, CPU, 0) == 7  # blocks named outright win
    assert kv_sizing.kv_blocks(None, 1e-9, None, BLOCK, CPU, 0) == 1  # never none at all
    # A GPU share means nothing on a CPU: its default size stands.
    assert kv_sizing.kv_blocks(None, None, 0.5, BLOCK, CPU, 0) == GIB // BLOCK


def test_a_gpus_share_after_weights_context_and_activations() -> None:
    h200 = GpuMemory(total=141 * GIB, free=140 * GIB, this_process=GIB // 4)  # 0.25 GiB of weights
    activations = kv_sizing.activation_bytes(SMOLLM2, 8192, 256, torch.bfloat16)
    blocks = kv_sizing.gpu_kv_blocks(h200, 0.9, activations, BLOCK)
    expected = (int(141 * GIB * 0.9) - GIB // 4 - kv_sizing.CUDA_CONTEXT_BYTES - activations) // BLOCK
    assert blocks == expected and 120 * GIB < blocks * BLOCK < 127 * GIB
    # Two pools on one GPU: each takes its own share, the second after the first holds its part.
    prefill = kv_sizing.gpu_kv_blocks(h200, 0.3, activations, BLOCK)
    after_prefill = GpuMemory(total=141 * GIB, free=int(141 * GIB * 0.7), this_process=GIB // 4)
    decode = kv_sizing.gpu_kv_blocks(after_prefill, 0.6, activations, BLOCK)
    assert (prefill + decode) * BLOCK < 0.9 * 141 * GIB and decode > prefill
    # A share larger than what others left free: what is free bounds it.
    crowded = GpuMemory(total=141 * GIB, free=20 * GIB, this_process=GIB // 4)
    assert kv_sizing.gpu_kv_blocks(crowded, 0.9, activations, BLOCK) == (20 * GIB - activations) // BLOCK


def test_no_room_is_a_clear_error_naming_what_to_change() -> None:
    small = GpuMemory(total=8 * GIB, free=8 * GIB, this_process=3 * GIB)
    with pytest.raises(KVSizingError, match=r"no room for a KV cache: 40% of this GPU's 8\.0 GiB") as failure:
        kv_sizing.gpu_kv_blocks(small, 0.4, GIB, BLOCK)
    assert "--gpu-memory-utilization" in str(failure.value) and "--num-kv-blocks" in str(failure.value)
    for share in (0.0, 1.5, -0.2):
        with pytest.raises(KVSizingError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
            kv_sizing.gpu_kv_blocks(small, share, GIB, BLOCK)
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be in \(0, 1\]"):
        EngineConfig(model="m", gpu_memory_utilization=0.0)


def test_activations_grow_with_the_step_and_the_logits() -> None:
    one = kv_sizing.activation_bytes(SMOLLM2, 2048, 1, torch.bfloat16)
    assert kv_sizing.activation_bytes(SMOLLM2, 4096, 1, torch.bfloat16) - one == pytest.approx(
        one - kv_sizing.activation_bytes(SMOLLM2, 0, 1, torch.bfloat16)
    )
    assert kv_sizing.activation_bytes(SMOLLM2, 2048, 1, torch.float32) > one
    # 256 sequences' fp32 logits over a 49152-token vocabulary: 48 MiB, doubled.
    logits = kv_sizing.activation_bytes(SMOLLM2, 0, 256, torch.bfloat16)
    assert logits == 2 * 256 * 49152 * 4
