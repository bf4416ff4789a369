"""The local cluster backend with real worker processes: a worker reports the address it bound,
each is pinned to the least used CPU, an exit is noticed, a worker that dies while starting is a
clear error, and nothing outlives `close()`."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import time
from pathlib import Path

import pytest
import zmq
import zmq.asyncio
from serving import alive, children

from pdserve import wire
from pdserve.cluster.base import WorkerExit, WorkerStartError
from pdserve.cluster.local import LocalCluster, worker_command
from pdserve.config import EngineConfig, Role, WorkerConfig
from pdserve.security import DeploymentSecrets, curve_client
from pdserve.transfer.segments import leftover_segments

SECRETS = DeploymentSecrets.generate()


def config(model: Path, worker_id: str, pool: str = "decode") -> WorkerConfig:
    role = {"prefill": Role.PREFILL, "decode": Role.DECODE, "colocated": Role.MIXED}[pool]
    engine = EngineConfig(model=str(model), dtype="float32", role=role, num_kv_blocks=32)
    return WorkerConfig(worker_id, pool, engine, log_level="WARNING")


async def ask_ready(address: str, server_key: str) -> wire.Message:
    context = zmq.asyncio.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    curve_client(sock, SECRETS.router, server_key)
    sock.connect(address)
    try:
        await sock.send(b"")
        while not isinstance(message := wire.decode(await asyncio.wait_for(sock.recv(), 10)), wire.Ready):
            assert isinstance(message, wire.Load)  # its load report comes before its greeting
        return message
    finally:
        sock.close()
        context.term()


def test_workers_start_report_their_addresses_and_stop_leaving_nothing(tiny_llama: Path) -> None:
    async def scenario() -> None:
        cluster = LocalCluster(SECRETS.for_workers())
        exits: list[WorkerExit] = []
        cluster.set_exit_callback(exits.append)
        beats = 0

        async def heartbeat() -> None:  # the event loop keeps turning while workers load
            nonlocal beats
            while True:
                await asyncio.sleep(0.05)
                beats += 1

        ticker = asyncio.create_task(heartbeat())
        started = time.monotonic()
        try:
            prefill, decode = await asyncio.gather(
                cluster.start_worker(config(tiny_llama, "prefill-0", "prefill"), timeout=120),
                cluster.start_worker(config(tiny_llama, "decode-0"), timeout=120),
            )
            elapsed = time.monotonic() - started
            assert beats >= 0.5 * elapsed / 0.05  # never blocked for long
            assert {w.worker_id for w in cluster.workers()} == {"prefill-0", "decode-0"}
            for handle in (prefill, decode):
                assert handle.rpc_address.startswith("tcp://127.0.0.1:")  # bound by the worker
                ready = await ask_ready(handle.rpc_address, handle.rpc_public_key)
                assert isinstance(ready, wire.Ready) and ready.worker_id == handle.worker_id
                assert ready.rpc_address == handle.rpc_address
            if len(os.sched_getaffinity(0)) > 1:  # each on its own CPU
                assert prefill.details["cpus"] != decode.details["cpus"]
            assert prefill.kv_address in leftover_segments(int(prefill.details["pid"]))
            pids = [int(h.details["pid"]) for h in (prefill, decode)]
        finally:
            ticker.cancel()
            await cluster.close()
        assert not [p for p in pids if alive(p)]
        assert not leftover_segments(pids[0])
        assert sorted((e.worker_id, e.expected) for e in exits) == [("decode-0", True), ("prefill-0", True)]
        assert cluster.workers() == []

    asyncio.run(scenario())


def test_a_worker_that_is_killed_is_reported_once_as_unexpected(tiny_llama: Path) -> None:
    async def scenario() -> None:
        cluster = LocalCluster(SECRETS.for_workers(), pin_cpus=False)
        exits: list[WorkerExit] = []
        cluster.set_exit_callback(exits.append)
        try:
            handle = await cluster.start_worker(config(tiny_llama, "decode-0"), timeout=120)
            os.kill(int(handle.details["pid"]), signal.SIGKILL)
            for _ in range(100):
                if exits:
                    break
                await asyncio.sleep(0.05)
            assert exits == [WorkerExit("decode-0", expected=False, reason="killed by signal 9 (SIGKILL)")]
            assert cluster.workers() == []
            await cluster.stop_worker("decode-0")  # already gone: not an error
        finally:
            await cluster.close()
        assert len(exits) == 1

    asyncio.run(scenario())


def test_a_worker_that_dies_while_starting_is_a_clear_error_and_leaves_nothing(tiny_llama: Path) -> None:
    async def scenario() -> None:
        cluster = LocalCluster(SECRETS.for_workers(), pin_cpus=False)
        exits: list[WorkerExit] = []
        cluster.set_exit_callback(exits.append)
        start = asyncio.create_task(cluster.start_worker(config(tiny_llama, "decode-0"), timeout=120))
        while not (pids := children(os.getpid())):
            await asyncio.sleep(0.01)
        os.kill(pids[0], signal.SIGKILL)
        with pytest.raises(WorkerStartError, match=r"decode-0 killed by signal 9 .* while starting"):
            await start
        assert cluster.workers() == [] and exits == []  # a failed start says so through start_worker
        await cluster.close()

    asyncio.run(scenario())


def test_a_start_that_times_out_or_is_cancelled_kills_the_process(tiny_llama: Path) -> None:
    async def scenario() -> None:
        cluster = LocalCluster(SECRETS.for_workers(), pin_cpus=False)
        with pytest.raises(WorkerStartError, match=r"did not report ready within 0\.2 s"):
            await cluster.start_worker(config(tiny_llama, "decode-0"), timeout=0.2)
        assert not [p for p in children(os.getpid()) if alive(p)]
        start = asyncio.create_task(cluster.start_worker(config(tiny_llama, "decode-1"), timeout=120))
        await asyncio.sleep(0.3)
        start.cancel()
        with pytest.raises(asyncio.CancelledError):
            await start
        assert not [p for p in children(os.getpid()) if alive(p)]
        await cluster.close()

    asyncio.run(scenario())


def test_a_worker_gets_its_secrets_but_not_the_routers_http_keys(
    monkeypatch: pytest.MonkeyPatch, tiny_llama: Path
) -> None:
    monkeypatch.setenv("PDSERVE_API_KEY", "sk-router-only-0123456789")
    monkeypatch.setenv("PDSERVE_ADMIN_KEY", "admin-router-only-0123456789")
    argv, env = worker_command(config(tiny_llama, "w0"), SECRETS.for_workers())
    assert "PDSERVE_API_KEY" not in env and "PDSERVE_ADMIN_KEY" not in env
    assert (
        SECRETS.router.public in env["PDSERVE_WORKER_SECRETS"]
        and SECRETS.router.secret not in env["PDSERVE_WORKER_SECRETS"]
    )
    assert not any("secret" in a.lower() or "key" in a.lower() for a in argv[1:] if a != "--worker-id")


def test_a_worker_with_a_gpu_sees_only_that_gpu(monkeypatch: pytest.MonkeyPatch, tiny_llama: Path) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _, env = worker_command(
        dataclasses.replace(config(tiny_llama, "w0"), gpu=3, sm_share=40), SECRETS.for_workers()
    )
    assert env["CUDA_VISIBLE_DEVICES"] == "3" and env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "40"
    _, env = worker_command(config(tiny_llama, "w1"), SECRETS.for_workers())  # no GPU of its own
    assert "CUDA_VISIBLE_DEVICES" not in env and "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in env
