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
from pdserve.planner.law import LawSettings
from pdserve.planner.loop import MODES, PlannerSettings
from pdserve.pools.manager import PoolSettings, PoolSpec
from pdserve.router.app import RouterSettings
from pdserve.router.dispatch import PATH_CHOICES, RouterConfig
from pdserve.slo import DEFAULT_PERCENTILE, SLO, parse_slo

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
    # The planner and the SLOs (pdserve.planner; docs/operations.md).
    "planner": (
        str,
        "off",
        "slo: size each pool from its phase's pressure against --slo; off: pools stay put",
    ),
    "slo": (str, None, "SLOs in ms, e.g. ttft=1000,itl=100 (the planner, the path choice, admission)"),
    "slo_percentile": (float, DEFAULT_PERCENTILE, "the percentile the SLOs hold at (0.9: p90)"),
    "max_workers": (int, None, "the planner's worker budget over all pools (default: this host's CPUs)"),
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
}
POOL_TABLE_ALIASES = {"mixed": "colocated"}


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
    options: dict[str, Any] = {name: default for name, (_, default, _) in OPTIONS.items()}
    options["pools"] = {}
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
        if name == "pools":
            result["pools"] = _read_pool_tables(path, value)
            continue
        if name not in OPTIONS:
            raise PdserveError(f"{path}: unknown option {key!r} (known: {', '.join(sorted(OPTIONS))})")
        kind = OPTIONS[name][0]
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
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
            if not isinstance(value, kind) or isinstance(value, bool):
                raise PdserveError(
                    f"{path}: [pools.{pool_key}] {key} must be a {kind.__name__}, got {value!r}"
                )
            settings[name] = value
        ignored = {"prefill": "slo_itl_ms", "decode": "slo_ttft_ms"}.get(pool)
        if ignored in settings:
            raise PdserveError(
                f"{path}: [pools.{pool_key}] {ignored}: the {pool} pool is planned by its "
                f"{'TTFT' if pool == 'prefill' else 'ITL'} only (give the other in the other pool)"
            )
        result[pool] = settings
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
    unused = set(o["pools"]) - set(pool_replicas(o))
    if unused:
        raise PdserveError(
            f"the config file sets [pools.{sorted(unused)[0]}], a pool this deployment does not have"
        )
    if o["path_choice"] not in PATH_CHOICES:
        raise PdserveError(
            f"--path-choice must be one of {', '.join(PATH_CHOICES)}, got {o['path_choice']!r}"
        )
    if o["planner"] not in MODES:
        raise PdserveError(f"--planner must be one of {', '.join(MODES)}, got {o['planner']!r}")
    slo = router_slo(o)
    if o["planner"] == "slo" and not slo.given and not any(_pool_slo_given(o, p) for p in pool_replicas(o)):
        raise PdserveError("--planner slo needs an SLO to plan for: --slo ttft=MS,itl=MS")
    if o["reject_on_slo_miss"] and slo.ttft_s is None:
        raise PdserveError("--reject-on-slo-miss needs a TTFT SLO: --slo ttft=MS")
    if o["slo_reject_factor"] < 1:
        raise PdserveError("--slo-reject-factor must be >= 1")
    try:
        planner_settings(o)
    except ValueError as exc:
        raise PdserveError(str(exc)) from None
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
    own = o["pools"].get(pool, {})
    chunk = o["chunk_size"]
    if pool == "prefill":  # the prefill pool's own chunk size (see DEFAULT_PREFILL_CHUNK_SIZE)
        chunk = o["prefill_chunk_size"] or min(o["chunk_size"], DEFAULT_PREFILL_CHUNK_SIZE)
    chunk = own.get("chunk_size", chunk)
    engine = EngineConfig(
        model=o["model"],
        dtype=o["dtype"],
        role=role,
        block_size=o["block_size"],
        num_kv_blocks=o["num_kv_blocks"],
        kv_cache_memory_gib=o["kv_cache_memory_gib"],
        max_model_len=o["max_model_len"],
        max_num_seqs=own.get("max_num_seqs", o["max_num_seqs"]),
        max_num_batched_tokens=own.get("max_num_batched_tokens", o["max_num_batched_tokens"]),
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
    """(min, max) of a pool: the flags, else its [pools.X] table, else its start count (with
    --planner slo: min 1 (0 if it starts empty) and max the worker budget)."""
    replicas = pool_replicas(o)[pool]
    own = o["pools"].get(pool, {})
    low = o[f"{pool}_min"] if o[f"{pool}_min"] is not None else own.get("min")
    high = o[f"{pool}_max"] if o[f"{pool}_max"] is not None else own.get("max")
    if o["planner"] == "slo":
        default_low, default_high = min(replicas, 1), max(replicas, max_workers(o))
    else:
        default_low = default_high = replicas
    return (default_low if low is None else low, default_high if high is None else high)


def max_workers(o: dict[str, Any]) -> int:
    import os

    return o["max_workers"] if o["max_workers"] is not None else max(1, os.cpu_count() or 1)


def router_slo(o: dict[str, Any]) -> SLO:
    return parse_slo(o["slo"], o["slo_percentile"])


def _pool_slo_given(o: dict[str, Any], pool: str) -> bool:
    own = o["pools"].get(pool, {})
    return "slo_ttft_ms" in own or "slo_itl_ms" in own


def planner_settings(o: dict[str, Any]) -> PlannerSettings:
    slo = router_slo(o)
    pool_slos = {
        pool: slo.override(o["pools"][pool].get("slo_ttft_ms"), o["pools"][pool].get("slo_itl_ms"))
        for pool in pool_replicas(o)
        if _pool_slo_given(o, pool)
    }
    return PlannerSettings(
        mode=o["planner"],
        slo=slo,
        pool_slos=pool_slos,
        interval_s=o["planner_interval"],
        max_workers=max_workers(o),
        law=LawSettings(cooldown_s=o["planner_cooldown"], downscale_window_s=o["planner_downscale_window"]),
    )


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
    from pdserve.planner.loop import Planner
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
            path_choice=o["path_choice"],
            local_prefill_threshold=o["local_prefill_threshold"],
            max_retries=o["max_retries"],
            prefill_timeout=o["prefill_timeout"],
            token_timeout=o["token_timeout"],
            max_in_flight=o["max_in_flight"],
            slo=router_slo(o).override(
                None, o["pools"].get("decode", o["pools"].get("colocated", {})).get("slo_itl_ms")
            ),
            reject_on_slo_miss=o["reject_on_slo_miss"],
            slo_reject_factor=o["slo_reject_factor"],
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
    planner = Planner(planner_settings(o), router.signals, router.workers, pools, router.metrics)
    router.dispatcher.at_bounds = planner.at_bounds
    pools.describers["planner"] = planner.describe
    pools.describers["signals"] = router.describe_signals
    config = uvicorn.Config(
        router.app,
        host=o["host"],
        port=o["port"],
        log_level=o["log_level"].lower(),
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return asyncio.run(_serve(_server_class()(config), pools, planner))


async def _serve(server: Any, pools: Any, planner: Any) -> int:
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
        planner.start()
        await server.serve()  # its own signal handlers from here on
        return 0 if server.started else 1
    finally:
        await planner.close()
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
