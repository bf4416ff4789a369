"""Test helper (not a test module): a real `pdserve serve` process on 127.0.0.1 and what tests ask
of it (its workers' pids, its metrics, a clean stop). Every server stops by itself: each test
bounds its requests and time, and `stop()` kills whatever is left."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai

from pdserve.transfer.segments import leftover_segments


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except FileNotFoundError:
        return []
    return [int(p) for p in text.split()]


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):  # gone, or went between open and read
        return False
    return state != "Z"


class Server:
    def __init__(
        self,
        model: Path | str,
        *args: str,
        ready_timeout: float = 180.0,
        env: dict[str, str] | None = None,
        api_key: str = "unused",
        admin_key: str | None = None,
    ) -> None:
        """`env`: added to this process's environment for the server; `api_key`: what the
        OpenAI clients send; `admin_key`: what `http` (the admin API, /metrics) sends."""
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = str(model)
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--model", self.model, "--port", str(self.port)]
        cmd += ["--dtype", "float32", "--num-kv-blocks", "128", "--log-level", "WARNING", *args]
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})})
        headers = {"Authorization": f"Bearer {admin_key}"} if admin_key else {}
        self.http = httpx.Client(base_url=self.url, timeout=30.0, headers=headers)
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60.0)
        self.async_client = openai.AsyncOpenAI(
            base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60.0
        )
        self.seen_pids: set[int] = set()  # every worker process seen, for the leak check at stop
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"pdserve serve exited with {self.proc.returncode} before it was ready")
            try:
                if self.http.get("/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"pdserve serve not ready within {ready_timeout} s")
            time.sleep(0.2)
        self.worker_pids = self._worker_pids()

    def _worker_pids(self) -> dict[str, int]:
        pids = {}
        for pid in children(self.proc.pid):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            if b"pdserve.worker" in cmdline:
                pids[cmdline[cmdline.index(b"--worker-id") + 1].decode()] = pid
        self.seen_pids.update(pids.values())
        return pids

    # -- the admin API --------------------------------------------------------------------------------
    def pools(self) -> dict[str, Any]:
        return dict(self.admin_view()["pools"])

    def admin_view(self) -> dict[str, Any]:
        """The whole GET /pools answer (pools, planner, signals)."""
        view: dict[str, Any] = self.http.get("/pools").json()
        pools = view["pools"]
        self.seen_pids.update(w["pid"] for p in pools.values() for w in p["workers"] if "pid" in w)
        return view

    def workers(self, pool: str, state: str | None = None) -> list[dict[str, Any]]:
        return [w for w in self.pools()[pool]["workers"] if state is None or w["state"] == state]

    def scale(self, pool: str, replicas: int) -> httpx.Response:
        return self.http.put(f"/pools/{pool}", json={"replicas": replicas})

    def drain(self, worker_id: str, **body: bool) -> httpx.Response:
        return self.http.post(f"/workers/{worker_id}/drain", json=body)

    def wait_pool(self, pool: str, timeout: float = 60.0, **states: int) -> list[dict[str, Any]]:
        """Until the pool's workers are in exactly these numbers per state (up=2, draining=0, ...)."""

        def reached() -> bool:
            workers = self.workers(pool)
            return all(sum(w["state"] == s for w in workers) == n for s, n in states.items())

        self.wait_for(reached, timeout, f"pool {pool} at {states}")
        return self.workers(pool)

    def metrics(self) -> str:
        return self.http.get("/metrics").text

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples of `name` whose labels include `labels`."""
        total = 0.0
        for line in self.metrics().splitlines():
            match = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})? (\S+)$", line)
            if not match or match.group(1) != name:
                continue
            sample_labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
            if all(sample_labels.get(k) == v for k, v in labels.items()):
                total += float(match.group(3))
        return total

    def wait_for(self, condition: object, timeout: float = 20.0, what: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not condition():  # type: ignore[operator]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not reached within {timeout} s")
            time.sleep(0.1)

    def wait_kv_free(self, timeout: float = 20.0) -> None:
        """Until every live worker reports zero KV blocks in use (leases, streams, pulls all done)."""
        self.wait_for(
            lambda: self.metric("pdserve_worker_kv_blocks_used") == 0, timeout, "all KV blocks free"
        )

    def kill_worker(self, worker_id: str) -> None:
        os.kill(self.worker_pids[worker_id], signal.SIGKILL)

    def stop(self, sig: int = signal.SIGINT, timeout: float = 30.0) -> int:
        """Stops the server and checks it left no worker process and no shared-memory segment."""
        if self.proc.poll() is None:
            self._worker_pids()  # those started while serving too
        workers = sorted(self.seen_pids)
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        for client in (self.http, self.client):
            client.close()
        deadline = time.monotonic() + 10
        while any(alive(p) for p in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [p for p in workers if alive(p)]
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"worker processes {left} outlived the server"
        segments = [s for p in workers for s in leftover_segments(p)]
        assert not segments, f"shared-memory segments left behind: {segments}"
        return code
