"""The options of `pdserve serve`: one table makes the flags, checks the TOML config file and
supplies the defaults, so the three never disagree. No torch.

Layering: the defaults, then the config file (`--config`, keys spelled like the flags, dashes or
underscores, `[pools.NAME]` tables for a pool's own settings), then the command line.
"""

from __future__ import annotations

import argparse
import dataclasses
import tomllib
from pathlib import Path
from typing import Any

from pdserve.config import (
    CPU_CHUNK_SIZE,
    CPU_MAX_NUM_BATCHED_TOKENS,
    DEFAULT_PREFILL_CHUNK_SIZE,
    GPU_CHUNK_SIZE,
    GPU_MAX_NUM_BATCHED_TOKENS,
    POOL_ROLES,
    EngineConfig,
    WorkerConfig,
)
from pdserve.errors import PdserveError
from pdserve.planner.law import LawSettings
from pdserve.planner.loop import PlannerSettings
from pdserve.pools.manager import PoolSettings
from pdserve.router.app import RouterSettings
from pdserve.router.channel import HEARTBEAT_TIMEOUT_S
from pdserve.router.config import RouterConfig
from pdserve.router.workers import STALL_TIMEOUT_S
from pdserve.slo import DEFAULT_PERCENTILE

# name -> (type, default, help). One table: it makes the flags, checks the config file, and
# supplies the defaults, so the three never disagree.


def _default(cls: Any, name: str) -> Any:
    """A dataclass field's default: every default is written once, where it is used."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


_E, _W, _R, _P = EngineConfig, WorkerConfig, RouterConfig, PoolSettings

OPTIONS: dict[str, tuple[type, Any, str]] = {
    "model": (str, None, "built-in name (smollm2-135m), a .gguf file or a Hugging Face folder"),
    "prefill": (int, 0, "prefill workers (disaggregated)"),
    "decode": (int, 0, "decode workers (disaggregated)"),
    "colocated": (int, 0, "mixed workers with chunked prefill, instead of --prefill/--decode"),
    "transport": (
        str,
        None,
        "KV transport between workers: shm, tcp or nixl (default: shm on CPUs, tcp on GPUs)",
    ),
    "device": (
        str,
        "auto",
        "where the workers compute: auto (a CUDA GPU where torch can use one, else the CPU), cpu or cuda",
    ),
    "prefill_gpus": (str, None, "GPUs of the prefill pool, e.g. 0,1 or 0-3: one per worker, in turn"),
    "decode_gpus": (str, None, "GPUs of the decode pool (a GPU may also be in another pool's list)"),
    "colocated_gpus": (str, None, "GPUs of the colocated pool"),
    "prefill_sm_share": (
        int,
        None,
        "percent of its GPU's multiprocessors a prefill worker may use (CUDA MPS: start its daemon first)",
    ),
    "decode_sm_share": (int, None, "percent of its GPU's multiprocessors a decode worker may use (CUDA MPS)"),
    "colocated_sm_share": (int, None, "percent of its GPU's multiprocessors a colocated worker may use"),
    "same_node_kv": (
        str,
        "auto",
        "with --transport tcp or nixl: shm (pull KV through shared memory between workers on one "
        "node, the transport between nodes), off, or auto (shm with --cluster ray, else off)",
    ),
    "host": (str, "127.0.0.1", "address the HTTP server listens on"),
    "port": (int, 8000, "HTTP port (0: a free one, named in the start line at --log-level INFO)"),
    "served_model_name": (str, None, "the model name clients send (default: --model)"),
    "threads": (int, 1, "torch threads per worker"),
    "pin_cpus": (bool, True, "pin each worker to its own CPU where the OS allows (--cluster local)"),
    "cluster": (str, "local", "where workers run: local (child processes) or ray (actors on a Ray cluster)"),
    "ray_address": (str, "auto", "--cluster ray: the Ray cluster to join (host:port of its head, or auto)"),
    "ray_prefill_resources": (str, None, "--cluster ray: Ray resources per prefill worker, JSON"),
    "ray_decode_resources": (str, None, "--cluster ray: Ray resources per decode worker, JSON"),
    "ray_colocated_resources": (str, None, "--cluster ray: Ray resources per colocated worker, JSON"),
    "ray_num_cpus": (float, 1.0, "--cluster ray: CPUs each worker's actor takes from its node"),
    "ray_num_gpus": (float, 0.0, "--cluster ray: GPUs each worker's actor takes from its node"),
    "ray_strategy": (str, "pack", "--cluster ray: pack (fill a node first) or spread"),
    "dtype": (
        str,
        _default(_E, "dtype"),
        "auto (fp32 on CPUs without native bf16), float32, bfloat16, float16",
    ),
    "max_model_len": (int, None, "context length (default: the model's, within the KV cache)"),
    "num_kv_blocks": (int, None, "KV cache blocks per worker (default: from --kv-cache-memory-gib)"),
    "kv_cache_memory_gib": (
        float,
        None,
        "KV cache size per worker (default: 1 on a CPU; on a GPU see --gpu-memory-utilization)",
    ),
    "gpu_memory_utilization": (
        float,
        None,
        "on a GPU: the share of the device one worker may use, weights, activations and KV cache "
        "together; the KV cache gets what is left (default 0.9; give each pool its own where pools "
        "share a GPU)",
    ),
    "block_size": (int, _default(_E, "block_size"), "tokens per KV block"),
    "max_num_seqs": (int, _default(_E, "max_num_seqs"), "requests running at once per worker"),
    "max_num_batched_tokens": (
        int,
        _default(_E, "max_num_batched_tokens"),
        f"tokens per engine step (default: {CPU_MAX_NUM_BATCHED_TOKENS} on CPU, "
        f"{GPU_MAX_NUM_BATCHED_TOKENS} on a GPU)",
    ),
    "chunk_size": (
        int,
        _default(_E, "chunk_size"),
        f"prompt tokens of one request per step (chunked prefill; default: {CPU_CHUNK_SIZE} on CPU, "
        f"{GPU_CHUNK_SIZE} on a GPU)",
    ),
    "prefill_chunk_size": (
        int,
        None,
        f"the prefill pool's chunk size (default: {DEFAULT_PREFILL_CHUNK_SIZE} on CPU, {GPU_CHUNK_SIZE} on a "
        f"GPU; with --chunk-size set, the smaller of it and {DEFAULT_PREFILL_CHUNK_SIZE}); smaller lets a "
        "short prompt overtake a long one sooner",
    ),
    "attention_backend": (
        str,
        _default(_E, "attention_backend"),
        "on a GPU: portable (torch, decode steps in CUDA graphs), triton (the paged kernel, steps run "
        "eagerly) or auto (portable until the kernel is measured)",
    ),
    "prefix_cache": (
        bool,
        _default(_E, "prefix_cache"),
        "prefix caching on every worker: a prompt's blocks already computed there are reused, not "
        "computed again (--no-prefix-cache to compare)",
    ),
    "cuda_graphs": (
        bool,
        _default(_E, "cuda_graphs"),
        "on a GPU, replay decode steps from CUDA graphs captured at start-up",
    ),
    "path_choice": (
        str,
        _default(_R, "path_choice"),
        "cost: the cost model chooses remote or local prefill per request; threshold: "
        "--local-prefill-threshold alone",
    ),
    "local_prefill_threshold": (
        int,
        _default(_R, "local_prefill_threshold"),
        "prompts up to this many tokens are prefilled on the decode worker (with --path-choice "
        "cost: only until the cost model has enough steps)",
    ),
    "max_retries": (
        int,
        _default(_R, "max_retries"),
        "re-prefills of a request (dead prefill worker, failed KV transfer)",
    ),
    "prefill_timeout": (
        float,
        _default(_R, "prefill_timeout"),
        "seconds from sending a prompt to its first token",
    ),
    "token_timeout": (float, _default(_R, "token_timeout"), "longest wait for the next token of a stream"),
    "max_in_flight": (int, _default(_R, "max_in_flight"), "requests admitted at once; more get 429"),
    "max_queued_prompt_tokens": (
        int,
        _default(_R, "max_queued_prompt_tokens"),
        "prompt tokens queued per prefill (or colocated) worker; a prompt beyond it gets 429",
    ),
    "max_body_bytes": (
        int,
        _default(RouterSettings, "max_body_bytes"),
        "a completion or chat body larger than this is refused with 413",
    ),
    "body_timeout": (
        float,
        _default(RouterSettings, "body_timeout"),
        "seconds a client has to send its whole request body (408 after)",
    ),
    "lease_seconds": (
        float,
        _default(_W, "lease_seconds"),
        "KV blocks held for another worker (a prefilled prompt, a stream that moves) are freed after this",
    ),
    "kv_pull_timeout": (float, _default(_W, "kv_pull_timeout"), "seconds for one KV transfer"),
    "kv_fault_rate": (
        float,
        _default(_W, "kv_fault_rate"),
        "fault tests only: share of KV transfers to drop on purpose",
    ),
    "kv_corrupt_rate": (
        float,
        _default(_W, "kv_corrupt_rate"),
        "fault tests only: share of KV transfers to land with one bit flipped on purpose",
    ),
    "prefill_interrupts": (
        bool,
        _default(_W, "prefill_interrupts"),
        "a prefill worker prefills a short prompt between two layers of a longer prompt's step "
        "(shortest remaining first) instead of after it",
    ),
    "kv_checksum": (
        str,
        _default(_W, "kv_checksum"),
        "digest each KV transfer and fail one that changed the blocks: on, off, or auto (on for "
        "caches in host memory)",
    ),
    "ready_timeout": (
        float,
        _default(_P, "start_timeout"),
        "seconds for a worker to load its model and report ready",
    ),
    "heartbeat_timeout": (
        float,
        HEARTBEAT_TIMEOUT_S,
        "a worker whose connection is silent this long is taken out of service",
    ),
    "stall_timeout": (
        float,
        STALL_TIMEOUT_S,
        "a worker that sends no load report this long (a hung engine) is taken out",
    ),
    "log_level": (str, _default(_W, "log_level"), "DEBUG, INFO, WARNING, ERROR"),
    "step_trace": (
        Path,
        None,
        "write every worker's engine steps to this file, a JSON line each (what each computed, its "
        "time and the worker loop's around it), for `pdserve profile --from-trace`",
    ),
    # Elastic pools: the admin API (PUT /pools/{pool}, POST /workers/{id}/drain) scales within these.
    "prefill_min": (int, None, "fewest prefill workers the pool may be scaled to (default: --prefill)"),
    "prefill_max": (int, None, "most prefill workers the pool may be scaled to (default: --prefill)"),
    "decode_min": (int, None, "fewest decode workers (default: --decode)"),
    "decode_max": (int, None, "most decode workers (default: --decode)"),
    "colocated_min": (int, None, "fewest colocated workers (default: --colocated)"),
    "colocated_max": (int, None, "most colocated workers (default: --colocated)"),
    "drain_timeout": (
        float,
        _default(_P, "drain_timeout"),
        "seconds a draining worker has to hand over what it holds; what is left then ends with an error",
    ),
    "replace_failed": (
        bool,
        _default(_P, "replace_failed"),
        "start a new worker in place of one that dies (else the pool shrinks)",
    ),
    "rebalance_on_start": (
        bool,
        _default(_P, "rebalance_on_start"),
        "a decode (or colocated) worker that starts while serving takes its share of the running streams",
    ),
    # The planner and the SLOs (pdserve.planner; docs/operations.md).
    "planner": (
        str,
        "off",
        "slo: size each pool from its phase's pressure against --slo; off: pools stay put",
    ),
    "slo": (str, None, "SLOs in ms, e.g. ttft=1000,itl=100 (the planner, the path choice, admission)"),
    "slo_percentile": (float, DEFAULT_PERCENTILE, "the percentile the SLOs hold at (0.9: p90)"),
    "max_workers": (
        int,
        None,
        "the planner's worker budget over all pools (default: this host's CPUs; --cluster ray needs it)",
    ),
    "planner_interval": (float, _default(PlannerSettings, "interval_s"), "seconds between planner decisions"),
    "planner_cooldown": (
        float,
        _default(LawSettings, "cooldown_s"),
        "seconds after a pool's change before the planner changes it again (a breach may add sooner)",
    ),
    "planner_downscale_window": (
        float,
        _default(LawSettings, "downscale_window_s"),
        "seconds a pool must want fewer workers, without a break, before the planner drains one",
    ),
    "reject_on_slo_miss": (
        bool,
        _default(_R, "reject_on_slo_miss"),
        "answer 429 + Retry-After at once when the pools are at their bounds and the predicted TTFT "
        "is above --slo-reject-factor x the TTFT SLO",
    ),
    "slo_reject_factor": (float, _default(_R, "slo_reject_factor"), "see --reject-on-slo-miss"),
    # Access (pdserve.router.auth, docs/security.md). A key on the command line is seen by every
    # user of this host (`ps`, /proc): prefer the file or the environment variable.
    "api_key": (
        list,
        None,
        "a key clients must send (Authorization: Bearer KEY) on every route but /health and "
        "/metrics; repeat for several; also PDSERVE_API_KEY (comma-separated) or --api-key-file",
    ),
    "api_key_file": (Path, None, "a file of API keys, one per line (# comments)"),
    "admin_key": (
        list,
        None,
        "the key of the admin API (/pools, /workers); also PDSERVE_ADMIN_KEY or --admin-key-file. "
        "With API keys but no admin key the admin API is closed",
    ),
    "admin_key_file": (Path, None, "a file of admin keys, one per line"),
    "metrics_key": (list, None, "a key /metrics then needs; also PDSERVE_METRICS_KEY or --metrics-key-file"),
    "metrics_key_file": (Path, None, "a file of metrics keys, one per line"),
}

# `[pools.NAME]` tables of the config file: a pool's own settings (mixed is colocated's old name).
POOL_TABLE_KEYS: dict[str, type] = {
    "chunk_size": int,
    "max_num_batched_tokens": int,
    "max_num_seqs": int,
    "min": int,
    "max": int,
    "slo_ttft_ms": float,
    "slo_itl_ms": float,
    "ray": dict,  # [pools.NAME.ray]: that pool's Ray placement (--cluster ray)
    "gpus": str,  # "0,1" or "0-3" (a list of indices is accepted too): as --POOL-gpus
    "sm_share": int,  # as --POOL-sm-share
    "gpu_memory_utilization": float,
}
# [pools.NAME.ray]: resources = {pdserve_prefill = 1}, num_cpus, num_gpus, strategy.
POOL_RAY_KEYS: dict[str, type | tuple[type, ...]] = {
    "resources": dict,
    "num_cpus": (int, float),
    "num_gpus": (int, float),
    "strategy": str,
}
POOL_TABLE_ALIASES = {"mixed": "colocated"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None, help="TOML file with any of these options")
    for name, (kind, default, help_text) in OPTIONS.items():
        flag = "--" + name.replace("_", "-")
        shown = "" if default is None else f" (default: {default})"
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text + shown)
        elif kind is list:
            p.add_argument(flag, action="append", default=None, metavar="KEY", help=help_text)
        else:
            p.add_argument(flag, type=kind, default=None, help=help_text + shown)


def _read_config(path: Path) -> dict[str, Any]:
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise PdserveError(f"cannot read config file {path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise PdserveError(f"config file {path} is not valid TOML: {exc}") from exc
    result: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.replace("-", "_")
        if name == "pools":
            result["pools"] = _read_pool_tables(path, value)
            continue
        if name not in OPTIONS:
            raise PdserveError(f"{path}: unknown option {key!r} (known: {', '.join(sorted(OPTIONS))})")
        kind = OPTIONS[name][0]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if kind is Path and isinstance(value, str):
            value = (path.parent / value).expanduser()  # relative to the config file
        if kind is list and isinstance(value, str):
            value = [value]
        if kind is list and not all(isinstance(v, str) for v in value if isinstance(value, list)):
            raise PdserveError(f"{path}: {key} must be a string or a list of strings")
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise PdserveError(f"{path}: {key} must be a {kind.__name__}, got {value!r}")
        result[name] = value
    return result


def _read_pool_tables(path: Path, tables: Any) -> dict[str, dict[str, Any]]:
    if not isinstance(tables, dict):
        raise PdserveError(f"{path}: pools must be tables, e.g. [pools.prefill]")
    result: dict[str, dict[str, Any]] = {}
    for pool_key, table in tables.items():
        pool = POOL_TABLE_ALIASES.get(pool_key, pool_key)
        if pool not in POOL_ROLES:
            raise PdserveError(f"{path}: unknown pool [pools.{pool_key}] (pools: {', '.join(POOL_ROLES)})")
        if not isinstance(table, dict):
            raise PdserveError(f"{path}: [pools.{pool_key}] must be a table")
        settings: dict[str, Any] = {}
        for key, value in table.items():
            name = key.replace("-", "_")
            kind = POOL_TABLE_KEYS.get(name)
            if kind is None:
                raise PdserveError(
                    f"{path}: [pools.{pool_key}] has unknown key {key!r} (known: {', '.join(POOL_TABLE_KEYS)})"
                )
            if kind is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if name == "gpus" and isinstance(value, list):
                if not all(isinstance(g, int) and not isinstance(g, bool) for g in value):
                    raise PdserveError(
                        f"{path}: [pools.{pool_key}] gpus must list GPU indices, got {value!r}"
                    )
                value = ",".join(str(g) for g in value)
            if not isinstance(value, kind) or isinstance(value, bool):
                raise PdserveError(
                    f"{path}: [pools.{pool_key}] {key} must be a {kind.__name__}, got {value!r}"
                )
            if name == "ray" and isinstance(value, dict):
                _check_ray_table(path, pool_key, value)
            settings[name] = value
        ignored = {"prefill": "slo_itl_ms", "decode": "slo_ttft_ms"}.get(pool)
        if ignored in settings:
            raise PdserveError(
                f"{path}: [pools.{pool_key}] {ignored}: the {pool} pool is planned by its "
                f"{'TTFT' if pool == 'prefill' else 'ITL'} only (give the other in the other pool)"
            )
        result[pool] = settings
    return result


def _check_ray_table(path: Path, pool_key: str, table: dict[str, Any]) -> None:
    where = f"{path}: [pools.{pool_key}.ray]"
    for key in list(table):  # num-cpus as well as num_cpus, like every other key
        table[key.replace("-", "_")] = table.pop(key)
    for key, value in table.items():
        kind = POOL_RAY_KEYS.get(key)
        if kind is None:
            raise PdserveError(f"{where} has unknown key {key!r} (known: {', '.join(POOL_RAY_KEYS)})")
        if not isinstance(value, kind) or isinstance(value, bool):
            raise PdserveError(
                f"{where} {key} must be a {getattr(kind, '__name__', 'number')}, got {value!r}"
            )
    resources = table.get("resources", {})
    if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in resources.values()):
        raise PdserveError(f"{where} resources must map resource names to numbers, got {resources!r}")


def layered(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults, then the config file, then the command line (not yet checked together)."""
    options: dict[str, Any] = {name: default for name, (_, default, _) in OPTIONS.items()}
    options["pools"] = {}
    if args.config is not None:
        options.update(_read_config(args.config))
    for name in OPTIONS:
        value = getattr(args, name)
        if value is not None:
            options[name] = value
    return options
