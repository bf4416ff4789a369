"""Multi-turn chat with and without prefix caching (issue 34): TTFT by turn, goodput and the hit
rate against an oracle placement's, DPD and colocated, measured in one `pdserve bench compare` run (the configurations take
turns, same conversations), optionally beside endpoints already running (vLLM with its prefix
caching on: `--url vllm=http://127.0.0.1:8100`).

    python benchmarks/conversations.py --out runs/conversations --duration 120 --repeats 3

Writes `conversations.md` (the table) into --out, beside bench compare's own report. A turn's TTFT
is the median over the repeats of that turn's p50 / p90; the hit rate is the server's own
(`pdserve_prefix_cache_hits_total / _queries_total` over the run, every pool), or "-" for an
endpoint without those metrics.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from pdserve.bench.summary import RequestRecord, read_records

ROOT = Path(__file__).resolve().parent.parent
WORKLOAD = (
    "talk: poisson(0.25) prompt=lognormal(300,0.4,96,800) output=uniform(32,64) "
    "turns=uniform(3,6) followup=lognormal(40,0.5,8,160) think=lognormal(2000,0.5,500,8000)"
)
CONFIGS = (
    "dpd=--prefill 1 --decode 1",
    "dpd-no-cache=--prefill 1 --decode 1 --no-prefix-cache",
    "colocated=--colocated 2",
    "colocated-no-cache=--colocated 2 --no-prefix-cache",
)


def oracle_hit_rate(records: list[RequestRecord], block_size: int) -> float:
    """The hit rate if every turn went where its conversation was cached and nothing was ever
    evicted: each later turn finds the whole blocks of the turn before it (its prompt and the
    answer's computed KV), at least its own last token computed; first turns find nothing."""
    sessions: dict[int, list[RequestRecord]] = {}
    for r in records:
        if r.session is not None and r.ok:
            sessions.setdefault(r.session, []).append(r)
    found = looked_up = 0
    for turns in sessions.values():
        turns.sort(key=lambda r: r.turn)
        for before, after in zip([None, *turns], turns, strict=False):
            looked_up += after.prompt_tokens
            if before is not None:
                reusable = min(before.prompt_tokens + before.output_tokens - 1, after.prompt_tokens - 1)
                found += reusable // block_size * block_size
    return found / looked_up if looked_up else float("nan")


def table(median: dict[str, dict[str, Any]], oracle: dict[str, float]) -> str:
    lines = [
        "| config | turn | requests | prompt tokens (mean) | TTFT p50 ms | TTFT p90 ms |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, summary in median.items():
        for turn, t in summary.get("turns", {}).items():
            d = t["ttft_ms"]
            lines.append(
                f"| {name} | {turn} | {t['completed']} | {t['prompt_tokens_mean']:.0f} | {d['p50']:.1f} | {d['p90']:.1f} |"
            )
    lines += [
        "",
        "| config | goodput req/s | within SLO | TTFT p50 ms | ITL p50 ms | ITL p90 ms | hit rate | oracle's | share |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, summary in median.items():
        o = summary["overall"]
        share = o.get("good_requests", 0) / o["requests"] if o.get("requests") else 0.0
        cache = summary.get("prefix_cache", {})
        rate = f"{cache['hit_rate']:.0%}" if cache else "-"
        of_oracle = f"{cache['hit_rate'] / oracle[name]:.0%}" if cache and oracle.get(name) else "-"
        lines.append(
            f"| {name} | {o.get('goodput', float('nan')):.2f} | {share:.0%} | {o['ttft_ms']['p50']:.1f} | "
            f"{o['itl_ms']['p50']:.1f} | {o['itl_ms']['p90']:.1f} | {rate} | {oracle.get(name, float('nan')):.0%} | {of_oracle} |"
        )
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workload", default=WORKLOAD)
    p.add_argument("--duration", type=float, default=120.0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--slo", default="ttft=1000,itl=200")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", action="append", default=None, metavar="LABEL=SERVE_ARGS")
    p.add_argument(
        "--url", action="append", default=[], metavar="LABEL=URL", help="an endpoint already running"
    )
    p.add_argument("--drain-timeout", type=float, default=120.0)
    p.add_argument(
        "--block-size", type=int, default=64, help="the servers' KV block size (the oracle's unit)"
    )
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    command = [sys.executable, "-m", "pdserve.cli", "bench", "compare", "--model", args.model]
    for config in args.config or CONFIGS:
        command += ["--config", config]
    for url in args.url:
        command += ["--url", url]
    command += ["--workload", args.workload, "--duration", str(args.duration), "--repeats", str(args.repeats)]
    command += ["--slo", args.slo, "--seed", str(args.seed), "--drain-timeout", str(args.drain_timeout)]
    subprocess.run([*command, "--out", str(args.out)], check=True, cwd=ROOT)
    median = json.loads((args.out / "summaries.json").read_text())["median"]
    oracle = {
        name: statistics.median(
            oracle_hit_rate(read_records(path), args.block_size)
            for path in sorted(args.out.glob(f"records_{name}*.jsonl"))
            if path.stem in (f"records_{name}", *(f"records_{name}_r{r + 1}" for r in range(args.repeats)))
        )
        for name in median
    }
    text = f"workload: `{args.workload}`, {args.duration:g} s, {args.repeats} repeats, SLO {args.slo}\n\n"
    text += table(median, oracle) + "\n"
    (args.out / "conversations.md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
