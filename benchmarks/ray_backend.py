"""What the `ray` cluster backend costs against `local`: time to ready, and TTFT / ITL of the same
workload through `pdserve bench`. Bounded, on 127.0.0.1 only; it stops by itself.

    .venv/bin/python benchmarks/ray_backend.py --model smollm2-135m --repeats 3

One Ray cluster on this host for the whole run (`ray.cluster_utils`: a head with no CPUs, a node
with the prefill resource, one with the decode resource, all on 127.0.0.1). Each repeat starts
`pdserve serve --prefill 1 --decode 1 --transport tcp` once per backend (the order alternates),
times it to its first healthy answer, runs `pdserve bench` (closed loop, one request at a time,
fixed prompt and output lengths) and stops it. Both backends leave workers unpinned
(--no-pin-cpus), so that the difference is Ray's. Prints each run and the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # before Ray is imported: keep 127.0.0.1

import ray  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402
from serving import Server  # noqa: E402


def one_run(backend: str, a: argparse.Namespace, address: str, out: Path) -> dict[str, Any]:
    args = [
        "--prefill",
        "1",
        "--decode",
        "1",
        "--transport",
        "tcp",
        "--no-pin-cpus",
        "--num-kv-blocks",
        "512",
    ]
    if backend == "ray":
        args += [
            "--cluster", "ray", "--ray-address", address,
            "--ray-prefill-resources", '{"pdserve_prefill": 1}', "--ray-decode-resources", '{"pdserve_decode": 1}',
        ]  # fmt: skip
    started = time.perf_counter()
    server = Server(a.model, *args)
    ready_s = time.perf_counter() - started
    try:
        workload = f"concurrency(1) prompt=fixed({a.input_tokens}) output=fixed({a.output_tokens})"
        command = [
            str(ROOT / ".venv" / "bin" / "pdserve"), "bench", "--url", server.url, "--model", server.model,
            "--tokenizer", a.model, "--endpoint", "completions", "--workload", workload,
            "--max-requests", str(a.requests), "--temperature", "0", "--out", str(out), "--no-progress",
        ]  # fmt: skip
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=600)
        s = json.loads((out / "summary.json").read_text())["overall"]
        tcp = server.metric("pdserve_kv_transfer_bytes_count", transport="tcp")
    finally:
        server.stop()
    return {
        "backend": backend,
        "ready_s": round(ready_s, 2),
        "ttft_ms_p50": round(s["ttft_ms"]["p50"], 1),
        "itl_ms_p50": round(s["itl_ms"]["p50"], 2),
        "completed": s["completed"],
        "tcp_pulls": tcp,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=32)
    a = p.parse_args()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 0, "node_ip_address": "127.0.0.1", "include_dashboard": False},
    )
    try:
        for resource in ("pdserve_prefill", "pdserve_decode"):
            cluster.add_node(num_cpus=1, resources={resource: 1}, node_ip_address="127.0.0.1")
        cluster.wait_for_nodes()
        runs = []
        with tempfile.TemporaryDirectory() as tmp:
            for repeat in range(a.repeats):
                order = ("local", "ray") if repeat % 2 == 0 else ("ray", "local")
                for backend in order:
                    run = one_run(backend, a, cluster.address, Path(tmp) / f"{backend}-{repeat}")
                    print(json.dumps(run), flush=True)
                    runs.append(run)
        for key in ("ready_s", "ttft_ms_p50", "itl_ms_p50"):
            medians = {
                b: statistics.median(r[key] for r in runs if r["backend"] == b) for b in ("local", "ray")
            }
            print(
                f"{key}: local {medians['local']}, ray {medians['ray']}, ray/local {medians['ray'] / medians['local']:.2f}"
            )
    finally:
        if ray.is_initialized():
            ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
