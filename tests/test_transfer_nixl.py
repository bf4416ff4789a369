"""The `nixl` transport, where NIXL imports: real agents in two processes (UCX), the lease held
around each one-sided read. Skipped, with the reason, where NIXL is not installed."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from pdserve.transfer import nixl_backend
from pdserve.transfer.base import FaultInjector, TransferError

pytestmark = pytest.mark.skipif(
    nixl_backend.unavailable_reason() is not None, reason=str(nixl_backend.unavailable_reason())
)

SHAPE = (3, 2, 8, 4, 2, 8)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]
BLOCK_BYTES = 3 * 2 * 4 * 2 * 8 * 4  # float32
SECRET = bytes(range(32))  # the deployment's KV secret in these tests


@pytest.fixture
def exporter() -> Iterator[nixl_backend.NixlExporter]:
    torch.manual_seed(0)
    exp = nixl_backend.NixlExporter(torch.randn(SHAPE), secret=SECRET)
    try:
        yield exp
    finally:
        exp.close()
        assert [t.name for t in threading.enumerate() if t.name.startswith(("kv-tcp", "kv-nixl"))] == []


@pytest.fixture(scope="module")
def importer() -> Iterator[nixl_backend.NixlImporter]:
    """One importer agent for the module: creating UCX agents is the slow part."""
    imp = nixl_backend.NixlImporter(torch.zeros((3, 2, 5, 4, 2, 8)), secret=SECRET)
    try:
        yield imp
    finally:
        imp.close()


def test_blocks_arrive_byte_exact_from_another_process() -> None:
    code = (
        "import sys, torch; from pdserve.transfer.nixl_backend import NixlExporter;"
        "torch.manual_seed(7); cache = torch.randn(4, 2, 16, 4, 2, 8).to(torch.bfloat16);"
        f"exp = NixlExporter(cache, secret={SECRET!r}); token = exp.register('r', [2, 3, 9, 11]);"
        "print('ADDRESS', exp.address, token.hex(), flush=True); sys.stdin.readline();"
        "exp.close(); print('SERVED', exp.stats.pulls, exp.stats.bytes, flush=True)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdin is not None and proc.stdout is not None

    def line(tag: str) -> list[str]:
        while True:  # NIXL may log on stdout too
            words = proc.stdout.readline().split()  # type: ignore[union-attr]
            assert words or proc.poll() is None, "the exporter process ended"
            if words and words[0] == tag:
                return words[1:]

    local = torch.zeros((4, 2, 6, 4, 2, 8), dtype=torch.bfloat16)
    importer = nixl_backend.NixlImporter(local, secret=SECRET)
    try:
        address, token = line("ADDRESS")
        moved = importer.pull(
            address,
            [9, 2, 3, 11],
            [5, 0, 1, 3],
            timeout=10.0,
            request_id="r",
            lease_token=bytes.fromhex(token),
        )
        torch.manual_seed(7)
        source = torch.randn(4, 2, 16, 4, 2, 8).to(torch.bfloat16)
        for src, dst in zip([9, 2, 3, 11], [5, 0, 1, 3], strict=True):
            assert torch.equal(local[:, :, dst].view(torch.int16), source[:, :, src].view(torch.int16))
        assert torch.count_nonzero(local[:, :, [2, 4]].float()) == 0
        assert moved == 4 * 4 * 2 * 4 * 2 * 8 * 2 and importer.stats.bytes == moved
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert line("SERVED") == ["1", str(moved)]
        assert proc.wait(timeout=30) == 0
    finally:
        importer.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_only_leased_blocks_are_read(
    exporter: nixl_backend.NixlExporter, importer: nixl_backend.NixlImporter
) -> None:
    t1 = exporter.register("r1", [1, 2])
    pulled = importer.pull(exporter.address, [2, 1], [0, 1], timeout=5.0, request_id="r1", lease_token=t1)
    assert pulled == 2 * BLOCK_BYTES
    assert torch.equal(importer.kv_cache[:, :, 0], exporter.kv_cache[:, :, 2])
    with pytest.raises(TransferError, match="not under lease"):
        importer.pull(exporter.address, [1, 5], [0, 1], timeout=5.0, request_id="r1", lease_token=t1)
    with pytest.raises(TransferError, match="wrong lease token"):
        importer.pull(exporter.address, [1], [0], timeout=5.0, request_id="r1", lease_token=bytes(16))
    exporter.unregister("r1")
    with pytest.raises(TransferError, match="no lease"):
        importer.pull(exporter.address, [1], [0], timeout=5.0, request_id="r1", lease_token=t1)
    assert len(exporter.leases) == 0 and exporter._holds == {}


def test_a_lease_ended_during_the_read_fails_the_pull(
    exporter: nixl_backend.NixlExporter, importer: nixl_backend.NixlImporter
) -> None:
    """The read is one-sided: the exporter cannot stop it, so the hold around it decides."""
    token = exporter.register("r", [3])
    side = importer._side
    _, sock = side.call(
        exporter.address, nixl_backend.OP_HOLD, "r", [3], 5.0, lease_token=token
    )  # a read begins
    assert exporter.leases.unregister("r", grace=0.1) is False  # ...the lease ends under it
    with pytest.raises(TransferError, match="ended during the read"):
        side.call(exporter.address, nixl_backend.OP_DONE, "r", [3], 5.0, sock, lease_token=token)
    assert exporter._holds == {}


def test_a_hold_ends_with_its_connection(
    exporter: nixl_backend.NixlExporter, importer: nixl_backend.NixlImporter
) -> None:
    """An importer that dies between HOLD and DONE does not pin the blocks until the grace ends."""
    token = exporter.register("r", [3])
    _, sock = importer._side.call(exporter.address, nixl_backend.OP_HOLD, "r", [3], 5.0, lease_token=token)
    assert len(exporter._holds) == 1
    sock.close()
    started = time.monotonic()
    while exporter._holds and time.monotonic() - started < 5.0:
        time.sleep(0.01)
    assert exporter._holds == {} and exporter.leases.unregister("r", grace=0.0) is True


def test_concurrent_pulls_of_two_requests(
    exporter: nixl_backend.NixlExporter, importer: nixl_backend.NixlImporter
) -> None:
    """The worker pulls on two threads through one importer: each hold stays on its connection."""
    tokens = {"a": exporter.register("a", [0, 1, 2]), "b": exporter.register("b", [4, 5, 6])}
    errors: list[BaseException] = []

    def pull(rid: str, src: list[int], dst: list[int]) -> None:
        try:
            for _ in range(20):
                importer.pull(
                    exporter.address, src, dst, timeout=5.0, request_id=rid, lease_token=tokens[rid]
                )
        except BaseException as exc:
            errors.append(exc)

    threads = [
        threading.Thread(target=pull, args=("a", [0, 1, 2], [0, 1, 2])),
        threading.Thread(target=pull, args=("b", [4, 5], [3, 4])),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert errors == []
    assert torch.equal(importer.kv_cache[:, :, 3:5], exporter.kv_cache[:, :, 4:6])
    assert exporter._holds == {}


def test_layout_mismatch_is_refused(exporter: nixl_backend.NixlExporter) -> None:
    token = exporter.register("r", [0])
    imp = nixl_backend.NixlImporter(torch.zeros((3, 2, 4, 4, 2, 16), dtype=torch.float16), secret=SECRET)
    try:
        with pytest.raises(TransferError, match="layout mismatch"):
            imp.pull(exporter.address, [0], [0], timeout=5.0, request_id="r", lease_token=token)
    finally:
        imp.close()


def test_unreachable_or_silent_exporters_fail_cleanly(importer: nixl_backend.NixlImporter) -> None:
    exp = nixl_backend.NixlExporter(torch.randn(SHAPE), secret=SECRET)
    address = exp.address
    exp.close()
    with pytest.raises(TransferError, match="cannot connect"):
        importer.pull(address, [0], [0], timeout=5.0, request_id="r")
    with socket.create_server(("127.0.0.1", 0)) as silent, pytest.raises(TransferError, match="timed out"):
        importer.pull(f"127.0.0.1:{silent.getsockname()[1]}", [0], [0], timeout=0.3, request_id="r")


def test_fault_injection(exporter: nixl_backend.NixlExporter, importer: nixl_backend.NixlImporter) -> None:
    token = exporter.register("r", [0])
    pulls, failures = importer.stats.pulls, importer.stats.failures
    importer.faults = FaultInjector(rate=1.0)
    try:
        with pytest.raises(TransferError, match="injected fault"):
            importer.pull(exporter.address, [0], [0], timeout=5.0, request_id="r", lease_token=token)
    finally:
        importer.faults = FaultInjector()
    assert (importer.stats.pulls - pulls, importer.stats.failures - failures) == (1, 1)


def test_an_idle_exporter_does_not_spin(exporter: nixl_backend.NixlExporter) -> None:
    """NIXL's own progress thread busy-polls a core; ours runs only while a read is held."""
    started = time.process_time()
    time.sleep(0.5)
    assert time.process_time() - started < 0.1


def test_a_peer_without_the_deployment_key_learns_nothing(exporter: nixl_backend.NixlExporter) -> None:
    """The side channel's handshake guards the NIXL metadata (the cache's memory keys) too."""
    token = exporter.register("r", [0])
    stranger = nixl_backend.NixlImporter(torch.zeros(SHAPE), secret=b"not the key" * 3)
    try:
        with pytest.raises(TransferError, match="refused this worker's KV key"):
            stranger.pull(exporter.address, [0], [0], timeout=5.0, request_id="r", lease_token=token)
        assert stranger._remotes == {} and exporter.refused_connections == 1
    finally:
        stranger.close()
