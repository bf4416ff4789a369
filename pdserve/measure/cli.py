"""`pdserve profile`: what a model costs on this machine, as a JSON profile for `pdserve sim` and
`pdserve plan`.

    pdserve profile --model smollm2-135m --out profiles/cpu-smollm2.json          # measured here
    pdserve profile --hardware h200 --model-shape llama-3.1-8b --out h200-8b.json  # a roofline
    pdserve profile --model smollm2-135m --served --out profiles/cpu-served.json    # steps as served
    pdserve profile --from-trace steps.jsonl --base cpu-smollm2.json --out served.json  # refitted

Measured (`--model`): the engine's step time per pool role, fitted to a sweep of real steps
(pdserve/measure/steps.py); KV pull time per transport (`--transports`, real transports between
two caches of the model's shape); the serving overhead and a worker's start time from a real
`pdserve serve` (pdserve/measure/overhead.py; `--no-serve` skips it and assumes none). The
worker settings are serve's defaults with `--threads` (1, as serve gives each worker) and
`--dtype`. Takes a few minutes for SmolLM2 on 2 cores (`--quick`: a smaller sweep, for a check).

Roofline (`--hardware`, `--model-shape`): derived from peak rates at stated efficiencies, every
assumption printed (pdserve/sim/roofline.py).

From served steps (`--from-trace TRACE... --base PROFILE`): the step times and the worker loop's
time refitted to what a real server's workers ran (`pdserve serve --step-trace TRACE`), the rest
of the base profile kept (pdserve/sim/calibrate.py): on a host the workers share with the router
and a client, steps run 10-30% off a lone engine's sweep, by an amount that moves with the load.
"""

from __future__ import annotations

import argparse
import datetime
import logging
import os
import platform
import statistics
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from pdserve.errors import PdserveError
from pdserve.sim.profile import Overhead, Profile
from pdserve.sim.speed import SpeedCheck
from pdserve.sim.step_time import Spread

MEASURED_TRANSPORTS = ("shm", "tcp")  # nixl moves a GPU's or a remote node's KV: not measured here
DEVICES = ("cpu", "cuda")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=Path, required=True, help="where to write the profile (JSON)")
    p.add_argument("--model", default=None, help="measure this model here (built-in name, .gguf or folder)")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument(
        "--device",
        default="cpu",
        choices=DEVICES,
        help="where the measured engine runs: cpu, or cuda (GPU 0; with --no-serve: the serving probes "
        "run CPU servers)",
    )
    p.add_argument(
        "--threads", type=int, default=1, help="torch threads of the measured engine (serve's per worker)"
    )
    p.add_argument("--transports", default="shm,tcp", help="the KV transports to measure, comma-separated")
    p.add_argument("--no-serve", action="store_true", help="skip the serving-overhead probe (assume none)")
    p.add_argument("--quick", action="store_true", help="a small sweep (a check, not a profile to plan with)")
    p.add_argument(
        "--no-neighbour",
        action="store_true",
        help="skip the second sweep beside a busy engine on another CPU (steps when the host is busy)",
    )
    p.add_argument(
        "--from-trace",
        type=Path,
        nargs="+",
        default=None,
        metavar="TRACE",
        help="fit the step times to these served runs' steps (pdserve serve --step-trace) instead, "
        "into a copy of --base",
    )
    p.add_argument("--base", type=Path, default=None, help="with --from-trace: the profile to copy")
    p.add_argument(
        "--served",
        action="store_true",
        help="with --model: then trace a real DPD and colocated server under a climbing load (about 2.5 "
        "min each; on two CPUs, a lone colocated worker too) and refit the step times to their steps "
        "(pdserve/measure/served.py), and time a worker's "
        "start beside a busy one while serving, as the planner's scale-up (2 min; pdserve/measure/start.py)",
    )
    p.add_argument(
        "--served-rate-scale", type=float, default=None, help="with --served: scale that load's rates (1)"
    )
    p.add_argument(
        "--served-workload",
        default=None,
        metavar="SPEC",
        help="with --served: trace under this workload (pdserve bench's --workload), at 0.5x, 1x, 2x and "
        "3.5x its rate (times --served-rate-scale) a quarter of the time each, instead of the built-in "
        "chat and documents: the steps then run the mix you plan for",
    )
    p.add_argument(
        "--speed-check",
        action="store_true",
        help="with --model: only the speed check (seconds): how fast this host runs the engine's steps now, "
        "for `pdserve sim/plan --speed-check` to scale a profile measured at another time by",
    )
    p.add_argument("--hardware", default=None, help="derive from a roofline instead: h200, h100, a100, l40s")
    p.add_argument("--model-shape", default=None, help="with --hardware: a built-in shape or a config.json")


def run(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per probe request
    check_served_load(args)  # said now, not after minutes of sweeping
    if args.speed_check:
        if not args.model or args.served or args.from_trace or args.base or args.hardware or args.model_shape:
            raise PdserveError(
                "--speed-check measures --model here (and goes with neither --served, --from-trace nor --hardware)"
            )
        if args.quick:  # one plan: a check is paired step by step with the profile's
            raise PdserveError("--speed-check has one fixed plan (about 20 s): it has no --quick")
        check = speed_check(args)
        check.save(args.out)
        print(
            f"speed check of {check.model} ({check.device}, {check.dtype}, {check.threads} threads): "
            f"{len(check.steps)} steps, {sum(s for _, s in check.steps) * 1000:.0f} ms in all; {check.machine}"
        )
        print(f"wrote {args.out}", file=sys.stderr)
        return 0
    if args.from_trace or args.base:
        if (
            not (args.from_trace and args.base)
            or args.model
            or args.hardware
            or args.model_shape
            or args.served
        ):
            raise PdserveError("--from-trace needs --base (and neither --model, --hardware nor --served)")
        from pdserve.sim import profile as profiles
        from pdserve.sim.calibrate import calibrated

        profile = calibrated(profiles.load(args.base), list(args.from_trace))
    elif args.hardware or args.model_shape:
        if not (args.hardware and args.model_shape) or args.model or args.served:
            raise PdserveError(
                "a roofline needs --hardware and --model-shape (and neither --model nor --served)"
            )
        from pdserve.sim.roofline import derive

        profile = derive(args.hardware, args.model_shape)
        profile = _stamped(profile, {})
    else:
        if not args.model:
            raise PdserveError("give --model (measure it here) or --hardware and --model-shape (a roofline)")
        if args.served and args.no_serve:
            raise PdserveError("--served runs a server: it cannot go with --no-serve")
        if args.device == "cuda" and not args.no_serve:
            raise PdserveError(
                "--device cuda measures the engine's steps on the GPU; the serving probes (and --served) "
                "run CPU servers: add --no-serve"
            )
        if args.threads < 1:
            raise PdserveError("--threads must be >= 1")
        unknown = sorted(set(args.transports.split(",")) - set(MEASURED_TRANSPORTS) - {""})
        if unknown:  # said now, not after minutes of sweeping
            raise PdserveError(
                f"--transports: cannot measure {', '.join(unknown)} here (it measures {', '.join(MEASURED_TRANSPORTS)})"
            )
        profile = measured(args)
        if args.served:
            profile = served_profile(args, profile)
    profile.save(args.out)
    print("\n".join(describe(profile)))
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


def check_served_load(args: argparse.Namespace) -> None:
    """--served's load options, checked (the workload parsed) before anything is measured."""
    from pdserve.measure import served

    if (args.served_workload is not None or args.served_rate_scale is not None) and not args.served:
        raise PdserveError("--served-workload and --served-rate-scale go with --served")
    if args.served_rate_scale is None:
        args.served_rate_scale = 1.0
    if not args.served_rate_scale > 0:
        raise PdserveError("--served-rate-scale must be > 0")
    if args.served_workload is not None:
        served.phases(args.served_workload, served.DURATION_S, args.served_rate_scale, 0)


def served_profile(args: argparse.Namespace, profile: Profile) -> Profile:
    """The measured profile refitted to a real server's steps; the traces, and the sweep's profile
    (alone.json), kept beside --out in <name>-steps/."""
    from pdserve.measure import served
    from pdserve.sim.calibrate import calibrated

    folder = args.out.parent / f"{args.out.stem}-steps"
    folder.mkdir(parents=True, exist_ok=True)
    profile.save(folder / "alone.json")
    traces = served.trace(
        args.model,
        folder,
        threads=args.threads,
        rate_scale=args.served_rate_scale,
        workload=args.served_workload,
        cpus=profile.host.cpus if profile.host is not None else None,
    )
    from pdserve.measure.start import start_beside_busy

    busy_start = start_beside_busy(
        args.model, threads=args.threads, rate_scale=args.served_rate_scale, workload=args.served_workload
    )
    return replace(calibrated(profile, traces), start_busy_s=round(busy_start, 2))


def spread_lines(bands: tuple[Spread, ...], mixed: tuple[float, ...], runs: str) -> list[str]:
    """How a step time's steps spread around its fit, band by band (`runs`: of which runs)."""
    lines, low = [], 0.0
    for band in bands:
        q = band.quantiles
        span = (
            f"{low * 1000:.0f}-{band.below_s * 1000:.0f} ms"
            if band.below_s is not None
            else f"{low * 1000:.0f} ms or more"
        )
        lines.append(
            f"    steps {runs}fitted at {span}: measured / fitted {q[0]:.2f} to "
            f"{q[-1]:.2f}, median {statistics.median(q):.2f}, mean {sum(q) / len(q):.3f}"
        )
        low = band.below_s or 0.0
    if bands and bands[-1].below_s is not None:
        lines.append(
            f"    steps {runs}fitted at {low * 1000:.0f} ms or more (none traced): the last band's mean"
        )
    if mixed:
        lines.append(
            f"    steps {runs}with prompt tokens beside streams, apart: measured / fitted {mixed[0]:.2f} to "
            f"{mixed[-1]:.2f}, median {statistics.median(mixed):.2f}, mean {sum(mixed) / len(mixed):.3f}"
        )
    return lines


def describe(profile: Profile) -> list[str]:
    lines = [f"profile of {profile.model} ({profile.source}), {profile.meta.get('machine', '')}"]
    if profile.steps_from == "serving":
        lines.append(f"  steps fitted to served steps ({profile.meta.get('step_traces', '?')})")
    lines += [f"  assumes: {a}" for a in profile.assumptions]
    for role, step in profile.steps.items():
        fit = getattr(step, "median_error", None)
        error = f" (fit error: median {fit:.1%}, p90 {step.p90_error:.1%})" if fit is not None else ""  # type: ignore[union-attr]
        spreads = ("spread", "mixed_spread", "free_spread", "free_mixed_spread")
        body = {k: v for k, v in step.to_json().items() if k not in spreads}
        lines.append(f"  {role} step: {body}{error}")
        if (passes := getattr(step, "passes", None)) is not None:
            per_pass, gemm, logits = step.pass_coefficients  # type: ignore[union-attr]
            lines.append(
                f"    stream GEMV ({passes.rows_per_pass} rows a pass, up to {passes.stream_rows} rows): "
                f"{per_pass * 1000:.2f} ms a pass past the first; a GEMM past it {gemm * 1000:+.2f} ms, "
                f"the logits' past {passes.logits_rows} streams {logits * 1000:+.2f} ms; "
                f"{step.coefficients[1] * 1000:.3f} ms a row on the GEMM (c1)"  # type: ignore[union-attr]
            )
        lines += spread_lines(getattr(step, "spread", ()), getattr(step, "mixed_spread", ()), "")
        if free := getattr(step, "free_spread", ()):
            lines += spread_lines(free, step.free_mixed_spread, "with a CPU free of workers, ")  # type: ignore[union-attr]
    for role, step in profile.steps_busy.items():
        lines.append(f"  {role} step beside a busy neighbour: {step.to_json()}")
    loops = [(role, loop, "") for role, loop in profile.loops.items()]
    loops += [(role, loop, " with a CPU free of workers") for role, loop in profile.free_loops.items()]
    for role, loop, runs in loops:
        lines.append(
            f"  {role} worker loop{runs}: {loop.step_s * 1000:.3f} ms a step + {loop.stream_s * 1000:.3f} ms a stream"
            + (
                f"; as traced at {len(loop.by_streams)} stream counts up to {loop.by_streams[-1][0]}: "
                + ", ".join(f"{n}: {s * 1000:.2f} ms" for n, s in loop.by_streams[:4])
                + (" ..." if len(loop.by_streams) > 4 else "")
                if loop.by_streams
                else ""
            )
        )
    for name, t in profile.transfers.items():
        lines.append(f"  {name} pull: {t.base_s * 1000:.3f} ms + {t.per_block_s * 1000:.4f} ms per block")
    for role, pull in profile.pulls.items():
        a, b = pull.alone, pull.busy
        lines.append(
            f"  {role} served pull wait ({pull.transport}, {pull.samples} steps): {a.base_s * 1000:.3f} ms + "
            f"{a.per_block_s * 1000:.4f} ms per block, beside busy neighbours {b.base_s * 1000:.3f} ms + "
            f"{b.per_block_s * 1000:.4f} ms per block"
            + (
                f"; its copy {pull.copy_alone.base_s * 1000:.3f} ms + {pull.copy_alone.per_block_s * 1000:.4f} "
                f"ms per block, beside busy {pull.copy_busy.base_s * 1000:.3f} ms + "
                f"{pull.copy_busy.per_block_s * 1000:.4f} ms per block"
                if pull.copy_alone is not None and pull.copy_busy is not None
                else ""
            )
        )
    if profile.host is not None:
        h = profile.host
        lines.append(
            f"  host: {h.cpus} CPUs shared with the router ({h.router_request_s * 1000:.2f} ms CPU a request, "
            f"{h.router_token_s * 1000:.3f} ms a token, {h.router_idle:.1%} idle) and a client on the host "
            f"({h.client_request_s * 1000:.2f} ms, {h.client_token_s * 1000:.3f} ms)"
        )
    lines.append(
        f"  overhead: {profile.overhead.request_s * 1000:.2f} ms a request, {profile.overhead.step_s * 1000:.3f} ms a step "
        f"+ {profile.overhead.stream_s * 1000:.3f} ms a stream; "
        f"start {profile.start_s:.1f} s"
        + (f" ({profile.start_busy_s:.1f} s beside a busy worker, serving)" if profile.start_busy_s else "")
        + f"; KV blocks {profile.kv_blocks}"
    )
    return lines


def _machine() -> dict[str, Any]:
    from pdserve.ops.cpu import isa as cpu_isa

    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "machine": f"{name}, {os.cpu_count()} CPUs, ISA {cpu_isa.probe().machine_level}",
        "platform": platform.platform(),
    }


def _stamped(profile: Profile, extra: dict[str, Any]) -> Profile:
    import pdserve

    meta = dict(profile.meta) | extra
    meta.setdefault("date", datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"))
    meta.setdefault(
        "versions", {"pdserve": getattr(pdserve, "__version__", "?"), "python": platform.python_version()}
    )
    return replace(profile, meta=meta)


def _pinned(args: argparse.Namespace) -> set[int] | None:
    """One CPU, as `pdserve serve --cluster local` pins each worker, for the engine's steps (with
    one thread, on a CPU); returns the CPUs allowed before, to give back (None: not pinned)."""
    allowed = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") and args.device != "cuda" else None
    if allowed is not None and args.threads == 1:
        os.sched_setaffinity(0, {min(allowed)})
    return allowed


def _check(probe: Any, args: argparse.Namespace, dtype: str) -> SpeedCheck:
    from pdserve.measure import steps

    return SpeedCheck(
        model=args.model,
        device=args.device,
        dtype=dtype,
        threads=args.threads,
        steps=tuple(steps.speed_check(probe)),
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        machine=_machine()["machine"],
    )


def _check_apart(args: argparse.Namespace) -> SpeedCheck:
    """`pdserve profile --speed-check` in a process of its own (on the CPUs this one may use)."""
    import subprocess
    import tempfile

    from pdserve.sim import speed

    with tempfile.TemporaryDirectory(prefix="pdserve-check-") as folder:
        out = Path(folder) / "check.json"
        command = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "profile",
            "--model",
            args.model,
            "--dtype",
            args.dtype,
        ]
        command += [
            "--threads",
            str(args.threads),
            "--device",
            args.device,
            "--speed-check",
            "--out",
            str(out),
        ]
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise PdserveError(f"the speed check failed: {done.stderr.strip()[-2000:]}")
        return speed.load(out)


def speed_check(args: argparse.Namespace) -> SpeedCheck:
    """`--speed-check`: the check alone, on an engine built and pinned as the profile's sweep's."""
    import torch

    from pdserve.measure import steps

    if args.threads < 1:
        raise PdserveError("--threads must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise PdserveError("--device cuda: this torch sees no CUDA device")
    allowed = _pinned(args)
    try:
        probe = steps.StepProbe(args.model, args.dtype, args.threads, 256, None, args.device)
        return _check(probe, args, str(probe.engine.runner.dtype).removeprefix("torch."))
    finally:
        if allowed is not None:
            os.sched_setaffinity(0, allowed)


def measured(args: argparse.Namespace) -> Profile:
    import torch

    from pdserve.measure import overhead as overhead_probe
    from pdserve.measure import steps, transfer

    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        raise PdserveError("--device cuda: this torch sees no CUDA device")
    # One CPU for the engine's steps; the transfers (two workers' threads) and the serving probe
    # (its server would inherit the one CPU) get every CPU back.
    allowed = _pinned(args)
    plan = steps.QUICK if args.quick else steps.GPU if gpu else steps.Sweep()
    probe = steps.StepProbe(args.model, args.dtype, args.threads, plan.chunk, None, args.device)
    model_config = probe.engine.runner.config
    samples = steps.sweep(probe, plan)
    passes = steps.stream_passes(probe)
    # The speed check, right after the sweep: `--speed-check` later says how much faster or slower
    # the host runs than now (pdserve/sim/speed.py). Run as `--speed-check` runs it, in a process
    # of its own with a fresh engine: on this sweep's engine, after its minutes of steps, the same
    # steps took 13-18% longer than fresh engines' checks before and after it (an AVX2 EPYC).
    check = _check_apart(args)
    roles = steps.fit_roles(samples)
    busy_roles = None
    others = sorted(allowed - {min(allowed)}) if allowed is not None and args.threads == 1 else []
    if others and not args.no_neighbour:
        # The same sweep with another worker busy on the next CPU: what the host's shared caches
        # and memory cost a worker's steps when its neighbours work too.
        with steps.busy_neighbour(args.model, args.dtype, others[0]):
            busy_roles = steps.fit_roles(steps.sweep(probe, plan))
    dtype = probe.engine.runner.dtype
    kv_blocks = probe.num_blocks
    block_size = probe.block_size
    del probe
    if allowed is not None:
        os.sched_setaffinity(0, allowed)
    shape = transfer.cache_shape(
        model_config.num_layers, 300, block_size, model_config.num_kv_heads, model_config.head_dim
    )
    counts = transfer.QUICK_BLOCK_COUNTS if args.quick else transfer.BLOCK_COUNTS
    transfers = {
        name: transfer.measure(name, shape, dtype, counts) for name in args.transports.split(",") if name
    }
    overhead, start_s, host, notes = Overhead(), 0.0, None, []
    extra: dict[str, Any] = {}
    if gpu:
        extra["gpu"] = torch.cuda.get_device_name(0)
        notes.append(
            f"steps measured on {extra['gpu']}; KV pulls ({args.transports or 'none'}) between host "
            "caches: a GPU cache's pull also copies to and from the GPU (not timed here)"
        )
    if args.no_serve:
        notes.append("no serving overhead measured (--no-serve): the router and the worker loop cost nothing")
    else:
        probed = overhead_probe.measure(
            args.model, roles["colocated"], threads=args.threads, vocab_size=model_config.vocab_size
        )
        overhead, start_s, host = probed.overhead, probed.start_s, probed.host
        notes.append(probed.note)
    if args.quick:
        notes.append("--quick: a small sweep, for a check; not a profile to plan with")
    profile = Profile(
        source="measured",
        model=args.model,
        model_shape=model_config.raw or {},
        block_size=block_size,
        kv_blocks={role: kv_blocks for role in roles},
        steps=dict(roles),
        transfers=transfers,
        overhead=overhead,
        start_s=round(start_s, 2),
        meta={"device": args.device, "dtype": str(dtype).removeprefix("torch."), "threads": args.threads}
        | ({"stream_passes": passes.to_json()} if passes is not None else {})
        | {"speed_check": check.to_json()},
        assumptions=notes,
        host=host,
        steps_busy=dict(busy_roles) if busy_roles is not None else {},
    )
    return _stamped(profile, _machine() | extra | {"torch": torch.__version__, "samples": len(samples)})
