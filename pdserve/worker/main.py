"""`python -m pdserve.worker`: one engine in one role, serving the control RPC.

Started by a cluster backend, which hands it a `WorkerConfig` as JSON in `PDSERVE_WORKER_CONFIG`
(or, by hand, `--config worker.json`), and its secrets in `PDSERVE_WORKER_SECRETS` (the router keys
it obeys and the deployment's KV secret, pdserve.security; it will not start without them). Once its model is loaded and its RPC socket bound, it writes
its `Ready` (with the address it bound) as one JSON line to the fd in `PDSERVE_READY_FD`, if any.
Stops on a Shutdown message, SIGTERM or SIGINT, and removes its shared-memory KV segment (or
stops its KV server) on the way out.

KV transports (`transport`, the same on every worker of a deployment):
- `shm`: same host; a worker's KV cache lives in /dev/shm, other workers copy out of it.
- `tcp`: across hosts; a worker serves leased blocks on `kv_host`:`kv_port`.
- `nixl`: NIXL (UCX) reads of a worker's registered cache; needs `pip install pdserve[nixl]`.
With `same_node_shm` a tcp or nixl worker keeps its cache in /dev/shm as well, and a pull from a
worker on the same node (`node_id`) copies from there: the transport is chosen per pair.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from pdserve import wire
from pdserve.config import WORKER_CONFIG_ENV, WORKER_PARENT_ENV, WORKER_READY_FD_ENV, Role, WorkerConfig
from pdserve.errors import PdserveError
from pdserve.security import take_worker_secrets

if TYPE_CHECKING:  # the worker loads torch only after its configuration is valid
    import torch

    from pdserve.transfer.base import FaultInjector, KVExporter, KVImporter

logger = logging.getLogger("pdserve.worker")


def load_config(argv: list[str] | None = None) -> WorkerConfig:
    p = argparse.ArgumentParser(prog="pdserve-worker", description=__doc__)
    p.add_argument(
        "--config", type=Path, default=None, help=f"a WorkerConfig as JSON (default: ${WORKER_CONFIG_ENV})"
    )
    p.add_argument("--worker-id", default=None, help="a label for ps; must match the configuration's")
    args = p.parse_args(argv)
    raw = (
        args.config.read_bytes()
        if args.config is not None
        else os.environ.get(WORKER_CONFIG_ENV, "").encode()
    )
    if not raw:
        p.error(f"no configuration: give --config FILE or set {WORKER_CONFIG_ENV}")
    try:
        config = msgspec.json.decode(raw, type=WorkerConfig)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        p.error(f"bad worker configuration: {exc}")
    if args.worker_id is not None and args.worker_id != config.worker_id:
        p.error(f"--worker-id {args.worker_id} does not match the configuration's {config.worker_id}")
    return config


def _cpu_list(spec: str) -> set[int]:
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def _report_ready(ready: wire.Ready) -> None:
    """Tell the cluster backend, through the pipe it gave us, that we serve and where."""
    fd = os.environ.pop(WORKER_READY_FD_ENV, None)
    if fd is None:
        return
    with os.fdopen(int(fd), "wb") as pipe:
        pipe.write(msgspec.json.encode(ready) + b"\n")


def _die_with_parent() -> None:
    """Ask the kernel for SIGTERM when the process that started us ends (Linux), so a SIGKILLed
    `pdserve serve` leaves no worker behind. Done here rather than between fork and exec in the
    parent, which is not safe in a process with threads; if the parent is already gone, stop."""
    parent = os.environ.pop(WORKER_PARENT_ENV, None)
    if parent is None or not sys.platform.startswith("linux"):
        return
    import ctypes

    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):
        sys.exit(f"the process that started this worker ({parent}) is gone")
    watch_parent(int(parent), ORPHAN_GRACE_SECONDS)


# How long a worker whose parent is gone may take to stop on its SIGTERM before it exits hard.
ORPHAN_GRACE_SECONDS = 30.0


def watch_parent(parent: int, grace: float) -> None:
    """The SIGTERM of PR_SET_PDEATHSIG asks for a clean stop, which an engine wedged in a step
    would never make: a daemon thread notices the parent is gone (we were re-parented), gives the
    clean stop `grace` seconds, then ends the process (its resource tracker, or the next sweep,
    removes its KV segment). So a worker never outlives its parent, or its Ray actor, for long."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        time.sleep(grace)
        # No logging: its lock may be held by the wedged thread.
        os.write(
            2,
            f"worker: the process that started it is gone, still running after {grace:g} s: exiting\n".encode(),
        )
        os._exit(1)

    threading.Thread(target=watch, name="watch-parent", daemon=True).start()


def main(argv: list[str] | None = None) -> int:
    _die_with_parent()
    config = load_config(argv)
    try:
        secrets = take_worker_secrets()  # first: nothing this process starts inherits them
    except PdserveError as exc:
        sys.exit(f"worker {config.worker_id}: {exc}")
    logging.basicConfig(
        level=config.log_level, format=f"%(asctime)s %(levelname)s worker {config.worker_id}: %(message)s"
    )
    if config.cpus and hasattr(os, "sched_setaffinity"):
        # Two workers on two cores must not fight over them: each gets its own.
        os.sched_setaffinity(0, _cpu_list(config.cpus))

    # Imported here: a bad configuration is answered without loading torch.
    from pdserve.engine.factory import build_engine
    from pdserve.transfer.base import FaultInjector
    from pdserve.transfer.segments import sweep_dead_segments
    from pdserve.transfer.shm import OwnedSegment
    from pdserve.worker.server import WorkerServer

    role = config.role
    segment: OwnedSegment | None = None

    def allocate_in_shm(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nonlocal segment
        segment = OwnedSegment(shape, dtype)
        return segment.tensor

    # Every worker's KV can be read by another: a prefill worker's prompts, and the streams a
    # decode (or mixed) worker hands over when it drains or rebalances. With shm the cache lives in
    # shared memory, which the others copy out of; the other transports serve it from ordinary
    # memory. Decode and mixed workers also pull KV in.
    # With same-node shm a tcp or nixl worker's cache is in shared memory too, for the workers
    # on its own node (see WorkerConfig.same_node_shm).
    in_shm = config.transport == "shm" or config.same_node_shm
    allocator = allocate_in_shm if in_shm else None
    if in_shm:
        # A worker that died here with its resource tracker (a lost Ray node, an OOM-killed
        # process group) left its segment behind; its memory is this worker's /dev/shm too.
        sweep_dead_segments()
    exporter: KVExporter | None = None
    importer: KVImporter | None = None
    same_node_importer: KVImporter | None = None
    try:
        engine, _ = build_engine(config.engine, kv_allocator=allocator, eos_token_ids=config.eos_token_ids)
        kv_cache = engine.runner.kv_cache  # [L, 2, NB, BS, KVH, D]
        exporter = _make_exporter(config, kv_cache, secrets.kv_secret_bytes)
        if role is not Role.PREFILL:
            # Seeded by the worker's id: a worker started in place of a killed one does not
            # replay the same faults (reproducible still, for the same ids).
            seed = zlib.crc32(config.worker_id.encode())
            faults = FaultInjector(config.kv_fault_rate, seed=seed, corrupt_rate=config.kv_corrupt_rate)
            importer = _make_importer(config.transport, kv_cache, faults, secrets.kv_secret_bytes)
            if config.same_node_shm and config.transport != "shm":
                same_node_importer = _make_importer("shm", kv_cache, faults, secrets.kv_secret_bytes)
        shm_name = segment.name if segment is not None else ""
        kv_address = exporter.address if exporter is not None else shm_name
        server = WorkerServer(
            engine,
            config,
            kv_address,
            importer,
            secrets=secrets,
            exporter=exporter,
            on_bound=_report_ready,
            shm_address=shm_name if exporter is not None else "",
            same_node_importer=same_node_importer,
        )

        def on_signal(_signum: int, _frame: object) -> None:
            server.stop_from_signal()  # no lock, no logging here: see stop_from_signal

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        logger.info("serving %s as %s", config.engine.model, role.value)
        server.serve_forever()
    finally:
        if exporter is not None:
            exporter.close()  # the server closed it already if it ran; twice is fine
        if segment is not None:
            segment.close()
    return 0


def _make_exporter(config: WorkerConfig, kv_cache: torch.Tensor, secret: bytes) -> KVExporter | None:
    """The server for the transports that serve reads (shm needs none); `secret`: the deployment's
    KV secret, which every connection must prove."""
    if config.transport == "tcp":
        from pdserve.transfer.tcp import TcpExporter

        return TcpExporter(kv_cache, config.kv_host, config.kv_port, secret=secret)
    if config.transport == "nixl":
        from pdserve.transfer.nixl_backend import NixlExporter

        name = f"pdserve-{config.worker_id}"
        return NixlExporter(kv_cache, config.kv_host, config.kv_port, name=name, secret=secret)
    return None


def _make_importer(
    transport: str, kv_cache: torch.Tensor, faults: FaultInjector, secret: bytes
) -> KVImporter:
    """Decode (and mixed) side: backends are imported only when chosen."""
    if transport == "tcp":
        from pdserve.transfer.tcp import TcpImporter

        return TcpImporter(kv_cache, faults, secret=secret)
    if transport == "nixl":
        from pdserve.transfer.nixl_backend import NixlImporter

        return NixlImporter(kv_cache, faults, secret=secret)
    from pdserve.transfer.shm import ShmImporter

    return ShmImporter(kv_cache, faults)


if __name__ == "__main__":
    sys.exit(main())
