"""Router overhead: what the HTTP router adds on top of talking to a worker directly.

Two measurements, each against the same kind of worker (one `mixed` worker, one torch thread):
- latency: sequential requests with an 8-token prompt and max_tokens=1, p50 of the round trip,
  (a) over ZeroMQ straight to the worker (what the router itself does), and (b) through
  `pdserve serve` over HTTP (OpenAI /v1/completions, httpx with keep-alive). (b) - (a) is the
  router's added latency.
- streaming: C concurrent streams of L tokens each; chunks/s the clients receive, and the router
  process's CPU seconds per chunk (from /proc), whose inverse is what one core of router sustains.
  The direct baseline is the worker's own token rate seen by a ZeroMQ client.

The worker runs on CPU 1, the router (all its threads) and the client on CPU 0. The default model
is a tiny random Llama (built here with transformers, as the tests do) so that the model's compute
does not drown the overhead; `--model` takes any other.

    .venv/bin/python benchmarks/router_overhead.py --repeats 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import zmq

from pdserve import wire
from pdserve.cluster.local import start_worker_process
from pdserve.config import EngineConfig, Role, WorkerConfig
from pdserve.security import DeploymentSecrets, curve_client

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [65, 66, 67, 68, 69, 70, 71, 72]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def pin_process(pid: int, cpu: int) -> None:
    for tid in os.listdir(f"/proc/{pid}/task"):
        os.sched_setaffinity(int(tid), {cpu})


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def build_tiny_model(out: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import make_tiny_model  # the tests' tiny random Llama and byte tokenizer

    return make_tiny_model(out, "llama", {"tie_word_embeddings": False, "max_position_embeddings": 4096})


# -- direct: ZeroMQ to one worker -------------------------------------------------------------------
class DirectWorker:
    def __init__(self, model: str) -> None:
        engine = EngineConfig(model=model, dtype="float32", role=Role.MIXED, num_kv_blocks=2048)
        config = WorkerConfig("w", "colocated", engine, cpus="1")
        secrets = DeploymentSecrets.generate()  # this script plays the router
        self.proc, ready = start_worker_process(config, secrets.for_workers(), stderr=subprocess.DEVNULL)
        self.address = ready.rpc_address
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        curve_client(self.sock, secrets.router, ready.rpc_public_key)
        self.sock.connect(self.address)
        self.sock.send(b"")
        assert isinstance(self.recv(120), wire.Ready)
        self.ids = 0

    def recv(self, timeout: float = 30) -> wire.Message:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("worker silent")
        return wire.decode(self.sock.recv())

    def run(self, n_requests: int, max_tokens: int) -> tuple[list[float], int]:
        """Sends n requests at once; returns each one's latency and the total tokens received."""
        params = wire.WireSamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        started: dict[str, float] = {}
        for _ in range(n_requests):
            self.ids += 1
            started[f"r{self.ids}"] = time.perf_counter()
            self.sock.send(wire.encode(wire.AddRequest(f"r{self.ids}", PROMPT, params)))
        latencies, tokens = [], 0
        while started:
            message = self.recv()
            if isinstance(message, wire.Tokens) and message.request_id in started:
                tokens += len(message.token_ids)
                if message.finish_reason is not None:
                    latencies.append(time.perf_counter() - started.pop(message.request_id))
        return latencies, tokens

    def stop(self) -> None:
        self.sock.send(wire.encode(wire.Shutdown()))
        self.proc.wait(30)
        self.sock.close()


# -- through the router ---------------------------------------------------------------------------------
class RoutedServer:
    def __init__(self, model: str) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--model", model, "--colocated", "1"]
        cmd += ["--port", str(self.port), "--dtype", "float32", "--num-kv-blocks", "2048"]
        cmd += ["--no-pin-cpus", "--log-level", "WARNING", "--max-in-flight", "4096"]
        self.proc = subprocess.Popen(cmd)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise RuntimeError("pdserve serve did not start")
            time.sleep(0.2)
        worker = int(Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children").read_text().split()[0])
        pin_process(worker, 1)
        pin_process(self.proc.pid, 0)

    def latencies(self, model: str, n: int) -> list[float]:
        body = {"model": model, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, "ignore_eos": True}
        result = []
        with httpx.Client(base_url=self.url, timeout=30) as client:
            for _ in range(n):
                started = time.perf_counter()
                response = client.post("/v1/completions", json=body)
                result.append(time.perf_counter() - started)
                assert response.status_code == 200, response.text
        return result

    async def stream(self, model: str, streams: int, max_tokens: int) -> tuple[int, float, float]:
        """Returns (chunks received, wall seconds, router CPU seconds)."""
        body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
        body |= {"ignore_eos": True, "stream": True}
        limits = httpx.Limits(max_connections=streams + 4)

        async def one(client: httpx.AsyncClient) -> int:
            chunks = 0
            async with client.stream("POST", "/v1/completions", json=body) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
            return chunks

        async with httpx.AsyncClient(base_url=self.url, timeout=120, limits=limits) as client:
            cpu0, t0 = cpu_seconds(self.proc.pid), time.perf_counter()
            counts = await asyncio.gather(*(one(client) for _ in range(streams)))
            wall, cpu = time.perf_counter() - t0, cpu_seconds(self.proc.pid) - cpu0
        return sum(counts), wall, cpu

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(60)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: a tiny random Llama built here")
    p.add_argument("--requests", type=int, default=300, help="sequential requests per latency run")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--stream-tokens", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()
    os.sched_setaffinity(0, {0})  # the client shares CPU 0 with the router, never the worker's

    with tempfile.TemporaryDirectory() as tmp:
        model = args.model or str(build_tiny_model(Path(tmp) / "tiny"))
        runs: list[dict[str, float]] = []
        for repeat in range(args.repeats):
            direct = DirectWorker(model)
            try:
                direct.run(20, 1)  # warm-up
                lat_direct = [direct.run(1, 1)[0][0] for _ in range(args.requests)]
                t0 = time.perf_counter()
                _, direct_tokens = direct.run(args.streams, args.stream_tokens)
                direct_rate = direct_tokens / (time.perf_counter() - t0)
            finally:
                direct.stop()
            routed = RoutedServer(model)
            try:
                name = model
                routed.latencies(name, 20)  # warm-up
                cpu_before = cpu_seconds(routed.proc.pid)
                lat_routed = routed.latencies(name, args.requests)
                cpu_per_request = (cpu_seconds(routed.proc.pid) - cpu_before) / args.requests
                chunks, wall, cpu = asyncio.run(routed.stream(name, args.streams, args.stream_tokens))
            finally:
                routed.stop()
            run = {
                "direct_p50_ms": statistics.median(lat_direct) * 1000,
                "routed_p50_ms": statistics.median(lat_routed) * 1000,
                "added_p50_ms": (statistics.median(lat_routed) - statistics.median(lat_direct)) * 1000,
                "router_cpu_ms_per_request": cpu_per_request * 1000,
                "direct_tokens_per_s": direct_rate,
                "routed_chunks_per_s": chunks / wall,
                "router_cpu_us_per_chunk": cpu / chunks * 1e6,
                "router_chunks_per_cpu_s": chunks / cpu if cpu else float("inf"),
            }
            runs.append(run)
            print(f"run {repeat + 1}: " + ", ".join(f"{k}={v:.3g}" for k, v in run.items()), flush=True)
        summary = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        print("median: " + ", ".join(f"{k}={v:.3g}" for k, v in summary.items()))
        if args.out:
            args.out.write_text(json.dumps({"runs": runs, "median": summary}, indent=2))


if __name__ == "__main__":
    main()
