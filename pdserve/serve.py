"""`pdserve serve`: the router and its pools of workers (the `local` or `ray` cluster backend). No torch.

    pdserve serve --model smollm2-135m --prefill 1 --decode 1     # disaggregated
    pdserve serve --model smollm2-135m --colocated 2              # chunked prefill, two mixed workers

Every flag can also come from a TOML file (`--config pdserve.toml`, keys spelled like the flags,
dashes or underscores); a flag given on the command line wins over the file. Ctrl-C or SIGTERM
stops the router and every worker it started: no process and no shared-memory segment is left.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import os
import signal
import socket
from typing import Any

from pdserve import devices, serve_options
from pdserve.cluster.base import ClusterBackend
from pdserve.config import (
    DEFAULT_PREFILL_CHUNK_SIZE,
    KV_CHECKSUM_MODES,
    POOL_ROLES,
    TRANSPORTS,
    EngineConfig,
    WorkerConfig,
)
from pdserve.errors import PdserveError
from pdserve.ops.cpu import isa as cpu_isa
from pdserve.planner.law import LawSettings
from pdserve.planner.loop import MODES, PlannerSettings
from pdserve.pools.manager import PoolSettings, PoolSpec
from pdserve.router.app import RouterSettings
from pdserve.router.config import PATH_CHOICES, RouterConfig
from pdserve.security import DeploymentSecrets
from pdserve.serve_keys import access_keys, warn_if_exposed
from pdserve.slo import SLO, parse_slo

logger = logging.getLogger("pdserve.serve")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

add_arguments = serve_options.add_arguments


def resolve_options(args: argparse.Namespace) -> dict[str, Any]:
    """Defaults, then the config file, then the command line. Raises PdserveError on bad input."""
    options = serve_options.layered(args)
    _resolve_devices(options)
    _check(options)
    return options


def _resolve_devices(o: dict[str, Any]) -> None:
    """Sets o["device_type"] (cpu or cuda), o["pool_gpus"] (each pool's GPU list) and the transport
    (the one asked for, if it can serve the workers' caches; else the device's default)."""
    pools = list(pool_replicas(o))
    given = {pool: o[f"{pool}_gpus"] or o["pools"].get(pool, {}).get("gpus") for pool in pools}
    ray_gpus = {p: ray_placements(o)[p].num_gpus for p in pools} if o["cluster"] == "ray" else None
    o["device_type"], o["pool_gpus"] = devices.place(o["device"], given, ray_gpus, devices.cuda_gpu_count)
    o["transport"] = devices.transport_for(o["device_type"], o["transport"], o["same_node_kv"])
    for pool in pools:
        devices.check_sm_share(sm_share(o, pool), f"--{pool}-sm-share", o["device_type"])


def sm_share(o: dict[str, Any], pool: str) -> int | None:
    """A pool's share of its GPU's multiprocessors: the flag, else its table's."""
    share: int | None = o[f"{pool}_sm_share"]
    return share if share is not None else o["pools"].get(pool, {}).get("sm_share")


def _check(o: dict[str, Any]) -> None:
    # A PDSERVE_CPU_ISA that names no level fails here, not in every worker (torch-free check).
    cpu_isa.requested_cap()
    if not o["model"]:
        raise PdserveError("--model is required (on the command line or in the config file)")
    o["log_level"] = str(o["log_level"]).upper()  # `debug` as well as `DEBUG`
    if o["log_level"] not in LOG_LEVELS:
        raise PdserveError(
            f"--log-level must be one of {', '.join(LOG_LEVELS)}, got {o['log_level'].lower()!r}"
        )
    if o["colocated"] and (o["prefill"] or o["decode"]):
        raise PdserveError("give either --colocated N or --prefill P --decode D, not both")
    if not o["colocated"] and (o["decode"] < 1 or max(o["prefill"], o["prefill_max"] or 0) < 1):
        raise PdserveError(
            "disaggregated serving needs --prefill >= 1 (or --prefill-max >= 1) and --decode >= 1 "
            "(or use --colocated N)"
        )
    if o["transport"] not in TRANSPORTS:
        raise PdserveError(f"--transport must be shm, tcp or nixl, got {o['transport']!r}")
    if o["kv_checksum"] not in KV_CHECKSUM_MODES:
        raise PdserveError(f"--kv-checksum must be auto, on or off, got {o['kv_checksum']!r}")
    for name in ("kv_fault_rate", "kv_corrupt_rate"):
        if not 0.0 <= o[name] <= 1.0:
            raise PdserveError(f"--{name.replace('_', '-')} must be in [0, 1], got {o[name]}")
    if o["cluster"] not in ("local", "ray"):
        raise PdserveError(f"--cluster must be local or ray, got {o['cluster']!r}")
    if o["same_node_kv"] not in SAME_NODE_KV:
        raise PdserveError(f"--same-node-kv must be auto, shm or off, got {o['same_node_kv']!r}")
    if o["cluster"] == "ray":
        if o["transport"] == "shm":
            raise PdserveError(
                "--cluster ray needs --transport tcp (or nixl): shm works on one host only "
                "(workers on one node still pull over shm: see --same-node-kv)"
            )
        ray_placements(o)  # raises on bad JSON, strategy or amounts
        if o["planner"] == "slo" and o["max_workers"] is None:
            # The default (this host's CPUs) says nothing of a cluster's size.
            raise PdserveError(
                "--planner slo with --cluster ray needs --max-workers: the worker budget over all "
                "pools, which this host's CPUs do not tell for a Ray cluster"
            )
    if o["kv_corrupt_rate"] > 0 and o["kv_checksum"] == "off":
        raise PdserveError(
            "--kv-corrupt-rate with --kv-checksum off would send clients wrong tokens: drop one"
        )
    for name in ("prefill", "decode", "colocated", "threads", "max_retries"):
        if o[name] < 0:
            raise PdserveError(f"--{name.replace('_', '-')} must be >= 0")
    for pool, replicas in pool_replicas(o).items():
        low, high = pool_bounds(o, pool)
        if not 0 <= low <= replicas <= high:
            raise PdserveError(
                f"pool {pool}: need 0 <= --{pool}-min <= --{pool} <= --{pool}-max, got {low} <= {replicas} <= {high}"
            )
    access_keys(o)  # a bad key file fails here
    if o["max_body_bytes"] < 1024 or o["body_timeout"] <= 0:
        raise PdserveError("--max-body-bytes must be >= 1024 and --body-timeout > 0")
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
    chunk = o["chunk_size"]  # None: the engine's default for its device and role
    if pool == "prefill" and o["prefill_chunk_size"]:
        chunk = o["prefill_chunk_size"]
    elif pool == "prefill" and chunk:  # never above the prefill default (DEFAULT_PREFILL_CHUNK_SIZE)
        chunk = min(chunk, DEFAULT_PREFILL_CHUNK_SIZE)
    chunk = own.get("chunk_size", chunk)
    engine = EngineConfig(
        model=o["model"],
        device=o["device_type"],
        dtype=o["dtype"],
        role=role,
        block_size=o["block_size"],
        num_kv_blocks=o["num_kv_blocks"],
        kv_cache_memory_gib=o["kv_cache_memory_gib"],
        gpu_memory_utilization=own.get("gpu_memory_utilization", o["gpu_memory_utilization"]),
        max_model_len=o["max_model_len"],
        max_num_seqs=own.get("max_num_seqs", o["max_num_seqs"]),
        max_num_batched_tokens=own.get("max_num_batched_tokens", o["max_num_batched_tokens"]),
        chunk_size=chunk,
        threads=o["threads"],
        cuda_graphs=o["cuda_graphs"],
        attention_backend=o["attention_backend"],
        prefix_cache=o["prefix_cache"],
    )
    return WorkerConfig(
        worker_id=worker_id,
        pool=pool,
        engine=engine,
        transport=o["transport"],
        gpu=devices.worker_gpu(o["pool_gpus"].get(pool, ()), worker_id),
        sm_share=sm_share(o, pool),
        same_node_shm=same_node_shm(o),
        lease_seconds=o["lease_seconds"],
        kv_pull_timeout=o["kv_pull_timeout"],
        kv_fault_rate=o["kv_fault_rate"],
        kv_corrupt_rate=o["kv_corrupt_rate"],
        kv_checksum=o["kv_checksum"],
        prefill_interrupts=o["prefill_interrupts"],
        log_level=o["log_level"],
        eos_token_ids=eos_token_ids,
    )


SAME_NODE_KV = ("auto", "shm", "off")


def same_node_shm(o: dict[str, Any]) -> bool:
    """Whether tcp / nixl workers also keep their KV in shared memory, for the workers on their
    own node (auto: with --cluster ray, where a node may hold several; on one host --transport
    already names what every pair uses)."""
    if o["transport"] == "shm" or o["same_node_kv"] == "off" or o["device_type"] == "cuda":
        return False  # (a GPU's cache is not in host memory)
    return bool(o["same_node_kv"] == "shm" or o["cluster"] == "ray")


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

    return o["max_workers"] if o["max_workers"] is not None else max(1, os.cpu_count() or 1)


def router_slo(o: dict[str, Any]) -> SLO:
    return parse_slo(o["slo"], o["slo_percentile"])


def _pool_slo_given(o: dict[str, Any], pool: str) -> bool:
    own = o["pools"].get(pool, {})
    return "slo_ttft_ms" in own or "slo_itl_ms" in own


def pool_settings(o: dict[str, Any]) -> PoolSettings:
    return PoolSettings(
        start_timeout=o["ready_timeout"],
        drain_timeout=o["drain_timeout"],
        rebalance_on_start=o["rebalance_on_start"],
        replace_failed=o["replace_failed"],
    )


def router_config(o: dict[str, Any]) -> RouterConfig:
    return RouterConfig(
        path_choice=o["path_choice"],
        local_prefill_threshold=o["local_prefill_threshold"],
        max_retries=o["max_retries"],
        prefill_timeout=o["prefill_timeout"],
        token_timeout=o["token_timeout"],
        max_in_flight=o["max_in_flight"],
        max_queued_prompt_tokens=o["max_queued_prompt_tokens"],
        slo=router_slo(o).override(
            None, o["pools"].get("decode", o["pools"].get("colocated", {})).get("slo_itl_ms")
        ),
        reject_on_slo_miss=o["reject_on_slo_miss"],
        slo_reject_factor=o["slo_reject_factor"],
    )


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


def ray_placements(o: dict[str, Any]) -> dict[str, Any]:
    """--cluster ray: each pool's RayPlacement (resources per worker, CPUs, GPUs, strategy). The
    more specific setting wins: --ray-POOL-resources over [pools.POOL.ray] resources, and that
    table's num_cpus / num_gpus / strategy over --ray-num-cpus / --ray-num-gpus / --ray-strategy."""
    from pdserve.cluster.ray_backend import RayPlacement, parse_resources

    placements = {}
    for pool in POOL_ROLES:
        table = o["pools"].get(pool, {}).get("ray", {})
        flag = o[f"ray_{pool}_resources"]
        resources = parse_resources(flag, f"--ray-{pool}-resources") if flag else table.get("resources", {})
        placements[pool] = RayPlacement(
            resources={k: float(v) for k, v in resources.items()},
            num_cpus=float(table.get("num_cpus", o["ray_num_cpus"])),
            num_gpus=float(table.get("num_gpus", o["ray_num_gpus"])),
            strategy=table.get("strategy", o["ray_strategy"]),
        )
    return placements


def cluster_backend(o: dict[str, Any], secrets: DeploymentSecrets) -> ClusterBackend:
    """The ClusterBackend that --cluster names."""
    if o["cluster"] == "ray":
        from pdserve.cluster.ray_backend import RayCluster

        return RayCluster(secrets.for_workers(), o["ray_address"], ray_placements(o))
    from pdserve.cluster.local import LocalCluster

    return LocalCluster(secrets.for_workers(), pin_cpus=o["pin_cpus"])


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

    from pdserve.modelfiles.config import ModelConfig
    from pdserve.modelfiles.source import generation_eos_ids, resolve_model
    from pdserve.planner.loop import Planner
    from pdserve.pools.manager import PoolManager
    from pdserve.router.app import Router, RouterParts
    from pdserve.router.channel import ZmqConnector
    from pdserve.router.dispatch import Dispatcher
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.workers import WorkerSet
    from pdserve.signals import Signals
    from pdserve.text.tokenizer import load_router_tokenizer

    logging.basicConfig(level=o["log_level"], format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Everything that can fail on bad input fails here, before a worker starts. The HTTP port
    # first: held from now on, so a port in use is said at once, not after the workers have
    # loaded, and no worker's transport can take it while they start (each binds an ephemeral
    # port; a port the caller had just found free could be handed to one of them).
    listener = http_socket(o["host"], o["port"])
    source = resolve_model(o["model"])
    tokenizer = load_router_tokenizer(source)
    eos = generation_eos_ids(source, ModelConfig.from_hf_dict(source.hf_config), tokenizer)
    specs = pool_specs(o, tuple(eos))
    keys = access_keys(o)
    warn_if_exposed(o["host"], keys)

    settings = RouterSettings(
        model_name=o["served_model_name"] or o["model"],
        config=router_config(o),
        keys=keys,
        max_body_bytes=o["max_body_bytes"],
        body_timeout=o["body_timeout"],
        step_trace=o["step_trace"],
    )
    secrets = DeploymentSecrets.generate()  # in memory only: a restart makes new ones
    # The router's parts, each given what it works on (nothing reaches into another afterwards).
    metrics = RouterMetrics()
    workers = WorkerSet(
        ZmqConnector(secrets.router, heartbeat_timeout=o["heartbeat_timeout"]),
        stall_timeout=o["stall_timeout"],
    )
    signals = Signals()
    pools = PoolManager(
        cluster_backend(o, secrets),
        workers,
        metrics,
        specs,
        pool_settings(o),
    )
    planner = Planner(planner_settings(o), signals, workers, pools, metrics)
    dispatcher = Dispatcher(workers, settings.config, metrics, signals, at_bounds=planner.at_bounds)
    router = Router(settings, tokenizer, eos, RouterParts(workers, dispatcher, signals, metrics, pools))
    pools.describers["planner"] = planner.describe
    pools.describers["signals"] = router.describe_signals
    from pdserve.router.http_limits import BoundedHttpToolsProtocol

    config = uvicorn.Config(
        router.app,
        http=BoundedHttpToolsProtocol,  # httptools, with a bound on the request head (431)
        host=o["host"],
        port=o["port"],
        log_level=o["log_level"].lower(),
        access_log=False,
        timeout_graceful_shutdown=5,
    )
    return asyncio.run(_serve(_server_class()(config), listener, pools, planner))


def http_socket(host: str, port: int) -> socket.socket:
    """The API's socket, bound (not yet listening: a client is refused until the workers are up,
    rather than left waiting in the backlog). Port 0 takes a free port; the start line names it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # SO_REUSEADDR: a restart may bind while the last run's connections are in TIME_WAIT; it
    # still refuses a port another process listens on.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise PdserveError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


async def _serve(server: Any, listener: socket.socket, pools: Any, planner: Any) -> int:
    """Start the pools (Ctrl-C or SIGTERM stops that too), serve until a signal, stop every worker."""
    loop = asyncio.get_running_loop()
    interrupted = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, interrupted.set)
    try:
        try:
            connect = getattr(pools.backend, "connect", None)  # --cluster ray: join it, or say why not
            if connect is not None:
                await connect()
            await pools.start(abort=lambda: "interrupted" if interrupted.is_set() else None)
        except PdserveError as exc:
            logger.log(logging.WARNING if interrupted.is_set() else logging.ERROR, "%s", exc)
            return 1
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
        planner.start()
        await server.serve(sockets=[listener])  # its own signal handlers from here on
        return 0 if server.started else 1
    finally:
        listener.close()
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
