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
ATTENTION_BACKENDS = ("auto", "portable", "triton")

# Step budgets by device, where the configuration leaves them unset (EngineConfig.step_budget).
# CPU: a 512-token chunk of SmolLM2 is ~0.8 s on one core, so a decode sharing the step waits that
# long; the budget lets a step carry four such chunks, or 2048 decodes.
CPU_MAX_NUM_BATCHED_TOKENS = 2048
CPU_CHUNK_SIZE = 512
# A prefill worker runs one chunk per step: a short prompt that arrives during a long prompt's
# chunk waits for the rest of it. 256 instead of 512 took SmolLM2's chat TTFT p50 with documents
# from 1.26x to 1.09x colocated and raised goodput, documents included (docs/performance.md, run B).
DEFAULT_PREFILL_CHUNK_SIZE = 256
# GPU: a 512-token chunk of a small model is well under a millisecond of an H200's compute, less
# than the host's cost of launching its step; 8192 tokens a step (vLLM's default for its OpenAI
# server on such GPUs) fills the device, and 2048-token chunks let four prompts share a step.
GPU_MAX_NUM_BATCHED_TOKENS = 8192
GPU_CHUNK_SIZE = 2048


@dataclass(frozen=True)
class EngineConfig:
    model: str
    # "auto": bfloat16 on CUDA and on CPUs with native bf16 (AMX / AVX512-BF16), float32 otherwise
    # (on a CPU without them bf16 matmuls are emulated and several times slower than fp32).
    dtype: str = "auto"
    device: str = "auto"  # "cpu", "cuda", "cuda:N" or "auto"
    role: Role = Role.MIXED
    # Tokens per KV block. 64, not the 16 of GPU servers: a decode reads each of its blocks as one
    # contiguous run per layer, and a serving engine's blocks end up scattered over the cache; on
    # CPU a 16-token run (6 KiB for SmolLM2) is too short for the prefetchers, and decode attention
    # over scattered 64-token blocks was 15-30% faster (benchmarks/kv_huge_pages.py --block-size,
    # docs/performance.md). vLLM's CPU backend picks 128 for the same reason.
    block_size: int = 64
    # KV cache size: `num_kv_blocks` if given, else as many blocks as fit in `kv_cache_memory_gib`,
    # else 1 GiB on a CPU and, on a GPU, what is left of `gpu_memory_utilization` of the device
    # (default 0.9) after the weights and a step's activations (engine/kv_sizing.py).
    num_kv_blocks: int | None = None
    kv_cache_memory_gib: float | None = None
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None  # default: the model's context length
    max_num_seqs: int = 64
    # Tokens of one step, and prompt tokens of one request in a step (chunked prefill). None: the
    # device's defaults (`step_budget`), which differ by two orders of magnitude in compute.
    max_num_batched_tokens: int | None = None
    chunk_size: int | None = None
    seed: int = 0
    threads: int | None = None  # torch intra-op threads on CPU; None = torch's default
    # On a CUDA GPU: replay decode-only steps from CUDA graphs captured at start-up
    # (engine/decode_graphs.py), one launch a step instead of ~15 per layer. No effect on CPU.
    cuda_graphs: bool = True
    # On a CUDA GPU: the step's attention in the portable torch path (gathered blocks, SDPA; decode
    # steps captured in CUDA graphs) or in the Triton paged kernel (ops/cuda/, blocks read in
    # place; its steps run eagerly for now). "auto" is the portable path until the kernel has been
    # measured on a GPU.
    attention_backend: str = "auto"
    # Prefix caching (engine/kv.py): a prompt's leading blocks already computed here, by any request,
    # are shared instead of computed again; blocks no request holds stay cached until evicted.
    prefix_cache: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory_gib must be > 0, got {self.kv_cache_memory_gib}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}"
            )
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be >= 1, got {self.threads}")
        for name in ("max_num_batched_tokens", "chunk_size"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")

    def step_budget(self, device_type: str) -> tuple[int, int]:
        """(max_num_batched_tokens, chunk_size) on a device of this type ("cpu", "cuda"): the
        configured values, else the device's defaults."""
        if device_type == "cuda":
            tokens, chunk = GPU_MAX_NUM_BATCHED_TOKENS, GPU_CHUNK_SIZE
        else:
            tokens = CPU_MAX_NUM_BATCHED_TOKENS
            chunk = DEFAULT_PREFILL_CHUNK_SIZE if self.role is Role.PREFILL else CPU_CHUNK_SIZE
        return self.max_num_batched_tokens or tokens, self.chunk_size or chunk


TRANSPORTS = ("shm", "tcp", "nixl")
KV_CHECKSUM_MODES = ("auto", "on", "off")  # see WorkerConfig.kv_checksum

# How a cluster backend hands a worker process its configuration (JSON) and where the worker
# reports that it is ready (an inherited pipe fd): see pdserve.cluster.local and pdserve.worker.
WORKER_CONFIG_ENV = "PDSERVE_WORKER_CONFIG"
WORKER_READY_FD_ENV = "PDSERVE_READY_FD"
WORKER_PARENT_ENV = "PDSERVE_PARENT_PID"  # the worker ends when that process does

# The pools of a deployment and the engine role of their workers.
POOL_ROLES: dict[str, Role] = {"prefill": Role.PREFILL, "decode": Role.DECODE, "colocated": Role.MIXED}


@dataclass(frozen=True)
class WorkerConfig:
    """Everything one worker process needs, handed to it by the cluster backend (as JSON in its
    environment, never on its command line). The one place where a worker's defaults live."""

    worker_id: str
    pool: str  # prefill | decode | colocated (see POOL_ROLES)
    engine: EngineConfig
    transport: str = "shm"  # KV transport, the same on every worker of a deployment
    # The worker binds its own RPC socket and reports the address it got (port "*": any free one),
    # so there is no window between picking a port and binding it.
    rpc_bind: str = "tcp://127.0.0.1:*"
    # tcp / nixl: where this worker serves its KV blocks (prefilled prompts, streams that move).
    # 0.0.0.0 serves on every interface and publishes the hostname.
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    # The node it runs on, as its cluster backend names it (the host for `local`, the Ray node
    # id for `ray`): workers on one node share its /dev/shm.
    node_id: str = ""
    # The GPU this worker computes on, as the serving process counts them (pdserve.devices): its
    # cluster backend confines the worker process to it (CUDA_VISIBLE_DEVICES). None: the
    # backend's choice (Ray's num_gpus) or torch's default.
    gpu: int | None = None
    # Percent of that GPU's multiprocessors this worker may use (CUDA MPS's active thread
    # percentage), so that pools sharing a GPU each keep their part; None: all of them.
    sm_share: int | None = None
    # With a tcp or nixl transport: keep the KV cache in a shared-memory segment too, so that a
    # worker on the same node copies it from there (`shm`) and only pairs on two nodes use the
    # network. The transport is chosen per pull, by the puller (worker/server.py).
    same_node_shm: bool = False
    lease_seconds: float = 30.0  # KV blocks held for another worker are freed after this
    kv_pull_timeout: float = 10.0  # seconds for one KV transfer
    kv_fault_rate: float = 0.0  # fault tests only: share of KV pulls to drop on purpose
    kv_corrupt_rate: float = 0.0  # fault tests only: share of KV pulls to land with a bit flipped
    # Digest the blocks a worker holds, check the blocks it pulls (transfer/checksum.py): on, off,
    # or auto (on where the cache is in host memory; a GPU cache would need a copy to the host).
    kv_checksum: str = "auto"
    # Decode role: how long the loop waits, before a step, for KV pulls it has just started, so
    # their requests join that step instead of the next (an shm pull of a chat prompt takes ~3 ms,
    # a decode step ~100 ms on one CPU). A slower pull finishes in the background meanwhile.
    kv_join_wait: float = 0.05
    load_interval: float = 0.1  # seconds between the worker's load reports
    # A report goes sooner, this long after the last, when its prefix cache stored or evicted
    # blocks: the router routes a conversation's next turn by them, and an agent's tool call can
    # follow an answer within milliseconds.
    prefix_report_interval: float = 0.01
    # Prefill role on CPU: a prompt of at most one chunk that arrives while a step runs is
    # prefilled between two of that step's layers, when it is shorter than what each prompt of
    # the step has left (shortest remaining first), instead of waiting for the step to end.
    prefill_interrupts: bool = True
    cpus: str | None = None  # pin to these CPUs, e.g. "0" or "0-1" (Linux); set by the backend
    log_level: str = "INFO"
    # The tokens that end generation, as the router's tokenizer says (None: the worker loads the
    # model's tokenizer to find them, which takes seconds of its start).
    eos_token_ids: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.pool not in POOL_ROLES:
            raise ValueError(f"pool must be one of {sorted(POOL_ROLES)}, got {self.pool!r}")
        if self.engine.role is not POOL_ROLES[self.pool]:
            raise ValueError(f"a {self.pool} worker runs a {POOL_ROLES[self.pool].value} engine")
        if self.transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {self.transport!r}")
        for name in ("lease_seconds", "kv_pull_timeout", "load_interval", "prefix_report_interval"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("kv_fault_rate", "kv_corrupt_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.kv_checksum not in KV_CHECKSUM_MODES:
            raise ValueError(f"kv_checksum must be one of {KV_CHECKSUM_MODES}, got {self.kv_checksum!r}")
        if self.kv_corrupt_rate > 0 and self.kv_checksum == "off":
            raise ValueError("kv_corrupt_rate with kv_checksum off would corrupt KV that nothing checks")

    @property
    def role(self) -> Role:
        return self.engine.role
