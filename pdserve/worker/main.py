"""`python -m pdserve.worker`: one engine in one role, serving the control RPC.

Started by the cluster backend (or by hand for debugging). Stops on a Shutdown message, SIGTERM
or SIGINT, and removes its shared-memory KV segment (or stops its KV server) on the way out.

KV transports (`--transport`, the same on every worker of a deployment):
- `shm`: same host; a prefill worker's KV cache lives in /dev/shm, decode workers copy out of it.
- `tcp`: across hosts; a prefill worker serves leased blocks on `--kv-host`:`--kv-port`.
- `nixl`: NIXL (UCX) reads of a prefill worker's registered cache; needs `pip install pdserve[nixl]`.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING

from pdserve.config import EngineConfig, Role

if TYPE_CHECKING:  # the worker loads torch only after its arguments are valid
    import torch

    from pdserve.transfer.base import FaultInjector, KVExporter, KVImporter

logger = logging.getLogger("pdserve.worker")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="pdserve-worker", description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--role", choices=[r.value for r in Role], required=True)
    p.add_argument("--worker-id", required=True)
    p.add_argument("--rpc", required=True, help="ZeroMQ address to bind, e.g. tcp://127.0.0.1:7001")
    p.add_argument("--transport", choices=["shm", "tcp", "nixl"], default="shm")
    p.add_argument(
        "--kv-host",
        default="127.0.0.1",
        help="tcp/nixl, prefill role: address to serve KV blocks on (0.0.0.0: all, published as the hostname)",
    )
    p.add_argument("--kv-port", type=int, default=0, help="tcp/nixl, prefill role: port (0: any free port)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=1, help="torch threads (one per worker by default)")
    p.add_argument("--cpus", default=None, help="pin to these CPUs, e.g. '0' or '0-1' (Linux)")
    p.add_argument("--kv-cache-memory-gib", type=float, default=1.0)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--chunk-size", type=int, default=512)
    p.add_argument("--lease-seconds", type=float, default=30.0)
    p.add_argument("--kv-pull-timeout", type=float, default=10.0)
    p.add_argument(
        "--kv-fault-rate", type=float, default=0.0, help="fault tests: drop this share of KV pulls"
    )
    p.add_argument("--log-level", default="INFO")
    return p.parse_args(argv)


def _cpu_list(spec: str) -> set[int]:
    cpus: set[int] = set()
    for part in spec.split(","):
        first, _, last = part.partition("-")
        cpus.update(range(int(first), int(last or first) + 1))
    return cpus


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level, format=f"%(asctime)s %(levelname)s worker {args.worker_id}: %(message)s"
    )
    if args.cpus and hasattr(os, "sched_setaffinity"):
        # Two workers on two cores must not fight over them: each gets its own.
        os.sched_setaffinity(0, _cpu_list(args.cpus))

    # Imported here: argument errors above answer without loading torch.
    from pdserve.engine.factory import build_engine
    from pdserve.transfer.base import FaultInjector
    from pdserve.transfer.shm import OwnedSegment
    from pdserve.worker.server import WorkerOptions, WorkerServer

    role = Role(args.role)
    config = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        role=role,
        block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks,
        kv_cache_memory_gib=args.kv_cache_memory_gib,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        chunk_size=args.chunk_size,
        threads=args.threads,
    )
    segment: OwnedSegment | None = None

    def allocate_in_shm(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        nonlocal segment
        segment = OwnedSegment(shape, dtype)
        return segment.tensor

    # With shm a prefill worker's cache lives in shared memory so decode workers can copy out of
    # it; the other transports serve it from ordinary memory.
    allocator = allocate_in_shm if role is Role.PREFILL and args.transport == "shm" else None
    exporter: KVExporter | None = None
    importer: KVImporter | None = None
    try:
        engine, _ = build_engine(config, kv_allocator=allocator)
        kv_cache = engine.runner.kv_cache  # [L, 2, NB, BS, KVH, D]
        if role is Role.PREFILL:
            exporter = _make_exporter(args, kv_cache)
        else:
            importer = _make_importer(args.transport, kv_cache, FaultInjector(args.kv_fault_rate))
        kv_address = segment.name if segment is not None else exporter.address if exporter else ""
        options = WorkerOptions(
            worker_id=args.worker_id,
            rpc_address=args.rpc,
            transport=args.transport,
            kv_address=kv_address,
            lease_seconds=args.lease_seconds,
            kv_pull_timeout=args.kv_pull_timeout,
        )
        server = WorkerServer(engine, options, importer, exporter=exporter)

        def on_signal(signum: int, _frame: object) -> None:
            logger.info("signal %d: stopping", signum)
            server.stop()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        logger.info("serving %s as %s on %s", args.model, role.value, args.rpc)
        server.serve_forever()
    finally:
        if exporter is not None:
            exporter.close()  # the server closed it already if it ran; twice is fine
        if segment is not None:
            segment.close()
    return 0


def _make_exporter(args: argparse.Namespace, kv_cache: torch.Tensor) -> KVExporter | None:
    """Prefill side: the server for the transports that serve reads (shm needs none)."""
    if args.transport == "tcp":
        from pdserve.transfer.tcp import TcpExporter

        return TcpExporter(kv_cache, args.kv_host, args.kv_port)
    if args.transport == "nixl":
        from pdserve.transfer.nixl_backend import NixlExporter

        return NixlExporter(kv_cache, args.kv_host, args.kv_port, name=f"pdserve-{args.worker_id}")
    return None


def _make_importer(transport: str, kv_cache: torch.Tensor, faults: FaultInjector) -> KVImporter:
    """Decode (and mixed) side: backends are imported only when chosen."""
    if transport == "tcp":
        from pdserve.transfer.tcp import TcpImporter

        return TcpImporter(kv_cache, faults)
    if transport == "nixl":
        from pdserve.transfer.nixl_backend import NixlImporter

        return NixlImporter(kv_cache, faults)
    from pdserve.transfer.shm import ShmImporter

    return ShmImporter(kv_cache, faults)


if __name__ == "__main__":
    sys.exit(main())
