"""`pdserve sim`: a deployment simulated on a workload, in virtual time. No torch, no process, no socket.

    pdserve sim --profile profiles/cpu-smollm2.json --prefill 1 --decode 1 \\
        --workload chat+docs --duration 600 --slo ttft=1000,itl=200 --out runs/sim-dpd

The deployment takes `pdserve serve`'s flags and TOML file (`--config`); the workload takes
`pdserve bench`'s (`--workload`, `--max-requests`, `--duration`, `--rate-scale`, `--seed`); the
profile (`pdserve profile`) says what the model costs on the hardware. What runs is the router's
own code: its worker set, admission, path choice, worker choice, dispatcher (retries, moves), the
pool manager and the planner (`--planner slo`), and on each simulated worker the real scheduler,
KV cache bookkeeping and worker core, with the profile in place of the model and the event loop's
virtual clock in place of time (pdserve/sim/worker.py). Its output is the bench's: the summary
and timeline on stdout, and with `--out` the same `records.jsonl`, `summary.json` and plots, so a
simulated run and a measured one compare with the same tools (`pdserve bench compare`).

`--slo` is the deployment's (the planner's and admission's, as for `serve`) and, unless
`--report-slo` says otherwise, the one goodput is counted against.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pdserve import clock, serve, serve_options
from pdserve.bench.run import add_workload_arguments, check_timeline_options
from pdserve.bench.summary import RequestRecord, format_summary, parse_slos, redacted_command, summarize
from pdserve.bench.timeline import DEFAULT_WINDOW_S, build_timeline, format_timeline, pool_counts
from pdserve.bench.workload import Workload, parse_workload
from pdserve.errors import PdserveError
from pdserve.sim import profile as profiles
from pdserve.sim.cluster import SimCluster
from pdserve.sim.front import Front, drive
from pdserve.sim.host import HostLoad
from pdserve.sim.speed_options import host_speed
from pdserve.sim.trace_speed import SpeedCourse
from pdserve.sim.worker import SimConnector

logger = logging.getLogger("pdserve.sim")

EOS = (0,)  # the modelled engine never samples it (its tokens are 1000 + position)


def add_arguments(p: argparse.ArgumentParser) -> None:
    serve_options.add_arguments(p)
    add_simulation_arguments(p)
    # One simulated run's own (not `pdserve plan`'s: its --repeats draw anew by themselves).
    p.add_argument(
        "--speed-window",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with --speed-trace (one run's): replay how the host's speed moved over that run, window "
        "by window of this many seconds, each pool's steps as much slower or faster than the run's "
        "own pace as the trace's were then (from the workload's start). A diagnosis of a measured "
        "run (was a miss the model's, or a stall of the host's?), not a prediction",
    )
    p.add_argument(
        "--noise-seed",
        type=int,
        default=0,
        help="which draw of the steps' deviations from their fit (0: each worker's own): another "
        "draw of the same load is another run of it, as a served run repeated is another",
    )


def add_simulation_arguments(p: argparse.ArgumentParser) -> None:
    """What `pdserve sim` and `pdserve plan` take beyond serve's flags: the profile and the workload."""
    p.add_argument("--profile", type=Path, required=True, help="a profile from `pdserve profile` (JSON)")
    p.add_argument(
        "--speed-check",
        type=Path,
        nargs="+",
        default=None,
        metavar="FILE",
        help="a speed check of this host (`pdserve profile --speed-check`): every time the profile "
        "measured is scaled by how much slower or faster the host runs now than when it was measured; "
        "several checks: by the median of their factors (a check is seconds of a host whose speed "
        "moves from one half-minute to the next: several, spread over the time, are steadier, and "
        "their median does not follow one caught in a stall; two: their geometric mean)",
    )
    p.add_argument(
        "--speed-trace",
        type=Path,
        nargs="+",
        default=None,
        metavar="FILE",
        help="instead of --speed-check: a served run's step trace (`pdserve serve --step-trace`) on this "
        "host; the profile (fitted to served steps) is scaled by the median of the trace's decode "
        "steps over its fit, its prompt-only steps (those on the GEMM apart) and its mixed steps "
        "(prompts beside streams) each by their own, pool by pool where a pool has enough of a kind: "
        "the host's speed while it served, from every step rather than a check's seconds",
    )
    p.add_argument(
        "--headroom",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="simulate a host this much slower than the profile (after --speed-check or --speed-trace) "
        "says: 0.1 scales "
        "every time by 1.1. A deployment near its knee moves by more than the host's speed does (a "
        "2-vCPU host ~10%% slower for half an hour quadrupled a DPD server's TTFT p90 at its knee), "
        "and a check reads the speed to within 5-15%%: plan with the margin you cannot measure",
    )
    add_workload_arguments(p)
    p.add_argument(
        "--report-slo",
        default=None,
        help="the SLO goodput is counted against, as bench's --slo (default: --slo)",
    )
    p.add_argument(
        "--finish-timeout",
        type=float,
        default=120.0,
        help="seconds (simulated) for requests in flight after the last is sent",
    )
    p.add_argument(
        "--client-on-host",
        action="store_true",
        help="the load's client shares the workers' host (as `pdserve bench` on the serving machine): "
        "its CPU per request and token, from the profile, slows their steps too",
    )
    p.add_argument("--timeline-window", type=float, default=DEFAULT_WINDOW_S)
    p.add_argument(
        "--pool-sample-interval",
        type=float,
        default=1.0,
        help="simulated seconds between samples of the pools for the timeline; 0: off",
    )
    p.add_argument("--out", type=Path, default=None, help="folder for records.jsonl, summary.json and plots")


def resolve(args: argparse.Namespace, profile: profiles.Profile) -> dict[str, Any]:
    """serve's options (defaults, the config file, the flags), checked as serve checks them, on the
    profile's device instead of this host's."""
    o = serve_options.layered(args)
    o["model"] = o["model"] or profile.model
    return checked(o, profile)


def checked(o: dict[str, Any], profile: profiles.Profile) -> dict[str, Any]:
    """`o` on the profile's device, checked as serve checks it, and against what the profile has."""
    o = dict(o)
    o["device_type"] = str(profile.meta.get("device", "cpu"))
    o["pool_gpus"] = {}
    if o["transport"] is None:
        o["transport"] = "tcp" if o["device_type"] == "cuda" else "shm"
    serve._check(o)
    for pool in serve.pool_replicas(o):  # what the profile lacks, said before anything runs
        profile.step_time(pool)
        if pool != "prefill":
            profile.transfer(o["transport"])
    return o


@dataclass
class SimResult:
    records: list[RequestRecord]
    duration_s: float
    pool_samples: list[dict[str, Any]] = field(default_factory=list)
    workers_started: int = 0
    # The router's TTFT parts and path counts, as bench reads a server's (pdserve/bench/server_parts.py).
    server: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0


def simulate(
    o: dict[str, Any],
    profile: profiles.Profile,
    workload: Workload,
    *,
    finish_timeout_s: float = 120.0,
    pool_sample_interval_s: float = 1.0,
    client_on_host: bool = False,
    noise_seed: int = 0,
    speed_course: SpeedCourse | None = None,
) -> SimResult:
    """Runs the deployment `o` on `workload` in virtual time. The router shares the workers' CPUs
    when the profile says they are a host's (`profile.host`: a CPU deployment on one machine), and
    so does the load's client with `client_on_host`. `noise_seed` picks the draw of the steps'
    deviations from their fit (another run of the same load, as a trace replay repeated is);
    `speed_course`, a served run's host speed over time, replayed from the workload's start."""
    return simulate_in_sequence(
        o,
        profile,
        [workload],
        finish_timeout_s=finish_timeout_s,
        pool_sample_interval_s=pool_sample_interval_s,
        client_on_host=client_on_host,
        noise_seed=noise_seed,
        speed_course=speed_course,
    )[0]


def simulate_in_sequence(
    o: dict[str, Any],
    profile: profiles.Profile,
    workloads: Sequence[Workload],
    *,
    finish_timeout_s: float = 120.0,
    pool_sample_interval_s: float = 1.0,
    client_on_host: bool = False,
    noise_seed: int = 0,
    speed_course: SpeedCourse | None = None,
) -> list[SimResult]:
    """Runs the workloads one after another on one deployment, each once the one before has
    finished (its requests done, or `finish_timeout_s` after its last was sent), as `pdserve bench
    compare --rate-scales` runs its rates on one server: what a run learnt (the router's path-choice
    cost model, the pools the planner sized, the workers' CPU history) carries into the next. One
    result per workload, each with its own records, clock (from when it starts), pool samples,
    workers started, the router's TTFT parts and path counts over that workload alone, and the wall
    time it took to simulate (the first's with the deployment's start)."""
    if not workloads:
        raise PdserveError("nothing to simulate: no workload")
    results: list[SimResult] = clock.run_virtual(
        functools.partial(
            _simulate,
            o,
            profile,
            list(workloads),
            finish_timeout_s,
            pool_sample_interval_s,
            client_on_host,
            noise_seed,
            speed_course,
        )
    )  # type: ignore[assignment]
    return results


async def _simulate(
    o: dict[str, Any],
    profile: profiles.Profile,
    workloads: list[Workload],
    finish_timeout_s: float,
    pool_sample_interval_s: float,
    client_on_host: bool,
    noise_seed: int,
    speed_course: SpeedCourse | None,
) -> list[SimResult]:
    # The router's parts, built as `pdserve serve` builds them, over simulated workers.
    from prometheus_client import generate_latest

    from pdserve.bench import server_parts
    from pdserve.planner.loop import Planner
    from pdserve.pools.manager import PoolManager
    from pdserve.router.dispatch import Dispatcher
    from pdserve.router.metrics import RouterMetrics
    from pdserve.router.recorder import WorkerRecorder
    from pdserve.router.workers import WorkerSet
    from pdserve.signals import Signals

    router_config = serve.router_config(o)
    metrics = RouterMetrics()
    connector = SimConnector()
    workers = WorkerSet(connector, stall_timeout=o["stall_timeout"])
    signals = Signals()
    # A profile fitted to served steps has the router's and the client's CPU in them already.
    host = (
        HostLoad(
            profile.host,
            client_on_host,
            stretches=profile.steps_from == "alone",
            pinned=o["pin_cpus"],
        )
        if profile.host is not None and o["cluster"] == "local"
        else None
    )
    backend = SimCluster(profile, connector, host, noise_seed, speed_course)
    pools = PoolManager(
        backend,
        workers,
        metrics,
        serve.pool_specs(o, EOS),
        serve.pool_settings(o),
    )
    planner = Planner(serve.planner_settings(o), signals, workers, pools, metrics)
    dispatcher = Dispatcher(workers, router_config, metrics, signals, at_bounds=planner.at_bounds)
    recorder = WorkerRecorder(workers, metrics, signals, o["step_trace"])
    pools.describers["planner"] = planner.describe
    front = Front(
        dispatcher,
        metrics,
        signals,
        request_overhead_s=profile.overhead.request_s,
        vocab_size=profile.model_config().vocab_size,
        max_model_len=lambda: min(
            (w.ready.max_model_len for w in workers.views() if w.connected and w.ready), default=None
        ),
        host=host,
    )
    results: list[SimResult] = []
    started_before = 0  # the first workload's count has the deployment's first workers in it
    wall_from = time.perf_counter()  # and its wall time, their start
    try:
        await pools.start()
        planner.start()
        for workload in workloads:
            samples: list[dict[str, Any]] = []
            records: list[RequestRecord] = []
            # The router's counters before and after, as bench scrapes a server's /metrics.
            before = generate_latest(metrics.registry).decode()
            start = clock.monotonic()
            if backend.course_from is None:  # a replayed speed runs on the first workload's clock
                backend.course_from = start
            sampler = None
            if pool_sample_interval_s > 0:
                sampler = asyncio.create_task(_sample(pools, start, pool_sample_interval_s, samples))
            duration = await drive(
                front,
                workload.requests,
                concurrency=workload.concurrency,
                duration_s=workload.duration_s,
                finish_timeout_s=finish_timeout_s,
                records=records,
            )
            if sampler is not None:
                sampler.cancel()
            after = generate_latest(metrics.registry).decode()
            results.append(
                SimResult(
                    records,
                    duration,
                    samples,
                    backend.started - started_before,
                    server_parts.summary_section(before, after),
                )
            )
            results[-1].wall_s = time.perf_counter() - wall_from
            started_before, wall_from = backend.started, time.perf_counter()
        return results
    finally:
        await planner.close()
        await pools.close()
        await workers.close()
        recorder.close()


async def _sample(pools: Any, start: float, interval_s: float, samples: list[dict[str, Any]]) -> None:
    """The pools as GET /pools shows them, every interval (the bench's timeline samples)."""
    while True:
        samples.append({"t_s": clock.monotonic() - start, "pools": pool_counts(pools.describe())})
        await asyncio.sleep(interval_s)


def load_inputs(args: argparse.Namespace) -> tuple[profiles.Profile, Workload, SpeedCourse | None]:
    """The profile (scaled as --speed-check, --speed-trace and --headroom say), the workload, and
    with --speed-window the traced run's speed over time."""
    if args.max_requests is None and args.duration is None:
        raise PdserveError("give --max-requests or --duration (or both): a simulation must end by itself")
    if not args.finish_timeout > 0:
        raise PdserveError("--finish-timeout must be > 0")
    check_timeline_options(args)
    profile, course = host_speed(args, profiles.load(args.profile))
    workload = parse_workload(args.workload, args.seed, args.max_requests, args.duration, args.rate_scale)
    return profile, workload, course


def report_slos(args: argparse.Namespace, o: dict[str, Any]) -> dict[str, float]:
    return parse_slos(args.report_slo if args.report_slo is not None else o["slo"])


class _SimulatedTimeFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        record.simulated = f"t={clock.monotonic():10.4f}"
        return super().format(record)


def run(args: argparse.Namespace) -> int:
    profile, workload, course = load_inputs(args)
    o = resolve(args, profile)
    slos = report_slos(args, o)
    # serve's --log-level, with each line stamped in simulated seconds (the wall clock says nothing)
    handler = logging.StreamHandler()
    handler.setFormatter(_SimulatedTimeFormatter("%(simulated)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=o["log_level"], handlers=[handler])
    print(f"workload ({len(workload.requests)} requests):\n{workload.describe()}", file=sys.stderr)
    result = simulate(
        o,
        profile,
        workload,
        finish_timeout_s=args.finish_timeout,
        pool_sample_interval_s=args.pool_sample_interval,
        client_on_host=args.client_on_host,
        noise_seed=args.noise_seed,
        speed_course=course,
    )
    summary = summarize(result.records, result.duration_s, slos)
    summary |= result.server
    timeline = build_timeline(
        result.records,
        result.duration_s,
        slos,
        args.timeline_window,
        result.pool_samples,
        workload.steps,
        args.pool_sample_interval or None,
    )
    summary["simulation"] = {
        "profile": str(args.profile),
        "profile_source": profile.source,
        "speed_factor": profile.meta.get("speed_factor"),
        "speed_factor_prompt": profile.meta.get("speed_factor_prompt"),
        "speed_factor_mixed": profile.meta.get("speed_factor_mixed"),
        "speed_factor_gemm": profile.meta.get("speed_factor_gemm"),
        "speed_factors_by_role": profile.meta.get("speed_factors_by_role"),
        "speed_window_s": None if course is None else course.window_s,
        "noise_seed": args.noise_seed,
        "workers_started": result.workers_started,
        "wall_s": round(result.wall_s, 3),
        "simulated_s": round(result.duration_s, 3),
    }
    print(format_summary(summary))
    print(format_timeline(timeline))
    print(
        f"simulated {result.duration_s:.1f} s of serving in {result.wall_s:.1f} s "
        f"({len(result.records)} requests, profile {args.profile}: {profile.source})",
        file=sys.stderr,
    )
    if args.out is not None:
        from pdserve.bench.run import write_outputs

        meta = {
            "simulated": True,
            "model": o["model"],
            "workload": args.workload,
            "workload_classes": workload.describe(),
            "seed": args.seed,
            "rate_scale": args.rate_scale,
            "interrupted": False,
            "command": redacted_command(sys.argv),
        }
        write_outputs(args.out, result.records, summary | {"timeline": timeline}, meta, False)
    return 0
