"""`pdserve serve`: the router and its pools of workers (the `local` cluster backend). No torch.

    pdserve serve --model smollm2-135m --prefill 1 --decode 1     # disaggregated
    pdserve serve --model smollm2-135m --colocated 2              # chunked prefill, two mixed workers

Every flag can also come from a TOML file (`--config pdserve.toml`, keys spelled like the flags,
dashes or underscores); a flag given on the command line wins over the file. Ctrl-C or SIGTERM
stops the router and every worker it started: no process and no shared-memory segment is left.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import signal
import tomllib
from pathlib import Path
from typing import Any

from pdserve.config import POOL_ROLES, TRANSPORTS, EngineConfig, WorkerConfig
from pdserve.errors import PdserveError
from pdserve.pools.manager import PoolSettings, PoolSpec
from pdserve.router.app import RouterSettings
from pdserve.router.dispatch import RouterConfig

logger = logging.getLogger("pdserve.serve")

# name -> (type, default, help). One table: it makes the flags, checks the config file, and
# supplies the defaults, so the three never disagree.
# A prefill worker runs one chunk per step: a short prompt that arrives during a long prompt's
# chunk waits for the rest of it. 256 instead of 512 took SmolLM2's chat TTFT p50 with documents
# from 1.26x to 1.09x colocated and raised goodput, documents included (docs/performance.md, run B).
DEFAULT_PREFILL_CHUNK_SIZE = 256


def _default(cls: Any, name: str) -> Any:
    """A dataclass field's default: every default is written once, where it is used."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


_E, _W, _R, _P = EngineConfig, WorkerConfig, RouterConfig, PoolSettings

OPTIONS: dict[str, tuple[type, Any, str]] = {
    "model": (str, None, "built-in name (smollm2-135m), a .gguf file or a Hugging Face folder"),
    "prefill": (int, 0, "prefill workers (disaggregated)"),
    "decode": (int, 0, "decode workers (disaggregated)"),
    "colocated": (int, 0, "mixed workers with chunked prefill, instead of --prefill/--decode"),
    "transport": (str, _default(_W, "transport"), "KV transport between workers: shm, tcp or nixl"),
    "host": (str, "127.0.0.1", "address the HTTP server listens on"),
    "port": (int, 8000, "HTTP port"),
    "served_model_name": (str, None, "the model name clients send (default: --model)"),
    "threads": (int, 1, "torch threads per worker"),
    "pin_cpus": (bool, True, "pin each worker to its own CPU where the OS allows"),
    "dtype": (
        str,
        _default(_E, "dtype"),
        "auto (fp32 on CPUs without native bf16), float32, bfloat16, float16",
    ),
    "max_model_len": (int, None, "context length (default: the model's, within the KV cache)"),
    "num_kv_blocks": (int, None, "KV cache blocks per worker (default: from --kv-cache-memory-gib)"),
    "kv_cache_memory_gib": (float, _default(_E, "kv_cache_memory_gib"), "KV cache size per worker"),
    "block_size": (int, _default(_E, "block_size"), "tokens per KV block"),
    "max_num_seqs": (int, _default(_E, "max_num_seqs"), "requests running at once per worker"),
    "max_num_batched_tokens": (int, _default(_E, "max_num_batched_tokens"), "tokens per engine step"),
    "chunk_size": (
        int,
        _default(_E, "chunk_size"),
        "prompt tokens of one request per step (chunked prefill)",
    ),
    "prefill_chunk_size": (
        int,
        None,
        f"the prefill pool's chunk size (default: {DEFAULT_PREFILL_CHUNK_SIZE}, or --chunk-size if "
        "smaller); smaller lets a short prompt overtake a long one sooner",
    ),
    "local_prefill_threshold": (
        int,
        _default(_R, "local_prefill_threshold"),
        "prompts up to this many tokens are prefilled on the decode worker",
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
    "ready_timeout": (
        float,
        _default(_P, "start_timeout"),
        "seconds for a worker to load its model and report ready",
    ),
    "heartbeat_timeout": (
        float,
        _default(RouterSettings, "heartbeat_timeout"),
        "a worker whose connection is silent this long is taken out of service",
    ),
    "stall_timeout": (
        float,
        _default(RouterSettings, "stall_timeout"),
        "a worker that sends no load report this long (a hung engine) is taken out",
    ),
    "log_level": (str, _default(_W, "log_level"), "DEBUG, INFO, WARNING, ERROR"),
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
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=None, help="TOML file with any of these options")
    for name, (kind, default, help_text) in OPTIONS.items():
        flag = "--" + name.replace("_", "-")
        shown = "" if default is None else f" (default: {default})"
        if kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text + shown)
        else:
            p.add_argument(flag, type=kind, default=None, help=help_text + shown)


def resolve_options(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults, then the config file, then the command line. Raises PdserveError on bad input."""
    options = {name: default for name, (_, default, _) in OPTIONS.items()}
    if args.config is not None:
        options.update(_read_config(args.config))
    for name in OPTIONS:
        value = getattr(args, name)
        if value is not None:
            options[name] = value
    _check(options)
    return options


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
        if name not in OPTIONS:
            raise PdserveError(f"{path}: unknown option {key!r} (known: {', '.join(sorted(OPTIONS))})")
        kind = OPTIONS[name][0]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise PdserveError(f"{path}: {key} must be a {kind.__name__}, got {value!r}")
        result[name] = value
    return result


def _check(o: dict[str, Any]) -> None:
    if not o["model"]:
        raise PdserveError("--model is required (on the command line or in the config file)")
    if o["colocated"] and (o["prefill"] or o["decode"]):
        raise PdserveError("give either --colocated N or --prefill P --decode D, not both")
    if not o["colocated"] and (o["decode"] < 1 or max(o["prefill"], o["prefill_max"] or 0) < 1):
        raise PdserveError(
            "disaggregated serving needs --prefill >= 1 (or --prefill-max >= 1) and --decode >= 1 "
            "(or use --colocated N)"
        )
    if o["transport"] not in TRANSPORTS:
        raise PdserveError(f"--transport must be shm, tcp or nixl, got {o['transport']!r}")
    for name in ("prefill", "decode", "colocated", "threads", "max_retries"):
        if o[name] < 0:
            raise PdserveError(f"--{name.replace('_', '-')} must be >= 0")
    for pool, replicas in pool_replicas(o).items():
        low, high = pool_bounds(o, pool)
        if not 0 <= low <= replicas <= high:
            raise PdserveError(
                f"pool {pool}: need 0 <= --{pool}-min <= --{pool} <= --{pool}-max, got {low} <= {replicas} <= {high}"
            )
    if o["drain_timeout"] <= 0:
        raise PdserveError("--drain-timeout must be > 0")
    for pool in pool_replicas(o):  # a bad engine setting fails here, not in every worker
        try:
            worker_config(o, pool, "check")
        except ValueError as exc:
            raise PdserveError(str(exc)) from None


def pool_replicas(o: dict[str, Any]) -> dict[str, int]:
    """Each pool's workers at start."""
    if o["colocated"]:
        return {"colocated": o["colocated"]}
    return {"prefill": o["prefill"], "decode": o["decode"]}


def worker_config(
    o: dict[str, Any], pool: str, worker_id: str, eos_token_ids: tuple[int, ...] | None = None
) -> WorkerConfig:
    """The configuration of a new worker of `pool`: the shared settings, then the pool's own."""
    role = POOL_ROLES[pool]
    chunk = o["chunk_size"]
    if pool == "prefill":  # the prefill pool's own chunk size (see DEFAULT_PREFILL_CHUNK_SIZE)
        chunk = o["prefill_chunk_size"] or min(o["chunk_size"], DEFAULT_PREFILL_CHUNK_SIZE)
    engine = EngineConfig(
        model=o["model"],
        dtype=o["dtype"],
        role=role,
        block_size=o["block_size"],
        num_kv_blocks=o["num_kv_blocks"],
        kv_cache_memory_gib=o["kv_cache_memory_gib"],
        max_model_len=o["max_model_len"],
        max_num_seqs=o["max_num_seqs"],
        max_num_batched_tokens=o["max_num_batched_tokens"],
        chunk_size=chunk,
        threads=o["threads"],
    )
    return WorkerConfig(
        worker_id=worker_id,
        pool=pool,
        engine=engine,
        transport=o["transport"],
        lease_seconds=o["lease_seconds"],
        kv_pull_timeout=o["kv_pull_timeout"],
        kv_fault_rate=o["kv_fault_rate"],
        log_level=o["log_level"],
        eos_token_ids=eos_token_ids,
    )


def pool_bounds(o: dict[str, Any], pool: str) -> tuple[int, int]:
    """(min, max) of a pool; each defaults to its start count."""
    replicas = pool_replicas(o)[pool]
    low, high = o[f"{pool}_min"], o[f"{pool}_max"]
    return (replicas if low is None else low, replicas if high is None else high)


def pool_specs(o: dict[str, Any], eos_token_ids: tuple[int, ...] | None = None) -> list[Any]:
    return [
        PoolSpec(
            pool,
            replicas,
            *pool_bounds(o, pool),
            functools.partial(worker_config, o, pool, eos_token_ids=eos_token_ids),
        )
        for pool, replicas in pool_replicas(o).items()
    ]


def run(o: dict[str, Any]) -> int:
    import uvicorn

    from pdserve.cluster.local import LocalCluster
    from pdserve.models.config import ModelConfig
    from pdserve.models.source import generation_eos_ids, resolve_model
    from pdserve.pools.manager import PoolManager
    from pdserve.router.app import Router
    from pdserve.router.tokenizer import load_router_tokenizer

    logging.basicConfig(level=o["log_level"], format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Everything that can fail on bad input fails here, before a worker starts.
    source = resolve_model(o["model"])
    tokenizer = load_router_tokenizer(source)
    eos = generation_eos_ids(source, ModelConfig.from_hf_dict(source.hf_config), tokenizer)
    specs = pool_specs(o, tuple(eos))

    settings = RouterSettings(
        model_name=o["served_model_name"] or o["model"],
        config=RouterConfig(
            local_prefill_threshold=o["local_prefill_threshold"],
            max_retries=o["max_retries"],
            prefill_timeout=o["prefill_timeout"],
            token_timeout=o["token_timeout"],
            max_in_flight=o["max_in_flight"],
        ),
        heartbeat_timeout=o["heartbeat_timeout"],
        stall_timeout=o["stall_timeout"],
    )
    router = Router(settings, tokenizer, eos)
    pools = PoolManager(
        LocalCluster(pin_cpus=o["pin_cpus"]),
        router.workers,
        router.metrics,
        specs,
        PoolSettings(
            start_timeout=o["ready_timeout"],
            drain_timeout=o["drain_timeout"],
            rebalance_on_start=o["rebalance_on_start"],
            replace_failed=o["replace_failed"],
        ),
    )
    router.attach_pools(pools)
    config = uvicorn.Config(
        router.app,
        host=o["host"],
        port=o["port"],
        log_level=o["log_level"].lower(),
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return asyncio.run(_serve(_server_class()(config), pools))


async def _serve(server: Any, pools: Any) -> int:
    """Start the pools (Ctrl-C or SIGTERM stops that too), serve until a signal, stop every worker."""
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupted.set)
    try:
        try:
            await pools.start(abort=lambda: "interrupted" if interrupted.is_set() else None)
        except PdserveError as exc:
            logger.log(logging.WARNING if interrupted.is_set() else logging.ERROR, "%s", exc)
            return 1
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        await server.serve()  # its own signal handlers from here on
        return 0 if server.started else 1
    finally:
        await pools.close()


def _server_class() -> type:
    import contextlib
    import signal
    from collections.abc import Iterator

    import uvicorn

    class Server(uvicorn.Server):
        """uvicorn re-raises SIGINT/SIGTERM after its graceful shutdown, which would kill this
        process before it stops its workers. Here the signal only starts the shutdown; `run`
        then stops the workers and returns 0."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

    return Server
