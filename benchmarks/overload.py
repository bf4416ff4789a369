"""Overload: an open-loop load far past capacity gets its excess refused fast, and the requests it
admits keep their latency. Bounded in time, on 127.0.0.1 only; it stops by itself.

    .venv/bin/python benchmarks/overload.py --model smollm2-135m --rates 1 5 --duration 60

For each rate (requests per second, Poisson arrivals, the same prompts) it starts a fresh
`pdserve serve --prefill 1 --decode 1 --max-in-flight N` and streams chat-sized completions at it
for --duration seconds, then prints per rate: how many were admitted and refused (429), the time
to the refusal (p50 / p99: the target is p99 under 50 ms), the admitted requests' TTFT and ITL
(p50 / p99, and TTFT p90: the SLO percentile) and the router's resident memory at the end. The rate-1 run is the baseline the
overloaded run's admitted latency is compared with, in the same invocation.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from serving import Server  # noqa: E402

WORDS = ["the", "sea", "was", "calm", "and", "ships", "came", "home", "one", "by", "before", "storm"]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def one(
    client: httpx.AsyncClient, model: str, prompt: str, max_tokens: int, out: dict[str, Any]
) -> None:
    sent = time.perf_counter()
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            out["status"] = response.status_code
            if response.status_code != 200:
                out["answer_s"] = time.perf_counter() - sent
                out["retry_after"] = response.headers.get("retry-after")
                await response.aread()
                return
            times = []
            async for line in response.aiter_lines():
                if line.startswith("data: {") and '"text":""' not in line.replace(" ", ""):
                    times.append(time.perf_counter() - sent)
            out["ttft_s"] = times[0] if times else None
            out["itl_s"] = [b - a for a, b in itertools.pairwise(times)]
    except httpx.HTTPError as exc:
        out["status"], out["error"] = -1, f"{type(exc).__name__}: {exc}"


async def load(
    server: Server, rate: float, duration: float, seed: int, max_tokens: int
) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    results: list[dict[str, Any]] = []
    tasks = []
    async with httpx.AsyncClient(
        base_url=server.url, timeout=120, limits=httpx.Limits(max_connections=None)
    ) as client:
        start = time.perf_counter()
        at = 0.0
        while at < duration:
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(60, 120)))
            out: dict[str, Any] = {}
            results.append(out)
            tasks.append(asyncio.ensure_future(one(client, server.model, prompt, max_tokens, out)))
            at += rng.expovariate(rate)
        await asyncio.gather(*tasks)
    return results


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def summarize(rate: float, results: list[dict[str, Any]], rss: float) -> dict[str, Any]:
    admitted = [r for r in results if r.get("status") == 200]
    refused = [r for r in results if r.get("status") == 429]
    itls = [g for r in admitted for g in r.get("itl_s", [])]
    ttfts = [r["ttft_s"] for r in admitted if r.get("ttft_s") is not None]
    answer = [r["answer_s"] * 1000 for r in refused]
    ms = lambda v: None if v is None else round(v * 1000, 1)  # noqa: E731
    return {
        "rate": rate,
        "sent": len(results),
        "admitted": len(admitted),
        "refused_429": len(refused),
        "other": sorted({r.get("status") for r in results} - {200, 429}),
        "refusal_ms_p50": None if not answer else round(statistics.median(answer), 1),
        "refusal_ms_p99": None if not answer else round(pct(answer, 0.99) or 0, 1),
        "retry_after_given": all(r.get("retry_after") for r in refused),
        "ttft_ms_p50": ms(pct(ttfts, 0.5)),
        "ttft_ms_p90": ms(pct(ttfts, 0.9)),
        "ttft_ms_p99": ms(pct(ttfts, 0.99)),
        "itl_ms_p50": ms(pct(itls, 0.5)),
        "itl_ms_p99": ms(pct(itls, 0.99)),
        "router_rss_mib": round(rss, 1),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--rates", type=float, nargs="+", default=[1.0, 5.0])
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--max-in-flight", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--serve-args", default="", help="more flags for pdserve serve")
    args = p.parse_args()
    rows = []
    for rate in args.rates:
        server = Server(
            args.model, "--prefill", "1", "--decode", "1", "--max-in-flight", str(args.max_in_flight),
            "--num-kv-blocks", "1024", *args.serve_args.split(),
        )  # fmt: skip
        try:
            results = asyncio.run(load(server, rate, args.duration, args.seed, args.max_tokens))
            rows.append(summarize(rate, results, rss_mib(server.proc.pid)))
        finally:
            server.stop()
        print(json.dumps(rows[-1]), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
