"""Pools that grow and shrink while serving, with a real server and real workers: scaled up and
down many times under load without losing a request, a block, a process, a shared-memory segment
or a metric series; a worker that dies while starting is a clear error and a pool that says so; a
dead worker is replaced; a rebalance moves streams onto a worker that just started."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections import Counter
from pathlib import Path

from fakes import control_plane, expected_stream, until
from serving import Server, alive
from test_pools_drain import offline

from pdserve import clock, wire
from pdserve.pools.manager import PoolSettings
from pdserve.transfer.segments import leftover_segments

# Short prompts go to the decode worker itself, longer ones through the prefill pool.
LOAD_PROMPTS = [
    [11 + (j * 5 + i) % 200 for j in range(n)] for i, n in enumerate((4, 9, 40, 120, 260, 33, 700, 15))
]
LOAD_TOKENS = 48
# Scale cycles under load: the pool manager's logic is tested in memory; these prove the wiring
# (processes, segments, metric series: nothing left behind by workers that came and went).
CYCLES = 4


def series(server: Server) -> Counter[str]:
    """How many series of each kind /metrics has that follow the workers: per worker (their names
    left out: they change) and per pool and state. (Counters of events gain a label set the first
    time such an event happens, and keep it: those do not grow with churn.)"""
    return Counter(
        re.sub(r'worker="[^"]*"', "worker=_", line.rsplit(" ", 1)[0])
        for line in server.metrics().splitlines()
        if "worker=" in line or line.startswith("pdserve_pool_")
    )


class Load:
    """Requests in a loop from a thread until stopped; each answer checked against the offline
    engine's. Every request must complete: none may be lost to a worker that comes or goes."""

    def __init__(self, server: Server, expected: list[str], concurrency: int = 3) -> None:
        self.server, self.expected = server, expected
        self.done = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run(concurrency)))
        self._thread.start()

    async def _run(self, concurrency: int) -> None:
        async def one_loop(k: int) -> None:
            i = k
            while not self._stop.is_set():
                prompt = i % len(LOAD_PROMPTS)
                try:
                    answer = await self.server.async_client.completions.create(
                        model=self.server.model,
                        prompt=LOAD_PROMPTS[prompt],
                        max_tokens=LOAD_TOKENS,
                        temperature=0.0,
                        extra_body={"ignore_eos": True},
                    )
                    if answer.choices[0].text != self.expected[prompt]:
                        self.failures.append(f"prompt {prompt}: wrong text")
                except Exception as exc:
                    self.failures.append(f"prompt {prompt}: {exc!r}")
                self.done += 1
                i += concurrency

        await asyncio.gather(*(one_loop(k) for k in range(concurrency)))

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=120)
        assert not self._thread.is_alive()


def test_both_pools_scaled_up_and_down_under_load_lose_nothing(tiny_llama: Path) -> None:
    expected = offline(tiny_llama, LOAD_PROMPTS, LOAD_TOKENS)
    server = Server(
        tiny_llama, "--prefill", "1", "--decode", "1", "--prefill-max", "2", "--decode-max", "2",
        "--num-kv-blocks", "256",
    )  # fmt: skip
    load = Load(server, expected)
    try:
        before: Counter[str] = Counter()
        lines = 0
        for cycle in range(CYCLES):
            assert server.scale("prefill", 2).status_code == 200
            assert server.scale("decode", 2).status_code == 200
            if cycle % 4 == 3:  # now and then: down again while the new workers still start
                time.sleep(0.3)
            else:
                server.wait_pool("prefill", up=2, starting=0)
                server.wait_pool("decode", up=2, starting=0)
            had = {w["id"]: w.get("pid") for pool in ("prefill", "decode") for w in server.workers(pool)}
            assert server.scale("prefill", 1).status_code == 200
            assert server.scale("decode", 1).status_code == 200
            left = server.wait_pool("prefill", up=1, starting=0, draining=0)
            left += server.wait_pool("decode", up=1, starting=0, draining=0)
            assert len(left) == 2
            for worker_id, pid in had.items():  # whatever left the pools is gone for good
                if worker_id not in {w["id"] for w in left} and pid is not None:
                    server.wait_for(lambda p=pid: not alive(p), 20, f"{worker_id} stopped")
                    # A worker stopped while it started is killed: its resource tracker then
                    # removes its segment, a moment after it died.
                    server.wait_for(
                        lambda p=pid: leftover_segments(p) == [], 10, f"{worker_id}'s segment gone"
                    )
            if cycle == 0:
                before, lines = series(server), len(server.metrics().splitlines())
        load.stop()
        assert load.failures == [] and load.done > 20
        server.wait_kv_free()
        for worker in server.workers("prefill") + server.workers("decode"):
            # No mapping of a gone worker's KV segment is kept: it would keep its memory alive.
            maps = Path(f"/proc/{worker['pid']}/maps").read_text().splitlines()
            assert [m for m in maps if "pdserve-kv-" in m and "(deleted)" in m] == []
        # The same series as after the first cycle: the workers that came and went left none.
        after = series(server)
        assert after == before
        assert sum(n for name, n in after.items() if "worker=" in name) == 2 * 11  # 11 gauges a worker
        # Nothing else grows with the churn: at most the label sets of events seen for the first
        # time since, a bounded number of them (a kind of drain or move, a few lines each; a path
        # or pool first seen in a TTFT, ITL or prediction histogram, ~30 lines each).
        assert len(server.metrics().splitlines()) <= lines + 200
        assert server.metric("pdserve_worker_drains_total", outcome="timeout") == 0
        assert server.metric("pdserve_requests_total", outcome="error") == 0
        assert server.metric("pdserve_worker_drains_total") == 2 * CYCLES  # ok, or cancelled while starting
    finally:
        load.stop()
        assert server.stop() == 0  # every worker ever seen is gone, and every segment


def test_a_worker_that_fails_to_start_is_reported_and_retried_after_a_pause() -> None:
    async def scenario() -> None:
        async with control_plane({"decode": 1}) as cp:
            # The next start fails: the pool says why, and tries again after a pause, not at once.
            cp.cluster.failures["decode"] = 1
            cp.pools.scale("decode", 2)
            await until(lambda: cp.pools.describe()["pools"]["decode"]["last_error"] is not None, "the error")
            assert (
                "decode-1 exited with code 1 while starting"
                in cp.pools.describe()["pools"]["decode"]["last_error"]
            )
            assert cp.cluster.started == ["decode-0", "decode-1"]
            await until(lambda: len(cp.up("decode")) == 2, "a new worker up after the pause")
            assert cp.up("decode") == ["decode-0", "decode-2"]
            assert cp.pools.describe()["pools"]["decode"]["last_error"] is None
            assert await cp.stream("r", 4, 3) == expected_stream(4, 3)

    clock.run_virtual(scenario)


def test_a_worker_that_dies_right_after_it_came_up_counts_as_a_failed_start() -> None:
    settings = PoolSettings(start_timeout=10.0, drain_timeout=10.0, settle_seconds=3600.0)

    async def scenario() -> None:
        async with control_plane({"decode": 2}, settings=settings) as cp:
            cp.cluster.crash("decode-1")
            await until(lambda: cp.pools.describe()["pools"]["decode"]["last_error"] is not None, "the error")
            error = cp.pools.describe()["pools"]["decode"]["last_error"]
            assert "decode-1 killed by signal 9" in error and "after it started" in error
            assert cp.pools.pools["decode"].failures == 1  # the next start waits out a pause
            await until(lambda: cp.up("decode") == ["decode-0", "decode-2"], "replaced after the pause")

    clock.run_virtual(scenario)


def test_a_worker_that_dies_is_replaced_or_the_pool_shrinks() -> None:
    async def scenario(replace_failed: bool) -> None:
        settings = PoolSettings(start_timeout=10.0, replace_failed=replace_failed, settle_seconds=0.0)
        async with control_plane({"decode": 2}, settings=settings) as cp:
            cp.cluster.crash("decode-1")
            await until(lambda: "decode-1" not in cp.states("decode"), "decode-1 gone")
            if replace_failed:
                await until(lambda: cp.up("decode") == ["decode-0", "decode-2"], "a new worker up")
                assert cp.pools.targets()["decode"][0] == 2
            else:
                cp.pools.keep_once(time.monotonic())  # the keeper's next round starts nothing
                assert cp.states("decode") == {"decode-0": "up"}
                assert cp.pools.targets()["decode"][0] == 1 and cp.cluster.started == ["decode-0", "decode-1"]

    clock.run_virtual(lambda: scenario(True))
    clock.run_virtual(lambda: scenario(False))


def test_rebalance_moves_the_newest_streams_onto_a_worker_that_started() -> None:
    settings = PoolSettings(start_timeout=10.0, rebalance_on_start=False, settle_seconds=0.0)

    async def scenario() -> None:
        async with control_plane({"decode": 1}, settings=settings, autostep=None) as cp:
            # Stepped by hand: eight streams are all running on decode-0 when decode-1 comes up.
            streams = []
            for i in range(8):  # one a millisecond: r7 is the newest
                streams.append(asyncio.create_task(cp.stream(f"r{i}", 4, 30)))
                await asyncio.sleep(0.001)
            await until(lambda: len(cp.worker("decode-0").requests) == 8, "eight streams on decode-0")
            for _ in range(3):
                cp.worker("decode-0").step()  # three tokens each: KV to move
            cp.pools.scale("decode", 2)
            await until(lambda: len(cp.up("decode")) == 2, "decode-1 up")
            assert cp.pools.rebalance("decode") == {"pool": "decode", "moved": {"decode-0": 4}}
            asked = cp.worker("decode-0").received_of(wire.Migrate)
            assert len(asked) == 1 and sorted(asked[0].request_ids) == sorted(f"r{i}.0" for i in range(4, 8))
            await cp.step_until(lambda: all(s.done() for s in streams), "every stream ended")
            assert [s.result() for s in streams] == [expected_stream(4, 30)] * 8  # none lost a token
            assert len(cp.worker("decode-1").received_of(wire.AddRequest)) == 4
            assert cp.metrics.migrations.labels("rebalance", "ok")._value.get() == 4

    clock.run_virtual(scenario)


def test_pool_gauges_follow_the_workers(tiny_llama: Path) -> None:
    server = Server(tiny_llama, "--prefill", "1", "--decode", "2", "--decode-min", "1")
    try:
        assert re.search(r'pdserve_pool_workers\{pool="decode",state="up"\} 2\.0', server.metrics())
        assert server.metric("pdserve_pool_target_replicas", pool="decode") == 2
        assert server.scale("decode", 1).status_code == 200
        server.wait_pool("decode", up=1, draining=0)
        assert server.metric("pdserve_pool_workers", pool="decode", state="up") == 1
        assert server.metric("pdserve_pool_target_replicas", pool="decode") == 1
        assert 'worker="decode-1"' not in server.metrics()  # its series went with it
    finally:
        assert server.stop() == 0


def test_the_control_plane_never_imports_torch() -> None:
    import subprocess
    import sys

    modules = (
        "pdserve.serve, pdserve.pools.manager, pdserve.pools.cli, pdserve.cluster.local, pdserve.router.app"
    )
    code = f"import sys, {modules}; heavy = {{'torch', 'transformers'}} & set(sys.modules); assert not heavy, heavy"
    subprocess.run([sys.executable, "-c", code], check=True)
