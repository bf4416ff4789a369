"""Where a deployment's workers compute: its device (`--device auto|cpu|cuda`), each pool's GPUs
(`--prefill-gpus 0,1`, `[pools.decode] gpus = [2, 3]`), each worker's GPU, and the KV transport
that can serve a cache on that device.

Torch-free (the serving process never imports torch on a CPU host): a host without the NVIDIA
driver's device files has no GPU; only where they exist is torch asked whether it can use one (a
CPU build of torch on a GPU host cannot). The inventory is a parameter, so the rules are tested
with made-up ones."""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable
from pathlib import Path

from pdserve.errors import PdserveError

logger = logging.getLogger(__name__)

DEVICES = ("auto", "cpu", "cuda")
VISIBLE_DEVICES_ENV = "CUDA_VISIBLE_DEVICES"


def cuda_gpu_count() -> int:
    """GPUs torch can use in a process started from this one (0 on a CPU host or a CPU build)."""
    if not any(Path("/dev").glob("nvidia[0-9]*")) and not Path("/proc/driver/nvidia/gpus").is_dir():
        return 0
    import torch  # a GPU host: only torch knows whether its build can use the GPUs

    return int(torch.cuda.device_count()) if torch.cuda.is_available() else 0


def parse_gpus(value: str, what: str) -> tuple[int, ...]:
    """'0,1' or '0-3' (or a mix: '0,2-3') as GPU indices, in order, each once."""
    gpus: list[int] = []
    for part in value.split(","):
        part = part.strip()
        match = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if match is None:
            raise PdserveError(f"{what} must list GPU indices like 0,1 or 0-3, got {value!r}")
        first, last = int(match[1]), int(match[2] or match[1])
        if last < first:
            raise PdserveError(f"{what}: the range {part} runs backwards")
        gpus.extend(range(first, last + 1))
    if len(set(gpus)) != len(gpus):
        raise PdserveError(f"{what} names a GPU twice: {value!r}")
    return tuple(gpus)


def resolve_device(requested: str, gpus_given: bool, gpu_count: Callable[[], int] = cuda_gpu_count) -> str:
    """The deployment's device type: cpu or cuda. `auto`: cuda where torch can use a GPU here."""
    if requested not in DEVICES:
        raise PdserveError(f"--device must be one of {', '.join(DEVICES)}, got {requested!r}")
    if requested == "cpu":
        if gpus_given:
            raise PdserveError("--device cpu with a pool's GPUs (--prefill-gpus, ...): drop one")
        return "cpu"
    count = gpu_count()
    if requested == "cuda" and count == 0:
        raise PdserveError(
            "--device cuda, but no CUDA GPU can be used here (no NVIDIA driver, or a CPU build of "
            "torch: see README, 'Installing on a GPU')"
        )
    if requested == "auto" and count == 0:
        if gpus_given:
            raise PdserveError(
                "a pool's GPUs are given (--prefill-gpus, ...) but no CUDA GPU can be used here"
            )
        return "cpu"
    return "cuda"


def place(
    requested: str,
    given: dict[str, str | None],
    ray_gpus: dict[str, float] | None,
    gpu_count: Callable[[], int] = cuda_gpu_count,
) -> tuple[str, dict[str, tuple[int, ...]]]:
    """(device type, each pool's GPUs) of a deployment: `given` is each pool's --POOL-gpus (or its
    table's gpus); `ray_gpus` each pool's Ray num_gpus with --cluster ray (None: local workers).
    On Ray the GPUs are Ray's to give, and this host's own say nothing of its nodes'."""
    pool_gpus = {pool: parse_gpus(text, f"--{pool}-gpus") for pool, text in given.items() if text}
    if ray_gpus is None:
        device = resolve_device(requested, bool(pool_gpus), gpu_count)
        if pool_gpus:
            check_pool_gpus(pool_gpus, gpu_count())
        return device, pool_gpus
    if requested not in DEVICES:
        raise PdserveError(f"--device must be one of {', '.join(DEVICES)}, got {requested!r}")
    if pool_gpus:
        raise PdserveError(
            "with --cluster ray each worker's GPU is Ray's to give: --ray-num-gpus, or num_gpus in "
            "[pools.NAME.ray], instead of --POOL-gpus"
        )
    with_gpus = {pool for pool, amount in ray_gpus.items() if amount > 0}
    if requested == "cpu" and with_gpus:
        raise PdserveError("--device cpu, but Ray would give GPUs (num_gpus) to the workers: drop one")
    if requested == "cuda" and len(with_gpus) < len(ray_gpus):
        raise PdserveError("--device cuda with --cluster ray needs a GPU for every worker: --ray-num-gpus 1")
    if 0 < len(with_gpus) < len(ray_gpus):
        raise PdserveError("with --cluster ray, give every pool GPUs (num_gpus) or none")
    return ("cuda" if with_gpus else "cpu"), {}


def check_pool_gpus(pool_gpus: dict[str, tuple[int, ...]], gpu_count: int) -> None:
    """Every GPU a pool names exists here."""
    for pool, gpus in pool_gpus.items():
        missing = [g for g in gpus if g >= gpu_count]
        if missing:
            raise PdserveError(
                f"pool {pool}: GPU {missing[0]} does not exist here ({gpu_count} visible: 0-{gpu_count - 1})"
            )


def worker_gpu(gpus: tuple[int, ...], worker_id: str) -> int | None:
    """The GPU of a pool's worker: its pool's GPUs in turn by the worker's number (prefill-0 the
    first, prefill-1 the next, ...); None when the pool lists none (torch's default GPU)."""
    if not gpus:
        return None
    number = worker_id.rsplit("-", 1)[-1]
    return gpus[int(number) % len(gpus)] if number.isdigit() else gpus[0]


MPS_SHARE_ENV = "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"


def check_sm_share(share: int | None, what: str, device: str) -> None:
    if share is None:
        return
    if not 1 <= share <= 100:
        raise PdserveError(f"{what} must be a percentage in [1, 100], got {share}")
    if device != "cuda":
        raise PdserveError(f"{what} shares a GPU's multiprocessors: these workers run on the CPU")


def sm_share_env(share: int | None) -> dict[str, str]:
    """The environment that holds a worker to a share of its GPU's multiprocessors. It takes effect
    where the CUDA MPS control daemon runs (`nvidia-cuda-mps-control -d`); elsewhere CUDA ignores it."""
    return {} if share is None else {MPS_SHARE_ENV: str(share)}


def visible_devices(gpu: int | None) -> dict[str, str]:
    """The environment that confines a worker process to its GPU (it then sees it as cuda:0).
    Indices count in this process's view: a CUDA_VISIBLE_DEVICES it was given is mapped through."""
    if gpu is None:
        return {}
    inherited = os.environ.get(VISIBLE_DEVICES_ENV)
    if inherited:
        names = [n.strip() for n in inherited.split(",") if n.strip()]
        if gpu < len(names):
            return {VISIBLE_DEVICES_ENV: names[gpu]}
    return {VISIBLE_DEVICES_ENV: str(gpu)}


def transport_for(device: str, transport: str | None, same_node_kv: str) -> str:
    """The KV transport: the one asked for if it can serve a cache on `device`, else a clear error;
    when none is asked for, shm on CPUs and tcp on GPUs (the cache is in device memory, which shm
    cannot share; tcp stages it through pinned host buffers)."""
    if transport is None:
        chosen = "tcp" if device == "cuda" else "shm"
        if device == "cuda":
            logger.info("workers on GPUs: KV moves over tcp (staged through pinned host memory)")
        return chosen
    if device == "cuda" and transport == "shm":
        raise PdserveError(
            "--transport shm keeps each KV cache in host shared memory, and these workers keep "
            "theirs on a GPU: use --transport tcp (or nixl), or --device cpu"
        )
    if device == "cuda" and same_node_kv == "shm":
        raise PdserveError("--same-node-kv shm keeps KV caches in host memory; these workers run on GPUs")
    return transport
