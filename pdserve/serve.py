"""`pdserve serve`: the router and its workers on this host (the `local` cluster backend). No torch.

    pdserve serve --model smollm2-135m --prefill 1 --decode 1     # disaggregated
    pdserve serve --model smollm2-135m --colocated 2              # chunked prefill, two mixed workers

Every flag can also come from a TOML file (`--config pdserve.toml`, keys spelled like the flags,
dashes or underscores); a flag given on the command line wins over the file. Ctrl-C or SIGTERM
stops the router and every worker it started: no process and no shared-memory segment is left.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tomllib
from pathlib import Path
from typing import Any

from pdserve.errors import PdserveError

logger = logging.getLogger("pdserve.serve")

# name -> (type, default, help). One table: it makes the flags, checks the config file, and
# supplies the defaults, so the three never disagree.
# A prefill worker runs one chunk per step: a short prompt that arrives during a long prompt's
# chunk waits for the rest of it. 256 instead of 512 took SmolLM2's chat TTFT p50 with documents
# from 1.26x to 1.09x colocated and raised goodput, documents included (docs/performance.md, run B).
DEFAULT_PREFILL_CHUNK_SIZE = 256

OPTIONS: dict[str, tuple[type, Any, str]] = {
    "model": (str, None, "built-in name (smollm2-135m), a .gguf file or a Hugging Face folder"),
    "prefill": (int, 0, "prefill workers (disaggregated)"),
    "decode": (int, 0, "decode workers (disaggregated)"),
    "colocated": (int, 0, "mixed workers with chunked prefill, instead of --prefill/--decode"),
    "transport": (str, "shm", "KV transport between prefill and decode workers: shm, tcp or nixl"),
    "host": (str, "127.0.0.1", "address the HTTP server listens on"),
    "port": (int, 8000, "HTTP port"),
    "served_model_name": (str, None, "the model name clients send (default: --model)"),
    "threads": (int, 1, "torch threads per worker"),
    "pin_cpus": (bool, True, "pin each worker to its own CPU where the OS allows"),
    "dtype": (str, "auto", "auto (fp32 on CPUs without native bf16), float32, bfloat16, float16"),
    "max_model_len": (int, None, "context length (default: the model's, within the KV cache)"),
    "num_kv_blocks": (int, None, "KV cache blocks per worker (default: from --kv-cache-memory-gib)"),
    "kv_cache_memory_gib": (float, 1.0, "KV cache size per worker"),
    "block_size": (int, 16, "tokens per KV block"),
    "max_num_seqs": (int, 64, "requests running at once per worker"),
    "max_num_batched_tokens": (int, 2048, "tokens per engine step"),
    "chunk_size": (int, 512, "prompt tokens of one request per step (chunked prefill)"),
    "prefill_chunk_size": (
        int,
        None,
        f"the prefill pool's chunk size (default: {DEFAULT_PREFILL_CHUNK_SIZE}, or --chunk-size if "
        "smaller); smaller lets a short prompt overtake a long one sooner",
    ),
    "local_prefill_threshold": (int, 16, "prompts up to this many tokens are prefilled on the decode worker"),
    "max_retries": (int, 2, "re-prefills of a request (dead prefill worker, failed KV transfer)"),
    "prefill_timeout": (float, 300.0, "seconds from sending a prompt to its first token"),
    "token_timeout": (float, 60.0, "longest wait for the next token of a stream"),
    "max_in_flight": (int, 512, "requests admitted at once; more get 429"),
    "lease_seconds": (float, 30.0, "prefilled KV blocks are freed after this without a release"),
    "kv_pull_timeout": (float, 10.0, "seconds for one KV transfer"),
    "kv_fault_rate": (float, 0.0, "fault tests only: share of KV transfers to drop on purpose"),
    "ready_timeout": (float, 600.0, "seconds to wait for every worker to load its model"),
    "heartbeat_timeout": (
        float,
        3.0,
        "a worker whose connection is silent this long is taken out of service",
    ),
    "stall_timeout": (
        float,
        60.0,
        "a worker that sends no load report this long (a hung engine) is taken out",
    ),
    "log_level": (str, "INFO", "DEBUG, INFO, WARNING, ERROR"),
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
    if not o["colocated"] and (o["prefill"] < 1 or o["decode"] < 1):
        raise PdserveError(
            "disaggregated serving needs --prefill >= 1 and --decode >= 1 (or use --colocated N)"
        )
    if o["transport"] not in ("shm", "tcp", "nixl"):
        raise PdserveError(f"--transport must be shm, tcp or nixl, got {o['transport']!r}")
    for name in ("prefill", "decode", "colocated", "threads", "max_retries"):
        if o[name] < 0:
            raise PdserveError(f"--{name.replace('_', '-')} must be >= 0")


def worker_specs(o: dict[str, Any]) -> list[Any]:
    from pdserve.cluster.local import WorkerSpec

    if o["colocated"]:
        return [WorkerSpec(f"mixed-{i}", "mixed") for i in range(o["colocated"])]
    # The prefill pool's own chunk size: later flags win, so this overrides --chunk-size there.
    chunk = o["prefill_chunk_size"] or min(o["chunk_size"], DEFAULT_PREFILL_CHUNK_SIZE)
    prefill_args = () if chunk == o["chunk_size"] else ("--chunk-size", str(chunk))
    return [WorkerSpec(f"prefill-{i}", "prefill", prefill_args) for i in range(o["prefill"])] + [
        WorkerSpec(f"decode-{i}", "decode") for i in range(o["decode"])
    ]


def worker_args(o: dict[str, Any]) -> list[str]:
    args = ["--transport", o["transport"], "--dtype", o["dtype"], "--threads", str(o["threads"])]
    for name in (
        "max_model_len", "num_kv_blocks", "kv_cache_memory_gib", "block_size", "max_num_seqs",
        "max_num_batched_tokens", "chunk_size", "lease_seconds", "kv_pull_timeout", "kv_fault_rate",
    ):  # fmt: skip
        if o[name] is not None:
            args += ["--" + name.replace("_", "-"), str(o[name])]
    return [*args, "--log-level", o["log_level"]]


def run(o: dict[str, Any]) -> int:
    import uvicorn

    from pdserve.cluster.local import LocalCluster
    from pdserve.models.config import ModelConfig
    from pdserve.models.source import generation_eos_ids, resolve_model
    from pdserve.router.app import Router, RouterSettings
    from pdserve.router.dispatch import RouterConfig
    from pdserve.router.tokenizer import load_router_tokenizer

    logging.basicConfig(level=o["log_level"], format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    # Everything that can fail on bad input fails here, before a worker starts.
    source = resolve_model(o["model"])
    tokenizer = load_router_tokenizer(source)
    eos = generation_eos_ids(source, ModelConfig.from_hf_dict(source.hf_config), tokenizer)

    cluster = LocalCluster(o["model"], worker_specs(o), worker_args(o), pin_cpus=o["pin_cpus"])
    try:
        cluster.start()
        settings = RouterSettings(
            model_name=o["served_model_name"] or o["model"],
            workers=cluster.addresses(),
            config=RouterConfig(
                local_prefill_threshold=o["local_prefill_threshold"],
                max_retries=o["max_retries"],
                prefill_timeout=o["prefill_timeout"],
                token_timeout=o["token_timeout"],
                max_in_flight=o["max_in_flight"],
            ),
            ready_timeout=o["ready_timeout"],
            heartbeat_timeout=o["heartbeat_timeout"],
            stall_timeout=o["stall_timeout"],
        )
        holder: list[Any] = []  # the uvicorn server, made after the router

        def startup_abort() -> str | None:
            if holder and holder[0].should_exit:  # Ctrl-C while the workers load their model
                return "interrupted"
            return _startup_failure(cluster)

        router = Router(settings, tokenizer, eos, startup_abort=startup_abort)
        config = uvicorn.Config(
            router.app,
            host=o["host"],
            port=o["port"],
            log_level=o["log_level"].lower(),
            access_log=False,
            timeout_graceful_shutdown=5,
        )
        server = _server_class()(config)
        holder.append(server)
        asyncio.run(_serve(server, cluster))
        return 0 if server.started else 1
    finally:
        cluster.stop()


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


def _startup_failure(cluster: Any) -> str | None:
    gone = cluster.exited()
    if not gone:
        return None
    return ", ".join(f"worker {w.spec.worker_id} exited with code {w.process.returncode}" for w in gone)


async def _serve(server: Any, cluster: Any) -> None:
    """Runs uvicorn, and logs each worker that dies while serving."""

    async def watch_workers() -> None:
        while not server.should_exit:
            cluster.exited()  # logs each death once; the router has already routed around it
            await asyncio.sleep(1.0)

    watcher = asyncio.create_task(watch_workers())
    try:
        await server.serve()
    finally:
        watcher.cancel()
