"""`pdserve bench`: drive any OpenAI-compatible server with a workload and summarize. No torch.

    pdserve bench --url http://127.0.0.1:8000 --model smollm2-135m --workload chat+docs \\
        --duration 120 --slo ttft=1000,itl=200 --out runs/dpd

Writes `records.jsonl` (one line per request: class, send time, every chunk's arrival time,
prompt and output tokens, error), `summary.json` and the plots (CDFs of TTFT and ITL, the ITL
timeline with long-prompt arrivals marked, the run's timeline) into `--out`.

The timeline (`summary.json`'s "timeline", a table after the summary, `timeline.png`): latency and
SLO attainment per `--timeline-window` seconds, and, from a pdserve endpoint, the pools' workers
by state sampled from GET /pools every `--pool-sample-interval` seconds, their worker-seconds,
and for each `step(...)` of the workload how the run took it (see pdserve/bench/timeline.py).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pdserve.bench.client import PreparedRequest, Progress, Target, run_load
from pdserve.bench.summary import (
    RequestRecord,
    format_summary,
    parse_slos,
    redacted_command,
    summarize,
    write_records,
)
from pdserve.bench.timeline import (
    DEFAULT_POOL_SAMPLE_INTERVAL_S,
    DEFAULT_WINDOW_S,
    build_timeline,
    format_timeline,
)
from pdserve.bench.workload import NAMED_MIXES, Workload, parse_workload
from pdserve.errors import PdserveError

logger = logging.getLogger("pdserve.bench")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    p.add_argument("--model", required=True, help="the model name the server expects")
    p.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="the server's API key (default: $PDSERVE_API_KEY, else $OPENAI_API_KEY)",
    )
    p.add_argument(
        "--admin-key",
        default=os.environ.get("PDSERVE_ADMIN_KEY"),
        help="the server's admin key, for GET /pools (default: $PDSERVE_ADMIN_KEY)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="where the server's tokenizer is (built-in name, .gguf file or Hugging Face folder); "
        "default: --model. Prompt token counts are exact for this tokenizer.",
    )
    add_workload_arguments(p)
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    p.add_argument(
        "--prompt-format",
        choices=["ids", "text"],
        default="ids",
        help="completions only: send token ids (exact counts) or text (chat always sends text)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--slo", default=None, help="e.g. ttft=1000,itl=200 or tpot=100 (milliseconds)")
    p.add_argument(
        "--drain-timeout", type=float, default=120.0, help="seconds for requests in flight at the end"
    )
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument(
        "--timeline-window",
        type=float,
        default=DEFAULT_WINDOW_S,
        help="seconds per window of the timeline (requests by send time)",
    )
    p.add_argument(
        "--pool-sample-interval",
        type=float,
        default=DEFAULT_POOL_SAMPLE_INTERVAL_S,
        help="seconds between samples of GET /pools (a pdserve server's pools) for the timeline; 0: off. "
        "An endpoint without the route is not sampled, and the run goes on.",
    )
    p.add_argument("--out", type=Path, default=None, help="folder for records.jsonl and summary.json")
    p.add_argument("--no-progress", action="store_true")


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    """The workload's flags: `pdserve bench`'s, and `pdserve sim`'s and `pdserve plan`'s."""
    p.add_argument(
        "--workload",
        default="chat",
        help=f"a workload spec or a preset ({', '.join(NAMED_MIXES)}); see pdserve/bench/workload.py",
    )
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--duration", type=float, default=None, help="seconds; no request is sent after it")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply every class's rate by this")
    p.add_argument("--seed", type=int, default=0)


def prepare(
    workload: Workload, tokenizer_name: str, endpoint: str, prompt_format: str, seed: int
) -> list[PreparedRequest]:
    from pdserve.bench.prompts import PromptBuilder
    from pdserve.text.tokenizer import load_router_tokenizer

    builder = PromptBuilder(load_router_tokenizer(tokenizer_name), seed)
    prepared = []
    for spec in workload.requests:
        prompt: str | list[int]
        if endpoint == "completions" and prompt_format == "ids":
            prompt, count = builder.token_ids(spec.prompt_tokens), spec.prompt_tokens
        else:
            prompt, count = builder.text(spec.prompt_tokens)
        prepared.append(
            PreparedRequest(
                spec.index,
                spec.cls,
                spec.arrival_s,
                prompt,
                count,
                spec.output_tokens,
                spec.session,
                spec.turn,
                spec.think_s,
            )
        )
    return prepared


def conversation_encoder(
    workload: Workload, tokenizer_name: str, endpoint: str, prompt_format: str
) -> Callable[[str], list[int]] | None:
    """text -> token ids, for conversations sent as ids (their answers come back as text); None
    when there is none to send so."""
    if endpoint != "completions" or prompt_format != "ids" or not any(r.turn for r in workload.requests):
        return None
    from pdserve.text.tokenizer import load_router_tokenizer

    tokenizer = load_router_tokenizer(tokenizer_name)
    return lambda text: tokenizer.encode(text, add_special_tokens=False)


def check_timeline_options(args: argparse.Namespace) -> None:
    if not (args.timeline_window > 0 and math.isfinite(args.timeline_window)):
        raise PdserveError(f"--timeline-window must be a number of seconds > 0, got {args.timeline_window:g}")
    if not (args.pool_sample_interval >= 0 and math.isfinite(args.pool_sample_interval)):
        raise PdserveError(
            f"--pool-sample-interval must be a number of seconds >= 0 (0: off), got {args.pool_sample_interval:g}"
        )


def run(args: argparse.Namespace) -> int:
    if args.max_requests is None and args.duration is None:
        raise PdserveError("give --max-requests or --duration (or both): a benchmark must end by itself")
    check_timeline_options(args)
    slos = parse_slos(args.slo)
    workload = parse_workload(args.workload, args.seed, args.max_requests, args.duration, args.rate_scale)
    # Said before the prompts are built, which can take a while: the user sees what is coming.
    print(f"workload ({len(workload.requests)} requests):\n{workload.describe()}", file=sys.stderr)
    try:
        requests = prepare(
            workload, args.tokenizer or args.model, args.endpoint, args.prompt_format, args.seed
        )
    except KeyboardInterrupt:  # a Ctrl-C while the prompts are built: a message, not a traceback
        print("\ninterrupted before any request was sent: nothing measured", file=sys.stderr)
        return 130
    target = Target(
        args.url.rstrip("/"),
        args.model,
        args.endpoint,
        args.temperature,
        args.request_timeout,
        api_key=args.api_key,
        admin_key=args.admin_key,
    )

    records: list[RequestRecord] = []
    pool_samples: list[dict[str, Any]] = []
    progress = None if args.no_progress else Progress(len(requests))
    ended: list[float] = []  # the run's duration, from run_load, however it ended
    parts: dict[str, Any] = {}  # the server's TTFT parts (a pdserve endpoint)
    interrupted = False
    try:
        asyncio.run(
            run_load(
                target,
                requests,
                concurrency=workload.concurrency,
                duration_s=args.duration,
                drain_timeout_s=args.drain_timeout,
                on_done=progress,
                on_end=ended.append,
                records=records,
                pool_sample_interval_s=args.pool_sample_interval,
                pool_samples=pool_samples,
                server_parts=parts,
                encode=conversation_encoder(
                    workload, args.tokenizer or args.model, args.endpoint, args.prompt_format
                ),
            )
        )
    except KeyboardInterrupt:
        # run_load has recorded the requests in flight (as cancelled) and said how long it ran
        # (its return value is lost). The duration used to be the last chunk's time, which left
        # out the time from that chunk to the Ctrl-C and any request sent after it.
        interrupted = True
    if progress is not None:
        progress.close()
    if interrupted:
        print("interrupted: summarizing what was measured", file=sys.stderr)
    elapsed = ended[0] if ended else max((max([r.sent_s, *r.chunk_times_s]) for r in records), default=0.0)
    summary = summarize(records, elapsed, slos) | parts
    timeline = build_timeline(
        records,
        elapsed,
        slos,
        args.timeline_window,
        pool_samples,
        workload.steps,
        args.pool_sample_interval or None,
    )
    print(format_summary(summary))
    print(format_timeline(timeline))
    if args.out is not None:
        meta = {
            "url": args.url,
            "model": args.model,
            "workload": args.workload,
            "workload_classes": workload.describe(),
            "seed": args.seed,
            "rate_scale": args.rate_scale,
            "endpoint": args.endpoint,
            "interrupted": interrupted,
            "command": redacted_command(sys.argv),
        }
        interrupted = write_outputs(args.out, records, summary | {"timeline": timeline}, meta, interrupted)
    return 130 if interrupted else 0


def write_outputs(
    out: Path,
    records: list[RequestRecord],
    summary: dict[str, Any],
    meta: dict[str, Any],
    interrupted: bool,
) -> bool:
    """Writes the records, the summary (with `meta`, what the run was, under "run") and the plots;
    returns whether the run was interrupted, which a Ctrl-C during the plots (a few seconds; a
    second Ctrl-C after an interrupted run) makes it, without a traceback: the records and the
    summary are already written. `pdserve sim` writes its runs with it too."""
    out.mkdir(parents=True, exist_ok=True)
    write_records(out / "records.jsonl", records)
    (out / "summary.json").write_text(json.dumps({"run": meta, **summary}, indent=2))
    from pdserve.bench.plots import plot_run, plot_timeline

    try:
        plots = plot_run(records, out)
        if "timeline" in summary:
            plots.append(plot_timeline(summary["timeline"], out / "timeline.png"))
    except KeyboardInterrupt:
        print(f"\ninterrupted: wrote records.jsonl, summary.json in {out}, no plots", file=sys.stderr)
        return True
    print(f"wrote records.jsonl, summary.json, {', '.join(p.name for p in plots)} in {out}", file=sys.stderr)
    return interrupted
