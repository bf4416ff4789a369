"""The `nixl` transport: the decode side READs blocks out of the prefill side's registered cache
through NIXL (UCX here; RDMA / EFA where the hardware is), one-sided, no copy on either CPU.

Optional: `pip install 'pdserve[nixl]'`. Nothing here imports `nixl` until a transport object is
built, so the rest of pdserve (and this module) loads without it; `unavailable_reason()` says why
it cannot be used.

A one-sided read cannot be refused by its target, so the lease is enforced around it, over the
`tcp` exporter's socket (the side channel, which is also what `KVHandle.address` names):
1. META (once per exporter): the exporter's NIXL agent metadata and its cache's base address,
   layout and memory (DRAM, or VRAM and the device for a GPU's cache: UCX then uses CUDA IPC on one
   host, GPUDirect RDMA across hosts where the hardware has it); the importer loads it (`add_remote_agent`) and prepares descriptors of every remote
   block piece (`prep_xfer_dlist`), as vLLM's NixlConnector does.
2. HOLD request id + blocks: the exporter checks the lease and counts a read in flight, so ending
   the lease waits for it (`LeaseTable`); a read that outlives the grace period is revoked.
3. The READ itself (`make_prepped_xfer`, `transfer`, `check_xfer_state` until done or timeout).
4. DONE request id: the exporter ends the hold and answers whether the lease held throughout;
   if it was revoked meanwhile the data may be torn and the pull fails.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import struct
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from pdserve.transfer.base import FaultInjector, KVImporter, LeaseError, TransferError
from pdserve.transfer.layout import layout_of
from pdserve.transfer.tcp import TcpExporter, TcpImporter
from pdserve.transfer.tcp_wire import BAD_REQUEST, NO_LEASE

OP_META, OP_HOLD, OP_DONE = 2, 3, 4
# base address, blocks, pieces per block, piece bytes, then the agent metadata
# base address, blocks, pieces per block, bytes per piece, memory kind (0 DRAM, 1 VRAM), device
_META = struct.Struct("<QIIQBI")
_MEMORY_KINDS = ("DRAM", "VRAM")


def _memory(kv_cache: torch.Tensor) -> tuple[int, int]:
    """(memory kind, device id) of a cache as NIXL names them: a GPU's cache is VRAM, so that UCX
    moves it with CUDA IPC on one host and GPUDirect RDMA across hosts where the hardware has it."""
    if kv_cache.device.type == "cuda":
        return 1, kv_cache.device.index or 0
    return 0, 0


_POLL_SECONDS = 20e-6  # between check_xfer_state calls: short, transfers of a few MiB take ~1 ms
_TARGET_POLL_SECONDS = 1e-3  # between the exporter's progress calls while a read is held


@functools.cache
def unavailable_reason() -> str | None:
    """None if NIXL imports here, else why not (for skips and the worker's error)."""
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL logs every agent at INFO on stdout
    try:
        import nixl._api  # noqa: F401
    except ImportError as exc:
        return f"NIXL is not installed (pip install 'pdserve[nixl]'): {exc}"
    except Exception as exc:  # a broken install: missing UCX libraries, a bad plugin directory
        return f"NIXL does not import: {type(exc).__name__}: {exc}"
    return None


def _agent(name: str) -> Any:
    reason = unavailable_reason()
    if reason is not None:
        raise TransferError(reason)
    from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

    # STRICT: the worker pulls on a small thread pool, all through one agent. No progress thread:
    # NIXL's busy-polls a whole core even when idle (1.5.1 sets its delay to 0), which a 2-core
    # worker cannot spare; the importer progresses while it waits for its read, the exporter
    # only while a read is held (NixlExporter._progress_loop).
    config = nixl_agent_config(
        enable_prog_thread=False,
        backends=["UCX"],
        sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT,
    )
    agent = nixl_agent(f"{name}-{os.getpid()}-{secrets.token_hex(3)}", config)
    if "UCX" not in agent.backends:
        raise TransferError(f"NIXL has no UCX backend here (plugins: {agent.get_plugin_list()})")
    return agent


def _piece_descs(base: int, num_blocks: int, pieces: int, piece: int, device: int = 0) -> np.ndarray:
    """[pieces * num_blocks, 3] (address, bytes, device): piece p of block b is row p*NB + b."""
    starts = base + np.arange(pieces * num_blocks, dtype=np.uint64) * np.uint64(piece)
    descs = np.zeros((pieces * num_blocks, 3), dtype=np.uint64)
    descs[:, 0] = starts
    descs[:, 1] = piece
    descs[:, 2] = device
    return descs


def _rows(blocks: list[int], num_blocks: int, pieces: int) -> np.ndarray:
    """Descriptor rows of `blocks`, in the same (piece, block) order on both sides."""
    ids = np.asarray(blocks, dtype=np.int64)
    return (
        (np.arange(pieces, dtype=np.int64)[:, None] * num_blocks + ids[None, :]).reshape(-1).astype(np.int32)
    )


class NixlExporter(TcpExporter):
    """Prefill side: registers the cache with a NIXL agent; the inherited tcp server is the side
    channel (META / HOLD / DONE), and still answers plain tcp pulls."""

    def __init__(
        self,
        kv_cache: torch.Tensor,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "pdserve",
        *,
        secret: bytes,
    ) -> None:
        self.agent = _agent(name)
        self._registered = self.agent.register_memory(kv_cache)  # the whole cache (DRAM or VRAM)
        # (connection, request id) -> (lease, abort, when the hold began)
        self._holds: dict[tuple[Any, str], tuple[Any, Any, float]] = {}
        self._holds_lock = threading.Lock()
        num_blocks, pieces, piece, _ = layout_of(kv_cache)
        self._meta = (
            _META.pack(kv_cache.data_ptr(), num_blocks, pieces, piece, *_memory(kv_cache))
            + self.agent.get_agent_metadata()
        )
        self._reading = threading.Event()  # set while any hold is open: progress the agent
        self._progress = threading.Thread(target=self._progress_loop, name="kv-nixl-progress", daemon=True)
        # Starts serving: everything it needs is ready. The side channel's handshake guards the
        # metadata too: a peer without the deployment's KV secret never learns the cache's keys.
        super().__init__(kv_cache, host, port, secret=secret)
        self._progress.start()

    def _progress_loop(self) -> None:
        """A READ of this cache completes only once this side's UCX worker answers (wireup, the
        read's acknowledgement), so it is progressed while a read is held, and idles otherwise."""
        while not self._closed.is_set():
            if self._reading.wait(timeout=0.2):
                self.agent.get_new_notifs()  # progresses the UCX worker
                time.sleep(_TARGET_POLL_SECONDS)

    def close(self) -> None:
        if self._closed.is_set():
            return
        super().close()
        self._progress.join(timeout=5.0)
        with contextlib.suppress(Exception):  # best effort: the process is usually ending
            self.agent.deregister_memory(self._registered)

    def _handle(
        self,
        conn: Any,
        op: int,
        request_id: str,
        token: bytes,
        blocks: list[int],
        layout: tuple[int, int, bytes],
        deadline: float,
    ) -> bool:
        if op not in (OP_META, OP_HOLD, OP_DONE):
            return super()._handle(conn, op, request_id, token, blocks, layout, deadline)
        status, error = self._check_layout(layout, blocks)
        if error:
            return self._reply_error(conn, status, error, deadline)
        if op == OP_META:
            return self._reply_ok(conn, self._meta, deadline)
        key = (conn, request_id)
        if op == OP_HOLD:

            def abort() -> None:  # the lease table revokes this hold: DONE will then fail
                self._drop_hold(key)

            with self._holds_lock:
                if key in self._holds:
                    return self._reply_error(conn, BAD_REQUEST, f"{request_id!r} is already held", deadline)
                try:
                    lease = self.leases.acquire(request_id, token, blocks, abort)
                    self._holds[key] = (lease, abort, time.perf_counter())
                    self._reading.set()
                except LeaseError as exc:
                    return self._reply_error(conn, NO_LEASE, str(exc), deadline)
            return self._reply_ok(conn, b"", deadline)
        # OP_DONE: the read is over; did the lease hold throughout?
        seconds = self._drop_hold(key)
        if seconds is None:  # counted as a failure by _reply_error
            return self._reply_error(
                conn, NO_LEASE, f"the lease of {request_id!r} ended during the read", deadline
            )
        self.stats.record(len(blocks) * layout[0] * layout[1], seconds, ok=True)
        return self._reply_ok(conn, b"", deadline)

    def _drop_hold(self, key: tuple[Any, str]) -> float | None:
        """End a hold (DONE, a closed connection, or the lease table revoking it). Returns how
        long it was held, or None if it was not held or the lease ended during it."""
        with self._holds_lock:
            entry = self._holds.pop(key, None)
            if not self._holds:
                self._reading.clear()
        if entry is None:
            return None
        lease, abort, started = entry
        return time.perf_counter() - started if self.leases.release(lease, abort) else None

    def _connection_closed(self, conn: Any) -> None:
        with self._holds_lock:
            keys = [key for key in self._holds if key[0] is conn]
        for key in keys:
            self._drop_hold(key)


@dataclass
class _Remote:
    agent_name: str
    num_blocks: int
    prepped: Any  # prepared descriptors of every piece of the remote cache


class NixlImporter(KVImporter):
    """Decode side: READs leased blocks of a `NixlExporter`'s cache into this worker's cache."""

    def __init__(self, kv_cache: torch.Tensor, faults: FaultInjector | None = None, *, secret: bytes) -> None:
        super().__init__(kv_cache, faults)  # [L, 2, NB, BS, KVH, D]
        self._side = TcpImporter(kv_cache, secret=secret)  # the side channel (also checks the layout)
        self._layout = layout_of(kv_cache)
        self.agent = _agent("pdserve-import")
        self._registered = self.agent.register_memory(kv_cache)
        num_blocks, pieces, piece, _ = self._layout
        kind, device = _memory(kv_cache)
        self._local = self.agent.prep_xfer_dlist(
            "NIXL_INIT_AGENT",
            _piece_descs(kv_cache.data_ptr(), num_blocks, pieces, piece, device),
            _MEMORY_KINDS[kind],
        )
        self._remotes: dict[str, _Remote] = {}
        self._lock = threading.Lock()

    def _pull(self, address: str, src_blocks: list[int], dst_blocks: list[int], timeout: float) -> int:
        return self._pull_request("", b"", address, src_blocks, dst_blocks, timeout)

    def _pull_request(
        self,
        request_id: str,
        lease_token: bytes,
        address: str,
        src_blocks: list[int],
        dst_blocks: list[int],
        timeout: float,
    ) -> int:
        deadline = time.monotonic() + timeout
        _, pieces, piece, _ = self._layout
        remote = self._remote(address, timeout)
        if src_blocks and max(src_blocks) >= remote.num_blocks:
            raise TransferError(
                f"block {max(src_blocks)} is outside {address}'s cache ({remote.num_blocks} blocks)"
            )
        # HOLD and DONE on one connection: the exporter binds the hold to it, and drops it if the
        # connection ends (this process died) before DONE.
        _, sock = self._side.call(
            address, OP_HOLD, request_id, src_blocks, _left(deadline, timeout), lease_token=lease_token
        )
        try:
            self._read(remote, src_blocks, dst_blocks, deadline, timeout)
        except BaseException:
            sock.close()  # ends the hold at the exporter; this read failed anyway
            raise
        # The data is here: DONE only says whether it is valid, so it gets at least a second.
        done_timeout = max(deadline - time.monotonic(), 1.0)
        _, sock = self._side.call(
            address, OP_DONE, request_id, src_blocks, done_timeout, sock, lease_token=lease_token
        )
        self._side.put_back(address, sock)
        return len(src_blocks) * pieces * piece

    def _read(self, remote: _Remote, src: list[int], dst: list[int], deadline: float, timeout: float) -> None:
        num_blocks, pieces, _, _ = self._layout
        handle = self.agent.make_prepped_xfer(
            "READ",
            self._local,
            _rows(dst, num_blocks, pieces),
            remote.prepped,
            _rows(src, remote.num_blocks, pieces),
        )
        try:
            state = self.agent.transfer(handle)
            while state == "PROC":
                if time.monotonic() > deadline:
                    raise TransferError(f"NIXL read from {remote.agent_name} timed out after {timeout:.1f} s")
                time.sleep(_POLL_SECONDS)
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise TransferError(f"NIXL read from {remote.agent_name} failed ({state})")
        finally:
            # Releasing an unfinished transfer cancels it, so it cannot land in blocks freed later.
            self.agent.release_xfer_handle(handle)

    def _remote(self, address: str, timeout: float) -> _Remote:
        with self._lock:
            remote = self._remotes.get(address)
        if remote is not None:
            return remote
        body, sock = self._side.call(address, OP_META, "", [], timeout)
        self._side.put_back(address, sock)
        base, num_blocks, pieces, piece, kind, device = _META.unpack_from(body)
        if (pieces, piece) != self._layout[1:3]:  # the side channel checked it already: a bug guard
            raise TransferError(f"{address}: layout mismatch ({pieces} x {piece} bytes per block)")
        agent_name = self.agent.add_remote_agent(body[_META.size :])
        agent_name = agent_name.decode() if isinstance(agent_name, bytes) else agent_name
        if kind >= len(_MEMORY_KINDS):
            raise TransferError(f"{address}: unknown memory kind {kind}")
        prepped = self.agent.prep_xfer_dlist(
            agent_name, _piece_descs(base, num_blocks, pieces, piece, device), _MEMORY_KINDS[kind]
        )
        remote = _Remote(agent_name, num_blocks, prepped)
        with self._lock:
            self._remotes[address] = remote
        return remote

    def forget(self, address: str) -> None:
        """Drop an exporter that went away (its next pull fetches fresh metadata)."""
        with self._lock:
            remote = self._remotes.pop(address, None)
        self._side.forget(address)
        if remote is not None:
            with contextlib.suppress(Exception):
                self.agent.release_dlist_handle(remote.prepped)
                self.agent.remove_remote_agent(remote.agent_name)

    def close(self) -> None:
        for address in list(self._remotes):
            self.forget(address)
        self._side.close()
        with contextlib.suppress(Exception):
            self.agent.release_dlist_handle(self._local)
            self.agent.deregister_memory(self._registered)


def _left(deadline: float, timeout: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferError(f"pull timed out after {timeout:.1f} s")
    return left
