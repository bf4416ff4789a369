"""What moving a stream costs: the KV transfer per stream against its context, and the gap the move
puts in the stream against that stream's own ITL p50, for each KV transport.

`pdserve serve --prefill 1 --decode 2` (SmolLM2 by default). One greedy stream at a time: a prompt
of C - 32 tokens, 32 tokens streamed, then its decode worker is drained (`POST /workers/{id}/drain`)
so the stream moves to the other decode worker with C tokens of context, and 64 more tokens come
from there. Then the pool is scaled back to two. For each stream:
- the KV pull of the move, as the receiving worker timed it (`pdserve_kv_transfer_seconds`), and
  its bytes;
- the gap the router measured (`pdserve_migration_stream_gap_seconds`: last token on the old
  worker to the first on the new one), and the largest gap the client saw;
- the stream's ITL p50 (every gap between its tokens, as the client saw them, the move's included).
Medians over `--repeats` streams per context. Target (issue 9): at 2048 tokens of context on shm,
the worst gap of a moved stream under 2x its ITL p50.

    .venv/bin/python benchmarks/migration.py --transports shm,tcp,nixl --repeats 3
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

BEFORE, AFTER = 32, 64  # tokens streamed before the move and after it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        match = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})? (\S+)$", line)
        if not match or match.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', match.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(match.group(3))
    return total


class Server:
    def __init__(self, model: str, transport: str, kv_blocks: int) -> None:
        self.port = free_port()
        cmd = [sys.executable, "-m", "pdserve.cli", "serve", "--model", model, "--port", str(self.port)]
        cmd += ["--prefill", "1", "--decode", "2", "--decode-min", "1", "--transport", transport]
        cmd += ["--num-kv-blocks", str(kv_blocks), "--no-rebalance-on-start", "--log-level", "WARNING"]
        self.proc = subprocess.Popen(cmd)
        self.http = httpx.Client(base_url=f"http://127.0.0.1:{self.port}", timeout=60)
        self.wait(lambda: self._health() == 200, 300, "the server")

    def _health(self) -> int:
        try:
            return self.http.get("/health").status_code
        except httpx.TransportError:
            if self.proc.poll() is not None:
                raise RuntimeError("pdserve serve exited") from None
            return 0

    def wait(self, condition: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready within {timeout} s")
            time.sleep(0.1)

    def decode_workers(self) -> list[dict[str, Any]]:
        return list(self.http.get("/pools").json()["pools"]["decode"]["workers"])

    def metrics(self) -> str:
        return self.http.get("/metrics").text

    def stop(self) -> None:
        self.proc.send_signal(2)
        self.proc.wait(60)
        self.http.close()


def one_move(server: Server, model: str, context: int, transport: str) -> dict[str, float]:
    """One stream moved at `context` tokens; its figures."""
    server.wait(lambda: sum(w["state"] == "up" for w in server.decode_workers()) == 2, 300, "decode")
    before = server.metrics()
    prompt = [100 + (7 * i) % 20000 for i in range(context - BEFORE)]
    body = {"model": model, "prompt": prompt, "max_tokens": BEFORE + AFTER, "temperature": 0.0}
    body |= {"stream": True, "ignore_eos": True}
    arrivals: list[float] = []
    with server.http.stream("POST", "/v1/completions", json=body) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk["choices"][0]["text"] or chunk["choices"][0]["finish_reason"] is None:
                arrivals.append(time.perf_counter())
            if len(arrivals) == BEFORE:
                [source] = [w for w in server.decode_workers() if w["streams"] == 1]
                answer = server.http.post(f"/workers/{source['id']}/drain")
                assert answer.status_code == 200, answer.text
    after = server.metrics()
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    delta = {
        name: metric(after, name, **labels) - metric(before, name, **labels)
        for name, labels in [
            ("pdserve_kv_transfer_seconds_sum", {"transport": transport, "kind": "stream"}),
            ("pdserve_kv_transfer_seconds_count", {"transport": transport, "kind": "stream"}),
            ("pdserve_kv_transfer_bytes_sum", {"transport": transport, "kind": "stream"}),
            ("pdserve_migration_stream_gap_seconds_sum", {}),
            ("pdserve_migration_stream_gap_seconds_count", {}),
        ]
    }
    assert delta["pdserve_migration_stream_gap_seconds_count"] == 1, "the stream did not move"
    assert delta["pdserve_kv_transfer_seconds_count"] == 1
    assert server.http.put("/pools/decode", json={"replicas": 2}).status_code == 200  # back to two
    return {
        "kv_seconds": delta["pdserve_kv_transfer_seconds_sum"],
        "kv_bytes": delta["pdserve_kv_transfer_bytes_sum"],
        "router_gap": delta["pdserve_migration_stream_gap_seconds_sum"],
        "move_gap": max(gaps[BEFORE - 1 : BEFORE + 2]),  # the drain is asked for after token 32
        "first_gap": gaps[0],  # the first token (prefill worker) to the second (decode worker)
        "max_gap": max(gaps),
        "itl_p50": statistics.median(gaps),
        "tokens": len(arrivals),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--transports", default="shm,tcp")
    p.add_argument("--contexts", default="256,512,1024,2048,4096")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--kv-blocks", type=int, default=1024, help="per worker (16 tokens a block)")
    p.add_argument("--out", type=Path, default=None, help="write every figure as JSON here")
    args = p.parse_args()
    contexts = [int(c) for c in args.contexts.split(",")]
    results: dict[str, dict[int, list[dict[str, float]]]] = {}
    for transport in args.transports.split(","):
        server = Server(args.model, transport, args.kv_blocks)
        try:
            one_move(server, args.model, 256, transport)  # warm-up
            results[transport] = {}
            for repeat in range(args.repeats):  # contexts take turns: noise spreads over all
                for context in contexts:
                    figures = one_move(server, args.model, context, transport)
                    results[transport].setdefault(context, []).append(figures)
                    print(transport, context, repeat, json.dumps(figures), flush=True)
        finally:
            server.stop()
    print()
    print(
        "| transport | context | KV moved | its pull | move gap (router) | move gap (client) "
        "| worst gap | ITL p50 | move gap / p50 | worst / p50 |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for transport, by_context in results.items():
        for context, runs in by_context.items():
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            print(
                f"| {transport} | {context} | {med['kv_bytes'] / 2**20:.0f} MiB "
                f"| {med['kv_seconds'] * 1000:.1f} ms | {med['router_gap'] * 1000:.0f} ms "
                f"| {med['move_gap'] * 1000:.0f} ms | {med['max_gap'] * 1000:.0f} ms "
                f"| {med['itl_p50'] * 1000:.0f} ms "
                f"| {statistics.median(r['move_gap'] / r['itl_p50'] for r in runs):.2f}x "
                f"| {statistics.median(r['max_gap'] / r['itl_p50'] for r in runs):.2f}x |"
            )
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
