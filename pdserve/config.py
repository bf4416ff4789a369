"""Engine configuration. No torch here: the CLI and the router read it too."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Role(enum.StrEnum):
    """What an engine does: prompts only, decodes (with KV from elsewhere), or both (colocated)."""

    PREFILL = "prefill"
    DECODE = "decode"
    MIXED = "mixed"


DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    # "auto": bfloat16 on CUDA and on CPUs with native bf16 (AMX / AVX512-BF16), float32 otherwise
    # (on a CPU without them bf16 matmuls are emulated and several times slower than fp32).
    dtype: str = "auto"
    device: str = "auto"  # "cpu", "cuda", "cuda:N" or "auto"
    role: Role = Role.MIXED
    block_size: int = 16
    # KV cache size: `num_kv_blocks` if given, else as many blocks as fit in `kv_cache_memory_gib`.
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float = 1.0
    max_model_len: int | None = None  # default: the model's context length
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    chunk_size: int = 512
    seed: int = 0
    threads: int | None = None  # torch intra-op threads on CPU; None = torch's default

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
