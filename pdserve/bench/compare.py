"""`pdserve bench compare`: the same workload against several configurations, side by side. No torch.

    pdserve bench compare --model smollm2-135m --workload chat+docs --duration 120 \\
        --config "colocated=--colocated 2" --config "disaggregated=--prefill 1 --decode 1" \\
        --url "vllm=http://127.0.0.1:8100" --slo ttft=1000,itl=200 --out runs/compare

Each `--config LABEL=SERVE_ARGS` is started here (`pdserve serve --model M SERVE_ARGS` on a free
port), benchmarked, and stopped before the next starts, so configurations never share the
machine. Each `--url LABEL=URL` is an endpoint already running (vLLM's CPU build, say). Every
column gets the identical requests (same seed: same arrival times, lengths and prompts).
Writes `report.md` (a table per class), each run's records and summary, and the plots.

Each run also gets its timeline (pdserve/bench/timeline.py: latency and SLO attainment per
`--timeline-window`, the pools sampled from GET /pools, worker-seconds, the workload's steps),
in `summaries.json` ("timelines"), as `timeline_<label>.png` and as a table in the report: a
configuration with a planner against static pools, on a workload with a `step(...)`, reads there.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from pdserve.bench.client import PreparedRequest, Target, run_load
from pdserve.bench.report import (
    median_summary,
    render_repeats,
    render_report,
    render_sweep,
    render_timelines,
)
from pdserve.bench.run import check_timeline_options, conversation_encoder, prepare
from pdserve.bench.summary import RequestRecord, parse_slos, redacted_command, summarize, write_records
from pdserve.bench.timeline import DEFAULT_POOL_SAMPLE_INTERVAL_S, DEFAULT_WINDOW_S, build_timeline
from pdserve.bench.workload import NAMED_MIXES, parse_workload
from pdserve.errors import PdserveError

# After a Ctrl-C, how long a started server gets to stop on the SIGINT the terminal sent it too.
CTRL_C_GRACE_S = 10.0
DEFAULT_CONFIGS = ["colocated=--colocated 2", "disaggregated=--prefill 1 --decode 1"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="served by every configuration started here")
    p.add_argument("--tokenizer", default=None, help="default: --model")
    p.add_argument(
        "--config",
        action="append",
        default=None,
        metavar="LABEL=SERVE_ARGS",
        help="a configuration to start (repeatable); default, when no --url is given either: "
        + " and ".join(repr(c) for c in DEFAULT_CONFIGS),
    )
    p.add_argument(
        "--url", action="append", default=[], metavar="LABEL=URL", help="an endpoint already running"
    )
    p.add_argument("--served-model-name", default=None, help="the model name the --url endpoints expect")
    p.add_argument(
        "--api-key",
        default=os.environ.get("PDSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="the --url endpoints' API key (default: $PDSERVE_API_KEY, else $OPENAI_API_KEY)",
    )
    p.add_argument(
        "--admin-key", default=os.environ.get("PDSERVE_ADMIN_KEY"), help="their admin key, for GET /pools"
    )
    p.add_argument("--serve-args", default="", help="flags added to every configuration started here")
    p.add_argument("--workload", default="chat+docs", help=f"spec or preset ({', '.join(NAMED_MIXES)})")
    p.add_argument("--max-requests", type=int, default=None)
    p.add_argument("--duration", type=float, default=None)
    p.add_argument("--rate-scale", type=float, default=1.0)
    p.add_argument(
        "--rate-scales",
        default=None,
        help="a sweep, e.g. 0.5,1,2: every configuration runs the workload at each rate scale",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="run every column this many times (repeat r with seed + r) and report medians",
    )
    p.add_argument("--slo", default=None, help="e.g. ttft=1000,itl=200 (milliseconds)")
    p.add_argument("--drain-timeout", type=float, default=120.0)
    p.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for a configuration to start")
    p.add_argument(
        "--timeline-window", type=float, default=DEFAULT_WINDOW_S, help="seconds per window of the timelines"
    )
    p.add_argument(
        "--pool-sample-interval",
        type=float,
        default=DEFAULT_POOL_SAMPLE_INTERVAL_S,
        help="seconds between samples of GET /pools during each run; 0: off",
    )
    p.add_argument("--out", type=Path, required=True)


def columns(config: list[str] | None, url: list[str]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(configurations to start, running endpoints). The default configurations apply only when
    neither is given: `--url` alone measures endpoints already running (vLLM's, say) and starts
    nothing."""
    configs = _labelled(config if config is not None else ([] if url else DEFAULT_CONFIGS), "--config")
    urls = _labelled(url, "--url")
    if set(dict(configs)) & set(dict(urls)):
        raise PdserveError("--config and --url labels must differ")
    return configs, urls


def _labelled(items: list[str], what: str) -> list[tuple[str, str]]:
    result = []
    for item in items:
        label, sep, value = item.partition("=")
        if not sep or not label.strip() or not label.replace("-", "").replace("_", "").isalnum():
            raise PdserveError(f"bad {what} {item!r}: expected LABEL=VALUE with a plain label")
        result.append((label.strip(), value.strip()))
    labels = [label for label, _ in result]
    if len(set(labels)) != len(labels):
        raise PdserveError(f"{what} labels must be unique, got {labels}")
    return result


class StartedServer:
    """`pdserve serve` in a child process on a free port; `stop()` stops it and all it started."""

    def __init__(self, model: str, args: list[str], ready_timeout: float) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = int(s.getsockname()[1])
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "serve",
            "--model",
            model,
            "--port",
            str(self.port),
            *args,
        ]
        self.proc = subprocess.Popen([*cmd, "--log-level", "WARNING"])
        try:
            self._wait_ready(cmd, ready_timeout)
        except KeyboardInterrupt:
            self.stop(CTRL_C_GRACE_S)
            raise
        except BaseException:  # not ready: it must not outlive us
            self.stop()
            raise

    def _wait_ready(self, cmd: list[str], ready_timeout: float) -> None:
        deadline = time.monotonic() + ready_timeout
        while True:
            if self.proc.poll() is not None:
                raise PdserveError(f"`{shlex.join(cmd)}` exited with code {self.proc.returncode}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise PdserveError(f"`{shlex.join(cmd)}` not ready within {ready_timeout:.0f} s")
            time.sleep(0.5)

    def stop(self, grace_s: float = 0.0) -> None:
        """SIGINT, then SIGKILL after 60 s. `grace_s`: first let it exit on its own; after a
        terminal's Ctrl-C it has its own SIGINT already, and a second one makes uvicorn force-quit
        mid-shutdown (with a traceback)."""
        if grace_s > 0:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace_s)
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def run_one(
    label: str,
    url: str,
    model: str,
    requests: list[PreparedRequest],
    args: argparse.Namespace,
    encode: Callable[[str], list[int]] | None = None,
) -> tuple[list[RequestRecord], float, list[dict[str, Any]], dict[str, Any]]:
    """The records, the duration, the pool samples and the server's TTFT parts of one run."""
    print(f"[{label}] {len(requests)} requests against {url}", file=sys.stderr, flush=True)
    records: list[RequestRecord] = []
    samples: list[dict[str, Any]] = []
    parts: dict[str, Any] = {}
    target = Target(url, model, api_key=args.api_key, admin_key=args.admin_key)
    _, elapsed = asyncio.run(
        run_load(
            target,
            requests,
            duration_s=args.duration,
            drain_timeout_s=args.drain_timeout,
            records=records,
            pool_sample_interval_s=args.pool_sample_interval,
            pool_samples=samples,
            server_parts=parts,
            encode=encode,
        )
    )
    return records, elapsed, samples, parts


def prompt_seed(seed: int, rate_index: int) -> int:
    """The seed of the prompts' contents for the `rate_index`-th rate of a run seeded `seed`:
    `seed` for the first, apart for every other (a prime step: no two (seed, rate) of a run meet)."""
    return seed + PROMPT_SEED_STEP * rate_index


PROMPT_SEED_STEP = 7919


def run(args: argparse.Namespace) -> int:
    if args.max_requests is None and args.duration is None:
        raise PdserveError("give --max-requests or --duration (or both): a benchmark must end by itself")
    if args.repeats < 1:
        raise PdserveError(f"--repeats must be >= 1, got {args.repeats}")
    configs, urls = columns(args.config, args.url)
    check_timeline_options(args)
    slos = parse_slos(args.slo)
    scales = rate_scales(args.rate_scales) if args.rate_scales else [args.rate_scale]
    repeats = range(args.repeats)
    # Repeat r draws its workload from seed + r: every column gets the identical requests within a
    # repeat, and the medians over repeats average over both machine noise and the luck of one draw.
    workloads = {
        (scale, r): parse_workload(args.workload, args.seed + r, args.max_requests, args.duration, scale)
        for scale in scales
        for r in repeats
    }
    if any(w.concurrency is not None for w in workloads.values()):
        raise PdserveError("compare needs an open-loop workload (arrival times), not concurrency(n)")
    tokenizer = args.tokenizer or args.model
    # The rates run one after another on one server: each draws prompts of its own (the first
    # rate the seed's), else a server's prefix cache would find the last rate's prompts again.
    requests = {
        (scale, r): prepare(
            w, tokenizer, "completions", "ids", prompt_seed(args.seed + r, scales.index(scale))
        )
        for (scale, r), w in workloads.items()
    }
    # Conversations go on with their answers, which come back as text: re-encoded for the next turn.
    encode = conversation_encoder(next(iter(workloads.values())), tokenizer, "completions", "ids")
    args.out.mkdir(parents=True, exist_ok=True)

    def name(label: str, scale: float) -> str:
        return label if len(scales) == 1 else f"{label}@{scale:g}"

    # (run name) -> records / summary of each repeat.
    runs: dict[str, list[list[RequestRecord]]] = {}
    repeat_summaries: dict[str, list[dict[str, Any]]] = {}
    timelines: dict[str, list[dict[str, Any]]] = {}

    def measure(label: str, url: str, model: str, scale: float, r: int) -> None:
        tag = name(label, scale) + (f" run {r + 1}/{args.repeats}" if args.repeats > 1 else "")
        records, elapsed, samples, parts = run_one(tag, url, model, requests[scale, r], args, encode)
        runs.setdefault(name(label, scale), []).append(records)
        repeat_summaries.setdefault(name(label, scale), []).append(summarize(records, elapsed, slos) | parts)
        timeline = build_timeline(
            records,
            elapsed,
            slos,
            args.timeline_window,
            samples,
            workloads[scale, r].steps,
            args.pool_sample_interval or None,
        )
        timelines.setdefault(name(label, scale), []).append(timeline)

    # Configurations take turns (A B A B ...) so that a slow stretch of this shared machine does not
    # fall on one configuration's runs; each is started afresh for each repeat and once for all rates.
    interrupted = False
    try:
        for r in repeats:
            for label, serve_args in configs:
                server = StartedServer(
                    args.model, shlex.split(serve_args) + shlex.split(args.serve_args), args.ready_timeout
                )
                grace = 0.0
                try:
                    for scale in scales:
                        measure(label, server.url, args.model, scale, r)
                except KeyboardInterrupt:
                    grace = CTRL_C_GRACE_S
                    raise
                finally:
                    server.stop(grace)
            for label, url in urls:
                for scale in scales:
                    measure(label, url.rstrip("/"), args.served_model_name or args.model, scale, r)
    except KeyboardInterrupt:
        # The server being measured was stopped by the `finally` above; what finished is kept.
        interrupted = True
        print("\ninterrupted: reporting the runs that finished", file=sys.stderr)
    if not runs:
        print("no run finished: nothing to report", file=sys.stderr)
        return 130

    summaries: dict[str, dict[str, Any]] = {}
    for run_name, per_repeat in runs.items():
        for r, records in enumerate(per_repeat):
            suffix = f"_r{r + 1}" if args.repeats > 1 else ""
            write_records(args.out / f"records_{run_name}{suffix}.jsonl", records)
        summaries[run_name] = median_summary(repeat_summaries[run_name])
    (args.out / "summaries.json").write_text(
        json.dumps(
            {
                "median": summaries,
                "runs": repeat_summaries,
                "timelines": timelines,
                "interrupted": interrupted,
            },
            indent=2,
        )
    )
    labels = [label for label, _ in configs + urls if name(label, scales[0]) in runs]
    described = dict(configs) | dict(urls)
    plots: list[Path] = []
    for scale in scales:
        # The first repeat's runs: a timeline is one run's picture, not a mix of several.
        at_scale = {label: runs[name(label, scale)][0] for label in labels if name(label, scale) in runs}
        if at_scale:
            folder = args.out if len(scales) == 1 else args.out / f"rate_{scale:g}"
            folder.mkdir(exist_ok=True)
            lines = {label: timelines[name(label, scale)][0] for label in at_scale}
            plots += [p.relative_to(args.out) for p in _plots(at_scale, folder, lines)]
    first = workloads[scales[0], 0]
    report = render_report(
        {label: summaries[name(label, scales[0])] for label in labels},
        described,
        first.describe(),
        redacted_command(sys.argv),
        plots,
    )
    if interrupted:
        report += "\nInterrupted (Ctrl-C): only the runs that finished are in this report.\n"
    report += render_timelines({label: timelines[name(label, scales[0])] for label in labels})
    if args.repeats > 1:
        report += render_repeats(
            {label: repeat_summaries[name(label, scales[0])] for label in labels}, args.seed
        )
    if len(scales) > 1:
        report += render_sweep(summaries, labels, scales, name)
    (args.out / "report.md").write_text(report)
    print(report)
    return 130 if interrupted else 0


def rate_scales(text: str) -> list[float]:
    """`--rate-scales 0.5,1,2`: positive numbers (`bench compare` and `pdserve plan`)."""
    try:
        scales = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise PdserveError(f"--rate-scales must be numbers separated by commas, got {text!r}") from None
    if not scales or any(x <= 0 for x in scales):
        raise PdserveError(f"--rate-scales must be positive numbers, got {text!r}")
    return scales


def _plots(
    runs: dict[str, list[RequestRecord]], out: Path, timelines: dict[str, dict[str, Any]]
) -> list[Path]:
    try:
        from pdserve.bench.plots import plot_comparison, plot_timelines
    except ImportError:  # the plots need matplotlib
        return []
    paths: list[Path] = plot_comparison(runs, out) + plot_timelines(timelines, out)
    return paths
