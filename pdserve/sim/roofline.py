"""A profile derived from a roofline, for hardware this machine is not (no torch): a step costs a
fixed overhead plus the larger of its FLOPs at a share of the peak rate and its bytes at a share
of the memory bandwidth; a KV pull costs a latency plus its bytes at the link's bandwidth. Every
number used is printed with the profile (`Profile.assumptions`), to be checked and overridden.

    pdserve profile --hardware h200 --model-shape llama-3.1-8b --out h200-llama8b.json

Sources of the peak numbers: the vendors' data sheets (dense BF16 tensor-core FLOP/s, without
sparsity; HBM bandwidth). The efficiencies are typical of well-tuned serving kernels, not measured
here: a GPU profile measured with the GPU engine (`pdserve profile --model`) replaces them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.errors import PdserveError
from pdserve.modelfiles.config import ModelConfig
from pdserve.sim.profile import Overhead, Profile, TransferTime
from pdserve.sim.step_time import RooflineStep


@dataclass(frozen=True)
class Hardware:
    name: str
    bf16_flops: float  # dense, per second
    memory_bandwidth: float  # bytes per second
    memory_bytes: float
    link_bandwidth: float  # between two workers' GPUs (bytes per second): the KV's path
    link: str  # what that link is


HARDWARE = {
    "h200": Hardware("NVIDIA H200 SXM", 989e12, 4.8e12, 141e9, 50e9, "400 Gb/s InfiniBand NDR per GPU"),
    "h100": Hardware("NVIDIA H100 SXM", 989e12, 3.35e12, 80e9, 50e9, "400 Gb/s InfiniBand NDR per GPU"),
    "a100": Hardware("NVIDIA A100 SXM 80GB", 312e12, 2.039e12, 80e9, 25e9, "200 Gb/s InfiniBand HDR per GPU"),
    "l40s": Hardware("NVIDIA L40S", 362e12, 0.864e12, 48e9, 12.5e9, "100 Gb/s Ethernet (RoCE)"),
}


def _llama(
    layers: int, hidden: int, inter: int, heads: int, kv: int, vocab: int, ctx: int, tie: bool
) -> dict[str, Any]:
    return {
        "model_type": "llama",
        "num_hidden_layers": layers,
        "hidden_size": hidden,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": vocab,
        "max_position_embeddings": ctx,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "tie_word_embeddings": tie,
    }


# Public shapes (the models' config.json); no weights.
MODEL_SHAPES = {
    "llama-3.1-8b": _llama(32, 4096, 14336, 32, 8, 128256, 131072, False),
    "llama-3.1-70b": _llama(80, 8192, 28672, 64, 8, 128256, 131072, False),
    "llama-3.2-3b": _llama(28, 3072, 8192, 24, 8, 128256, 131072, True),
    "smollm2-135m": _llama(30, 576, 1536, 9, 3, 49152, 8192, True),
}


@dataclass(frozen=True)
class Assumptions:
    compute_efficiency: float = 0.6  # of peak FLOP/s, prompt steps (large GEMMs)
    memory_efficiency: float = 0.8  # of peak bandwidth, decode steps (weights and KV read)
    step_overhead_s: float = 0.004  # per step: scheduling (Python), launches, sampling
    memory_utilization: float = 0.9  # of the GPU's memory for weights + KV (pdserve's default)
    bytes_per_param: int = 2  # bf16 weights
    kv_bytes: int = 2  # bf16 KV cache
    block_size: int = 16
    transfer_latency_s: float = 0.002  # per pull: the request, the lease check, completion
    link_efficiency: float = 0.7
    request_overhead_s: float = 0.002  # router: HTTP, tokenization, admission, dispatch
    start_s: float = 60.0  # a worker from asked to ready (weights loaded from local disk)


def model_shape(name: str) -> tuple[str, dict[str, Any]]:
    """A built-in shape's name, or a config.json's path: (name, its config)."""
    if name in MODEL_SHAPES:
        return name, MODEL_SHAPES[name]
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PdserveError(
            f"--model-shape: {name!r} is neither a built-in shape ({', '.join(MODEL_SHAPES)}) nor a config.json"
        )
    try:
        return path.parent.name or path.stem, json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise PdserveError(f"--model-shape: cannot read {path}: {exc}") from None


def parameters(m: ModelConfig) -> int:
    attention = m.hidden_size * m.head_dim * (m.num_heads * 2 + m.num_kv_heads * 2)
    mlp = 3 * m.hidden_size * m.intermediate_size
    embeddings = m.vocab_size * m.hidden_size * (1 if m.tie_word_embeddings else 2)
    return m.num_layers * (attention + mlp) + embeddings


def derive(hardware: str, shape: str, a: Assumptions = Assumptions()) -> Profile:
    if hardware not in HARDWARE:
        raise PdserveError(f"--hardware must be one of {', '.join(HARDWARE)}, got {hardware!r}")
    hw = HARDWARE[hardware]
    name, config = model_shape(shape)
    m = ModelConfig.from_hf_dict(config)
    params = parameters(m)
    weight_bytes = params * a.bytes_per_param
    kv_per_token = m.num_layers * 2 * m.num_kv_heads * m.head_dim * a.kv_bytes
    # FLOPs: 2 per parameter per token (the matmuls; the LM head only for sampled tokens is
    # ignored), and per attended position 4 x layers x heads x head_dim (QK^T and PV).
    flops_per_attended = 4 * m.num_layers * m.num_heads * m.head_dim
    kv_memory = hw.memory_bytes * a.memory_utilization - weight_bytes
    if kv_memory <= 0:
        raise PdserveError(
            f"{name}'s weights ({weight_bytes / 1e9:.0f} GB) do not fit one {hw.name} "
            f"({hw.memory_bytes / 1e9:.0f} GB at {a.memory_utilization:.0%}): tensor parallelism is not modelled"
        )
    blocks = int(kv_memory // (kv_per_token * a.block_size))
    step = RooflineStep(
        fixed_s=a.step_overhead_s,
        flops_per_token=2.0 * params,
        flops_per_attended=float(flops_per_attended),
        weight_bytes=float(weight_bytes),
        kv_bytes_per_token=float(kv_per_token),
        flops=hw.bf16_flops * a.compute_efficiency,
        bandwidth=hw.memory_bandwidth * a.memory_efficiency,
    )
    block_bytes = kv_per_token * a.block_size
    link = hw.link_bandwidth * a.link_efficiency
    transfer = TransferTime(a.transfer_latency_s, block_bytes / link)
    assumptions = [
        f"hardware: {hw.name}: {hw.bf16_flops / 1e12:.0f} TFLOP/s dense BF16, "
        f"{hw.memory_bandwidth / 1e12:.2f} TB/s HBM, {hw.memory_bytes / 1e9:.0f} GB (data sheet)",
        f"model: {name}: {params / 1e9:.2f} B parameters, {m.num_layers} layers, hidden {m.hidden_size}, "
        f"{m.num_heads} heads / {m.num_kv_heads} KV heads of {m.head_dim}; one GPU per worker (no tensor parallelism)",
        f"compute at {a.compute_efficiency:.0%} of peak; memory at {a.memory_efficiency:.0%} of peak bandwidth",
        f"a step costs {a.step_overhead_s * 1000:g} ms besides its FLOPs or bytes (scheduling, launches, sampling)",
        f"a step reads all weights ({weight_bytes / 1e9:.1f} GB) and its streams' KV "
        f"({kv_per_token / 1024:.0f} KiB per token)",
        f"KV cache: {a.memory_utilization:.0%} of memory less the weights = {blocks} blocks of {a.block_size} tokens "
        f"({blocks * a.block_size / 1e6:.2f} M tokens); activations not subtracted",
        f"KV pulls over {hw.link} at {a.link_efficiency:.0%}: {a.transfer_latency_s * 1000:g} ms + "
        f"{block_bytes / 2**20:.2f} MiB per block",
        f"router overhead {a.request_overhead_s * 1000:g} ms a request; a worker starts in {a.start_s:g} s",
    ]
    return Profile(
        source="roofline",
        model=name,
        model_shape=config,
        block_size=a.block_size,
        kv_blocks={role: blocks for role in ("prefill", "decode", "colocated")},
        steps={"prefill": step, "decode": step, "colocated": step},
        transfers={"nixl": transfer, "tcp": transfer},
        overhead=Overhead(request_s=a.request_overhead_s, step_s=0.0),
        start_s=a.start_s,
        meta={"device": "cuda", "hardware": hardware, "assumption_values": a.__dict__},
        assumptions=assumptions,
    )
