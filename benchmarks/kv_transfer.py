"""KV transfer bandwidth of each transport against what the same machine can do without it.

For 1, 16 and 256 MiB of KV blocks (SmolLM2-135M's cache shape: 30 layers, 3 KV heads, head dim
64, blocks of 16 tokens, fp32: 720 KiB a block), with the exporter in one process and the
importer in another, the median of `--repeats` timed pulls (after one warm-up) of:
- `shm`  against a plain memory copy of the same bytes (torch `copy_`, one contiguous buffer);
- `tcp`  against a raw loopback socket (one `sendall` / `recv_into` of the same bytes, same
  socket options: TCP_NODELAY, 4 MiB buffers);
- `nixl` (if it imports) against NIXL's own two-agent READ of the same bytes as one contiguous
  descriptor, and against NIXL reading exactly the transport's descriptors (one per block piece)
  without the lease round trips. Both exporters' agents are progressed the same way.
Blocks are `scattered` (random block ids on both sides, as a busy cache hands them out: every
block is 60 separate 12 KiB pieces) or `contiguous` (consecutive ids: each plane is one run).
Each path is timed in turn with its baselines, `--repeats` times for the largest size and more
for the smaller ones (a 1 MiB pull takes ~1 ms; 200 repeats). torch uses one thread on both
sides, as a worker does by default.

With `--checksum`, each transport is also timed pulling with the KV checksum on (the importer
hashes what landed and compares it with the holder's digest, as a worker does by default on a
CPU) against the same pull without it, and the holder's own hashing of the blocks is timed
alone (a worker does it once per lease, when it registers the blocks).

    .venv/bin/python benchmarks/kv_transfer.py
    .venv/bin/python benchmarks/kv_transfer.py --sizes 16 --repeats 3 --layouts contiguous
    .venv/bin/python benchmarks/kv_transfer.py --checksum --transports shm tcp
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

import torch

LAYERS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 30, 3, 64, 16
DTYPE = torch.float32
BLOCK_BYTES = LAYERS * 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 4
BENCH_SECRET = bytes(32)  # the two processes of this benchmark are one deployment
MiB = 1 << 20


def cache_shape(num_blocks: int) -> tuple[int, ...]:
    return (LAYERS, 2, num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM)


def pattern(numel: int) -> torch.Tensor:
    """Distinct, exactly representable values, so a misplaced piece is caught."""
    return (torch.arange(numel, dtype=torch.int64) % 16_777_213).to(DTYPE)


# -- the exporting process ------------------------------------------------------------------------
def serve(kind: str, num_blocks: int) -> None:
    """Child process: export a cache (or a raw buffer), print its address, serve until stdin closes."""
    torch.set_num_threads(1)
    shape = cache_shape(num_blocks)
    numel = math.prod(shape)
    cleanup: Callable[[], None] = lambda: None  # noqa: E731
    token = b""
    if kind == "shm":
        from pdserve.transfer.shm import OwnedSegment

        segment = OwnedSegment(shape, DTYPE)
        segment.tensor.view(-1).copy_(pattern(numel))
        address, cleanup = segment.name, segment.close
    elif kind in ("tcp", "nixl"):
        from pdserve.transfer.base import KVExporter

        cache = pattern(numel).view(shape)
        exporter: KVExporter
        if kind == "tcp":
            from pdserve.transfer.tcp import TcpExporter

            exporter = TcpExporter(cache, secret=BENCH_SECRET)
        else:
            from pdserve.transfer.nixl_backend import NixlExporter

            exporter = NixlExporter(cache, secret=BENCH_SECRET)
        token = exporter.register("bench", range(num_blocks))
        address, cleanup = exporter.address, exporter.close
    elif kind == "socket":
        address, cleanup = raw_socket_server(numel * 4)
    elif kind == "nixl-raw":
        address, cleanup = raw_nixl_exporter(numel * 4)
    else:
        raise SystemExit(f"unknown kind {kind}")
    print("ADDRESS", address, token.hex() or "-", flush=True)
    sys.stdin.readline()
    cleanup()


def raw_socket_server(nbytes: int) -> tuple[str, Callable[[], None]]:
    """Answers each 8-byte request n with the first n bytes of one buffer (one sendall). The
    buffers on both sides are torch allocations like the KV caches: a bytearray of the same size
    was about half as fast to send from and receive into on this VM."""
    import threading

    from pdserve.transfer.tcp_wire import tune_socket

    buf = torch.ones(nbytes // 4, dtype=DTYPE).view(torch.uint8).numpy().data
    server = socket.create_server(("127.0.0.1", 0))
    conns: list[socket.socket] = []

    def loop() -> None:
        conn, _ = server.accept()
        conns.append(conn)
        tune_socket(conn)
        with contextlib.suppress(OSError):
            while head := conn.recv(8, socket.MSG_WAITALL):
                conn.sendall(buf[: int.from_bytes(head, "little")])

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()

    def cleanup() -> None:
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
        thread.join(timeout=5)
        server.close()

    return f"127.0.0.1:{server.getsockname()[1]}", cleanup


def raw_nixl_exporter(nbytes: int) -> tuple[str, Callable[[], None]]:
    """A registered buffer, its agent progressed every 50 us by a thread: the same arrangement as
    NixlExporter's while it holds a read (NIXL's own progress thread busy-polls a core)."""
    import threading

    from pdserve.transfer.nixl_backend import _TARGET_POLL_SECONDS, _agent

    agent = _agent("bench-raw-src")
    buf = torch.ones(nbytes // 4, dtype=DTYPE)
    registered = agent.register_memory(buf)
    stop = threading.Event()

    def progress() -> None:
        while not stop.is_set():
            agent.get_new_notifs()
            time.sleep(_TARGET_POLL_SECONDS)

    thread = threading.Thread(target=progress, daemon=True)
    thread.start()

    def cleanup() -> None:
        stop.set()
        thread.join(timeout=5)
        agent.deregister_memory(registered)
        buf.zero_()  # refers to `buf`, so it stays allocated (and registered) until now

    return f"{buf.data_ptr()}/{agent.get_agent_metadata().hex()}", cleanup


class Child:
    def __init__(self, kind: str, num_blocks: int) -> None:
        cmd = [sys.executable, __file__, "--serve", kind, "--num-blocks", str(num_blocks)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        while True:  # NIXL may log on stdout before the address
            line = self.proc.stdout.readline()
            if not line:
                raise RuntimeError(f"the {kind} exporter process ended ({self.proc.wait()})")
            if line.startswith("ADDRESS "):
                _, self.address, token = line.split()
                self.token = bytes.fromhex(token) if token != "-" else b""
                break

    def stop(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- the importing process -------------------------------------------------------------------------
class Memcpy:
    """Baseline of `shm`: one torch copy of the same bytes between two contiguous buffers."""

    def __init__(self, max_bytes: int) -> None:
        self.src, self.dst = torch.ones(max_bytes // 4, dtype=DTYPE), torch.zeros(max_bytes // 4, dtype=DTYPE)

    def run(self, src: list[int], dst: list[int]) -> None:
        nbytes = len(src) * BLOCK_BYTES
        self.dst[: nbytes // 4].copy_(self.src[: nbytes // 4])

    def close(self) -> None:
        pass


class RawSocket:
    """Baseline of `tcp`: one sendall / recv_into loop of the same bytes, from another process."""

    def __init__(self, max_bytes: int, num_blocks: int) -> None:
        from pdserve.transfer.tcp_wire import parse_address, tune_socket

        self.child = Child("socket", num_blocks)
        self.buf = torch.zeros(max_bytes // 4, dtype=DTYPE).view(torch.uint8).numpy().data
        self.sock = socket.create_connection(parse_address(self.child.address), timeout=60)
        tune_socket(self.sock)

    def run(self, src: list[int], dst: list[int]) -> None:
        nbytes = len(src) * BLOCK_BYTES
        self.sock.sendall(nbytes.to_bytes(8, "little"))
        got = 0
        while got < nbytes:
            n = self.sock.recv_into(self.buf[got:nbytes])
            if not n:
                raise ConnectionError("raw socket closed")
            got += n

    def close(self) -> None:
        self.sock.close()
        self.child.stop()


class RawNixl:
    """Baseline of `nixl`: NIXL's own two-agent READ of the same bytes, one descriptor."""

    def __init__(self, max_bytes: int, num_blocks: int) -> None:
        from pdserve.transfer.nixl_backend import _agent

        self.child = Child("nixl-raw", num_blocks)
        base, meta = self.child.address.split("/")
        self.base = int(base)
        self.agent = _agent("bench-raw-dst")
        self.dst = torch.zeros(max_bytes // 4, dtype=DTYPE)
        self.registered = self.agent.register_memory(self.dst)
        self.remote = self.agent.add_remote_agent(bytes.fromhex(meta))

    def run(self, src: list[int], dst: list[int]) -> None:
        nbytes = len(src) * BLOCK_BYTES
        local = self.agent.get_xfer_descs([(self.dst.data_ptr(), nbytes, 0)], "DRAM")
        far = self.agent.get_xfer_descs([(self.base, nbytes, 0)], "DRAM")
        handle = self.agent.initialize_xfer("READ", local, far, self.remote)
        state = self.agent.transfer(handle)
        while state == "PROC":
            state = self.agent.check_xfer_state(handle)
        self.agent.release_xfer_handle(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL read failed: {state}")

    def close(self) -> None:
        self.agent.remove_remote_agent(self.remote)
        self.agent.deregister_memory(self.registered)
        self.child.stop()


class Transport:
    """A pdserve importer in this process pulling from its exporter in a child process."""

    def __init__(self, kind: str, num_blocks: int) -> None:
        from pdserve.transfer.base import KVImporter

        self.local = torch.zeros(cache_shape(num_blocks), dtype=DTYPE)  # [L, 2, NB, BS, KVH, D]
        self.local.view(-1).fill_(-1.0)  # touch every page before timing
        self.importer: KVImporter
        if kind == "shm":
            from pdserve.transfer.shm import ShmImporter

            self.importer = ShmImporter(self.local)
        elif kind == "tcp":
            from pdserve.transfer.tcp import TcpImporter

            self.importer = TcpImporter(self.local, secret=BENCH_SECRET)
        else:
            from pdserve.transfer.nixl_backend import NixlImporter

            self.importer = NixlImporter(self.local, secret=BENCH_SECRET)
        self.kind = kind
        self.child = Child(kind, num_blocks)
        self.expected = pattern(self.local.numel()).view(self.local.shape)

    def run(self, src: list[int], dst: list[int]) -> None:
        self.importer.pull(
            self.child.address, src, dst, timeout=60.0, request_id="bench", lease_token=self.child.token
        )

    def check(self, src: list[int], dst: list[int]) -> None:
        if not torch.equal(self.local[:, :, dst], self.expected[:, :, src]):
            raise AssertionError(f"{self.kind}: the blocks that arrived are not the ones sent")

    def close(self) -> None:
        self.importer.close()
        self.child.stop()


class Checksummed:
    """The transport's pull with the checksum on: the importer verifies what landed."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self._digests: dict[tuple[int, ...], list[str]] = {}

    def digest(self, src: list[int]) -> list[str]:
        from pdserve.transfer.checksum import kv_block_digests

        key = tuple(src)
        if key not in self._digests:  # what the holder computed when it leased them: one per block
            self._digests[key] = kv_block_digests(self.transport.expected, src)
        return self._digests[key]

    def run(self, src: list[int], dst: list[int]) -> None:
        digests = self.digest(src)
        t = self.transport
        t.importer.pull(
            t.child.address,
            src,
            dst,
            timeout=60.0,
            request_id="bench",
            lease_token=t.child.token,
            block_digests=digests,
        )

    def close(self) -> None:
        pass  # the transport is closed on its own


class HolderDigest:
    """What the holder pays once per lease: hashing its blocks."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def run(self, src: list[int], dst: list[int]) -> None:
        from pdserve.transfer.checksum import kv_block_digests

        kv_block_digests(self.transport.expected, src)

    def close(self) -> None:
        pass


def choose_blocks(n: int, num_blocks: int, layout: str, seed: int) -> list[int]:
    if layout == "contiguous":
        return list(range(n))
    return random.Random(seed).sample(range(num_blocks), n)


class SamePieces:
    """Second baseline of `nixl`: NIXL reading exactly the descriptors the transport reads (one
    per block piece), without the lease round trips: what is left is the transport's own cost."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport

    def run(self, src: list[int], dst: list[int]) -> None:
        from pdserve.transfer import nixl_backend

        importer = self.transport.importer
        assert isinstance(importer, nixl_backend.NixlImporter)
        remote = importer._remote(self.transport.child.address, 10.0)  # the transport's own lists
        importer._read(remote, src, dst, time.monotonic() + 60.0, 60.0)

    def close(self) -> None:
        pass  # the transport is closed on its own


def compare(
    kind: str, layout: str, sizes: dict[int, int], num_blocks: int, repeats: int, checksum: bool = False
) -> dict[str, dict[int, float]]:
    """Median seconds per size of the transport and of its baselines. All are timed in turn within
    each repeat, so a burst of load on this shared machine hits each of them rather than one."""
    max_bytes = max(sizes.values()) * BLOCK_BYTES
    transport = Transport(kind, num_blocks)
    baselines: dict[str, Memcpy | RawSocket | RawNixl | SamePieces | Checksummed | HolderDigest] = {}
    if kind == "shm":
        baselines["memcpy"] = Memcpy(max_bytes)
    elif kind == "tcp":
        baselines["raw socket"] = RawSocket(max_bytes, num_blocks)
    else:
        baselines["NIXL read, 1 descriptor"] = RawNixl(max_bytes, num_blocks)
        baselines["NIXL read, same pieces"] = SamePieces(transport)
    if checksum:
        baselines[CHECKED] = Checksummed(transport)
        baselines[HOLDER] = HolderDigest(transport)
    results: dict[str, dict[int, float]] = {name: {} for name in [kind, *baselines]}
    try:
        for mib, n in sizes.items():
            src = choose_blocks(n, num_blocks, layout, seed=mib)
            dst = choose_blocks(n, num_blocks, layout, seed=mib + 1)
            runs = {kind: transport, **baselines}
            times: dict[str, list[float]] = {name: [] for name in runs}
            # Small pulls take ~1 ms, where one scheduler hiccup is a large error: repeat them more.
            for repeat in range(
                max(repeats, min(200, repeats * 256 // max(mib, 1))) + 1
            ):  # the first round is a warm-up: connections, mappings
                for name, run in runs.items():
                    started = time.perf_counter()
                    run.run(src, dst)
                    if repeat:
                        times[name].append(time.perf_counter() - started)
            transport.check(src, dst)
            for name, seconds in times.items():
                results[name][mib] = statistics.median(seconds)
    finally:
        transport.close()
        for base in baselines.values():
            base.close()
    return results


CHECKED, HOLDER = "with checksum", "holder's digest"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 16, 256], help="MiB of blocks per pull")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--layouts", nargs="+", default=["scattered", "contiguous"])
    parser.add_argument("--transports", nargs="+", default=["shm", "tcp", "nixl"])
    parser.add_argument("--checksum", action="store_true", help="also time the pulls with the KV checksum")
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--num-blocks", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.num_blocks)
        return
    torch.set_num_threads(1)
    sizes = {mib: max(1, math.ceil(mib * MiB / BLOCK_BYTES)) for mib in args.sizes}
    num_blocks = 2 * max(sizes.values())  # room for scattered block ids on both sides
    from pdserve.transfer import nixl_backend

    transports = list(args.transports)
    reason = nixl_backend.unavailable_reason()
    if "nixl" in transports and reason is not None:
        print(f"nixl skipped: {reason}")
        transports.remove("nixl")
    print(f"blocks of {BLOCK_BYTES} bytes, caches of {num_blocks} blocks, {args.repeats} repeats")
    print(f"load average before: {os.getloadavg()}")
    head = " | ".join(f"{mib} MiB ({n} blocks)" for mib, n in sizes.items())
    lines = [f"| transport | blocks | against | {head} |", "|---|---|---|" + "---|" * len(sizes)]
    for layout in args.layouts:
        for kind in transports:
            results = compare(kind, layout, sizes, num_blocks, args.repeats, args.checksum)
            for name, base in results.items():
                if name == kind:
                    continue
                cells = []
                for mib, n in sizes.items():
                    gb = n * BLOCK_BYTES / 1e9
                    ours = results[kind][mib]
                    if name in (CHECKED, HOLDER):  # its time, and what it adds to a plain pull
                        ms = base[mib] * 1e3
                        extra = base[mib] - ours if name == CHECKED else base[mib]
                        cells.append(f"{ms:.2f} ms, {gb / base[mib]:.2f} GB/s, **+{extra / ours:.0%}**")
                        continue
                    cells.append(f"{gb / ours:.2f} vs {gb / base[mib]:.2f} GB/s = **{base[mib] / ours:.0%}**")
                lines.append(f"| {kind} | {layout} | {name} | " + " | ".join(cells) + " |")
                print(lines[-1], flush=True)
    print(f"load average after: {os.getloadavg()}\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
