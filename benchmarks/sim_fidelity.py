"""The simulator's fidelity (issue 33): the same deployments and workloads measured here
(`pdserve bench compare`, real servers) and simulated (`pdserve sim` with a profile measured here),
side by side: TTFT and ITL p50/p90, goodput and the knee, per load band.

    python benchmarks/sim_fidelity.py --profile profiles/cpu.json --out runs/fidelity \\
        --workload "chat: poisson(0.5) prompt=lognormal(96,0.4,32,256) output=uniform(24,48)" \\
        --rate-scales 1,2,4 --duration 90 --slo ttft=2000,itl=250 \\
        --config "dpd=--prefill 1 --decode 1" --config "colocated=--colocated 2"

A configuration's rates are simulated one after another on one deployment, as `bench compare`
measures them on one server (`--fresh-per-rate`: each on its own).

`--speed-check`: each configuration measured by a `bench compare` of its own, with a speed check
of this host (`pdserve profile --speed-check`) right before and right after its runs; each is
simulated with the profile scaled by the geometric mean of the two checks' factors against the
profile's own check (pdserve/sim/speed.py): the host's speed while it was measured, not when the
profile was (a shared 2-vCPU host drifted 24-35% in 25 minutes).

`--check-every-rate` (with `--speed-check`): a check between every two rates as well, each rate
measured by a `bench compare` of its own (a fresh server per rate) and simulated on a fresh
deployment with the mean of the checks right before and right after it: the host moved x1.30 ->
x1.60 in the seven minutes of one config's runs, more than a factor per config can follow.
`--one-factor [mean|median]`: every rate scaled by the mean of all the config's checks instead (a
check is a few seconds of a host whose speed also moves from one half-minute to the next: more
checks, averaged, are a steadier measure than the two nearest), or by their median (one check
caught in a stall does not move it).

`--measured DIR`: reuse a finished `bench compare` folder instead of measuring again (with
`--speed-check`: the folder this script wrote, a `bench compare` folder and two checks a config;
with `--check-every-rate`, a folder and a check per rate and one more a config). Writes
`fidelity.md` (the table) and `fidelity.json` into --out. With `--repeats N` each measured cell
shows ±half the spread of its N runs ((max - min) / median / 2): what the machine itself does from
one run to the next, against which a simulation's error can be read. Run on a quiet machine: the
servers and the client share its cores.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its scoring, beside it (also when loaded by path)
import fidelity_score as scoring
from fidelity_score import METRICS, crossing_error, crossing_text, knee, score, share, spread
from fidelity_speed import check_factors, check_names, prompt_ratio, rate_factors

PARTS = ("prefill_queue", "prefill_compute", "kv_transfer", "first_decode")


def measure(args: argparse.Namespace, folder: Path, configs: list[str], rate_scales: str = "") -> None:
    command = [sys.executable, "-m", "pdserve.cli", "bench", "compare", "--model", args.model]
    for config in configs:
        command += ["--config", config]
    command += [
        "--workload",
        args.workload,
        "--rate-scales",
        rate_scales or args.rate_scales,
        "--duration",
        str(args.duration),
    ]
    command += [
        "--slo",
        args.slo,
        "--repeats",
        str(args.repeats),
        "--seed",
        str(args.seed),
        "--out",
        str(folder),
        "--drain-timeout",
        str(args.drain_timeout),
    ]
    subprocess.run(command, check=True)


def speed_check(args: argparse.Namespace, out: Path) -> None:
    command = [sys.executable, "-m", "pdserve.cli", "profile", "--model", args.model, "--speed-check"]
    subprocess.run([*command, "--out", str(out)], check=True)


def measure_config(
    args: argparse.Namespace, folder: Path, label: str, config: str, scales: list[float]
) -> None:
    """One config's runs with the host's speed checked around them (--speed-check)."""
    checks = [folder / name for name in check_names(args, label, scales)]
    speed_check(args, checks[0])
    if not args.check_every_rate:
        measure(args, folder / label, [config])
        speed_check(args, checks[1])
        return
    for scale, check in zip(scales, checks[1:], strict=True):
        measure(args, folder / f"{label}@{scale:g}", [config], f"{scale:g}")
        speed_check(args, check)


def read_measured(
    args: argparse.Namespace, folder: Path, labels: list[str], scales: list[float]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The runs and timelines of every cell, named as one `bench compare` of every config names them."""
    measured: dict[str, Any] = {}
    timelines: dict[str, Any] = {}
    if not args.speed_check:
        compared = json.loads((folder / "summaries.json").read_text())
        return compared["runs"], compared["timelines"]
    for label in labels:
        if not args.check_every_rate:
            compared = json.loads((folder / label / "summaries.json").read_text())
            measured |= compared["runs"]
            timelines |= compared["timelines"]
            continue
        for scale in scales:  # one bench compare a rate: its runs are named by the label alone
            compared = json.loads((folder / f"{label}@{scale:g}" / "summaries.json").read_text())
            name = label if len(scales) == 1 else f"{label}@{scale:g}"
            measured[name] = compared["runs"][label]
            timelines[name] = compared["timelines"][label]
    return measured, timelines


def simulate(
    args: argparse.Namespace,
    serve_args: str,
    scales: list[float],
    seed: int,
    factor: float | None = None,
    fresh: bool | None = None,
    prompt_ratio: float | None = None,
) -> list[dict[str, Any]]:
    """One summary per rate scale. The rates run one after another on one simulated deployment, as
    `bench compare` ran them on one server (its router's path-choice cost model, fitted at the
    lower rates, carries into the next); `--fresh-per-rate` (or `fresh`): each on a deployment of
    its own. The profile scaled by `factor`, its prompt work by `factor * prompt_ratio` if given."""
    from pdserve.bench.summary import parse_slos, summarize
    from pdserve.bench.timeline import build_timeline
    from pdserve.bench.workload import parse_workload
    from pdserve.sim import profile as profiles
    from pdserve.sim import run as sim

    parser = argparse.ArgumentParser()
    sim.add_arguments(parser)
    # The SLO is the report's, as bench compare's --slo is: the measured server got only the
    # config's flags (its own --slo, if any, which sets its ITL budget and so its path choice).
    sim_args = parser.parse_args(
        [
            "--profile",
            str(args.profile),
            "--model",
            args.model,
            *shlex.split(serve_args),
            "--report-slo",
            args.slo,
        ]
    )
    profile = profiles.load(args.profile)
    if factor is not None:
        from pdserve.sim import speed

        profile = speed.scaled(profile, factor, None if prompt_ratio is None else factor * prompt_ratio)
    o = sim.resolve(sim_args, profile)
    workloads = [parse_workload(args.workload, seed, None, args.duration, scale) for scale in scales]
    # The bench client ran on this host, beside the servers: its CPU is charged too.
    options: dict[str, Any] = {
        "finish_timeout_s": args.drain_timeout,
        "pool_sample_interval_s": 1.0,
        "client_on_host": True,
    }
    if args.fresh_per_rate if fresh is None else fresh:
        results = [sim.simulate(o, profile, w, **options) for w in workloads]
    else:
        results = sim.simulate_in_sequence(o, profile, workloads, **options)
    slos = parse_slos(args.slo)
    summaries = []
    for workload, result in zip(workloads, results, strict=True):
        summary = summarize(result.records, result.duration_s, slos)
        timeline = build_timeline(
            result.records, result.duration_s, slos, 10.0, result.pool_samples, workload.steps, 1.0
        )
        summary["worker_seconds"] = timeline["worker_seconds"]["total"]
        summary["wall_s"] = result.wall_s
        summary |= result.server
        summaries.append(summary)
    return summaries


def simulate_rates(
    args: argparse.Namespace,
    serve_args: str,
    scales: list[float],
    seed: int,
    factors: list[float | None],
    prompt_ratio: float | None = None,
) -> list[dict[str, Any]]:
    """One summary per rate scale; a rate of its own factor is simulated on a deployment of its own."""
    if args.fresh_per_rate and len(set(factors)) > 1:
        return [
            simulate(args, serve_args, [scale], seed, factor, prompt_ratio=prompt_ratio)[0]
            for scale, factor in zip(scales, factors, strict=True)
        ]
    return simulate(args, serve_args, scales, seed, factors[0], prompt_ratio=prompt_ratio)


def knee_shares(
    args: argparse.Namespace,
    serve_args: str,
    factors: list[float | None],
    simulated: dict[float, float],
    prompt_ratio: float | None = None,
) -> dict[float, float]:
    """The simulated shares within the SLO with `--knee-scales` added: each scale not simulated yet
    on a fresh deployment per repeat's seed (the median of the repeats), at the config's speed (the
    geometric mean of its rates' factors)."""
    extra = [x for x in (float(v) for v in args.knee_scales.split(",") if v) if x not in simulated]
    if not extra:
        return dict(simulated)
    known = [f for f in factors if f is not None]
    factor = statistics.geometric_mean(known) if known else None
    runs = [
        simulate(args, serve_args, extra, args.seed + r, factor, fresh=True, prompt_ratio=prompt_ratio)
        for r in range(args.repeats)
    ]
    shares = dict(simulated)
    for i, scale in enumerate(extra):
        shares[scale] = statistics.median(share(summaries[i]) for summaries in runs)
    return shares


def value(summary: dict[str, Any], metric: str, stat: str) -> float | None:
    v = summary.get("overall", {}).get(metric, {}).get(stat)
    return float(v) if v is not None else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", type=Path, required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workload", required=True)
    p.add_argument("--rate-scales", default="1,2,4")
    p.add_argument("--duration", type=float, default=90.0)
    p.add_argument("--slo", default="ttft=2000,itl=250")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument(
        "--drain-timeout", type=float, default=120.0, help="seconds for requests in flight at the end"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--fresh-per-rate",
        action="store_true",
        help="simulate each rate on a fresh deployment (default: in sequence on one, as measured)",
    )
    p.add_argument("--config", action="append", required=True, metavar="LABEL=SERVE_ARGS")
    p.add_argument("--measured", type=Path, default=None, help="a finished bench compare folder")
    p.add_argument(
        "--speed-check",
        action="store_true",
        help="check the host's speed before and after each config's runs, and simulate each with the "
        "profile scaled to it (the profile must hold its own check: `pdserve profile` of this version)",
    )
    p.add_argument(
        "--check-every-rate",
        action="store_true",
        help="with --speed-check: check between every two rates too, measure each rate on a server of "
        "its own and simulate it fresh, scaled by the checks right before and after it",
    )
    p.add_argument(
        "--one-factor",
        nargs="?",
        const="mean",
        choices=("mean", "median"),
        help="with --check-every-rate: scale every rate by one factor of all the config's checks, their "
        "geometric mean (the default) or their median (robust to one check caught in a stall)",
    )
    p.add_argument(
        "--one-speed",
        action="store_true",
        help="with --speed-check: scale the prompt work by the steps' factor too, not by the checks' "
        "prompt steps' own (as before pdserve sim read them apart)",
    )
    p.add_argument(
        "--unscaled",
        action="store_true",
        help="with --speed-check and --measured: simulate with the profile as it is (the checks only said)",
    )
    p.add_argument(
        "--knee-scales",
        default="",
        metavar="S1,S2,...",
        help="more rate scales to simulate (each on a fresh deployment, every repeat's seed, at the config's "
        "mean factor) for the simulated knee's crossing: the measured one is interpolated between the "
        "measured rates. The measured rates are simulated fresh too only with --check-every-rate or "
        "--fresh-per-rate: use one of them for a curve of one kind",
    )
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args(argv)
    try:
        knee_scales = [float(v) for v in args.knee_scales.split(",") if v.strip()]
    except ValueError:
        knee_scales = [-1.0]
    if not all(math.isfinite(v) and v > 0 for v in knee_scales):
        p.error(f"--knee-scales takes rate scales > 0, comma-separated: got {args.knee_scales!r}")
    if args.check_every_rate and not args.speed_check:
        p.error("--check-every-rate goes with --speed-check")
    if args.one_factor and not args.check_every_rate:
        p.error("--one-factor goes with --check-every-rate")
    args.fresh_per_rate |= args.check_every_rate  # each rate measured on a server of its own
    return args


def main() -> int:
    args = parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    measured_dir = args.measured or args.out / "measured"
    labels = [config.split("=", 1)[0] for config in args.config]
    scales = [float(s) for s in args.rate_scales.split(",")]
    if args.measured is None and args.speed_check:
        for label, config in zip(labels, args.config, strict=True):
            measure_config(args, measured_dir, label, config, scales)
    elif args.measured is None:
        measure(args, measured_dir, args.config)
    measured, timelines = read_measured(args, measured_dir, labels, scales)
    rows = []
    parts_rows: list[str] = []
    speeds: list[str] = []  # the host's speed factor per config (--speed-check)
    curves: list[str] = []  # the simulated share in the SLO by rate, per config (--knee-scales)
    scores: dict[str, dict[str, Any]] = {}  # issue 33's target, per config
    result: dict[str, Any] = {
        "workload": args.workload,
        "slo": args.slo,
        "profile": str(args.profile),
        "cases": {},
    }
    for config in args.config:
        label, serve_args = config.split("=", 1)
        shares: dict[str, dict[float, float]] = {"measured": {}, "sim": {}}
        # The profile's speed factor per rate: None, one for all (the mean of the checks before and
        # after the config's runs), or (--check-every-rate) the mean of the two around each rate.
        factors: list[float | None] = [None] * len(scales)
        ratio: float | None = None  # the prompt work's factor over the steps' (the checks' prompt steps)
        if args.speed_check:
            checks = check_factors(args, measured_dir, label, scales)
            ratio = None if args.unscaled else prompt_ratio(args, measured_dir, label, scales)
            means = rate_factors(checks, args.check_every_rate, args.one_factor)
            result["cases"][f"{label}:speed"] = {
                "factor": means[0] if len(means) == 1 else means,
                "checks": checks,
                "prompt_ratio": ratio,
                "used": not args.unscaled,
            }
            speeds.append(
                f"{label} x"
                + "/".join(f"{m:.3f}" for m in means)
                + " (checks "
                + ", ".join(f"x{c:.3f}" for c in checks)
                + ")"
                + ("" if ratio is None else f", the prompt work x{ratio:.3f} of that")
            )
            if not args.unscaled:
                factors = list(means) if len(means) == len(scales) else [means[0]] * len(scales)
        # Repeat r: the workload drawn from seed + r at every rate, as bench compare draws it.
        per_repeat = [
            simulate_rates(args, serve_args, scales, args.seed + r, factors, ratio)
            for r in range(args.repeats)
        ]
        for i, scale in enumerate(scales):
            name = label if len(scales) == 1 else f"{label}@{scale:g}"
            real = measured[name]
            simulated = [runs[i] for runs in per_repeat]
            case: dict[str, Any] = {}
            for metric, stat in METRICS:
                runs = [v for s in real if (v := value(s, metric, stat)) is not None]
                m = statistics.median(runs)
                s = statistics.median(v for s in simulated if (v := value(s, metric, stat)) is not None)
                case[f"{metric[:-3]}_{stat}"] = {
                    "measured": m,
                    "sim": s,
                    "error": (s - m) / m if m else None,
                    "measured_spread": spread(runs),
                }
            runs = [s["overall"]["goodput"] for s in real]
            gm = statistics.median(runs)
            gs = statistics.median(s["overall"]["goodput"] for s in simulated)
            case["goodput"] = {
                "measured": gm,
                "sim": gs,
                "error": (gs - gm) / gm if gm else None,
                "measured_spread": spread(runs),
            }
            shares["measured"][scale] = statistics.median(share(s) for s in real)
            shares["sim"][scale] = statistics.median(share(s) for s in simulated)
            case["slo_share"] = {"measured": shares["measured"][scale], "sim": shares["sim"][scale]}
            case["sim_wall_s"] = statistics.median(s["wall_s"] for s in simulated)
            case["worker_seconds"] = {
                "measured": statistics.median(t["worker_seconds"]["total"] for t in timelines[name]),
                "sim": statistics.median(s["worker_seconds"] for s in simulated),
            }
            for part in PARTS:
                m_parts = [s["ttft_parts"][part]["mean_ms"] for s in real if part in s.get("ttft_parts", {})]
                s_parts = [
                    s["ttft_parts"][part]["mean_ms"] for s in simulated if part in s.get("ttft_parts", {})
                ]
                if m_parts and s_parts:
                    m, s_ = statistics.median(m_parts), statistics.median(s_parts)
                    case[part] = {"measured": m, "sim": s_, "error": (s_ - m) / m if m else None}
                    parts_rows.append(
                        f"| {label} | x{scale:g} | {part} | {m:.1f} | {s_:.1f} | "
                        + (f"{(s_ - m) / m:+.0%}" if m else "-")
                        + " |"
                    )
            for path in ("local", "remote"):  # prompts per path: the routers' choices, side by side
                m_paths = [s["paths"].get(path, 0) for s in real if "paths" in s]
                s_paths = [s.get("paths", {}).get(path, 0) for s in simulated]
                if m_paths:
                    m, s_ = statistics.median(m_paths), statistics.median(s_paths)
                    case[f"{path}_prefills"] = {"measured": m, "sim": s_}
                    parts_rows.append(
                        f"| {label} | x{scale:g} | {path} prefills (count) | {m:g} | {s_:g} | |"
                    )
            case["classes"] = scoring.by_class(
                real, simulated
            )  # a bimodal workload's all-requests p90 is no user's
            result["cases"][name] = case
            cells = [f"{label}", f"x{scale:g}"]
            for key in ("ttft_p50", "ttft_p90", "itl_p50", "itl_p90", "goodput"):
                c = case[key]
                error = f"{c['error']:+.0%}" if c["error"] is not None else "-"
                noise = f" ±{c['measured_spread'] / 2:.0%}" if c["measured_spread"] is not None else ""
                cells.append(f"{c['measured']:.1f}{noise} / {c['sim']:.1f} ({error})")
            cells.append(f"{case['slo_share']['measured']:.0%} / {case['slo_share']['sim']:.0%}")
            ws = case["worker_seconds"]
            cells.append(f"{ws['measured']:.0f} / {ws['sim']:.0f}")
            rows.append("| " + " | ".join(cells) + " |")
        knees = {k: knee(scales, v) for k, v in shares.items()}
        result["cases"][f"{label}:knee"] = knees
        grid = knee_shares(args, serve_args, factors, shares["sim"], ratio)
        crossing = crossing_error(shares["measured"], grid)
        # The simulated share curve it was read from (with --knee-scales, the fine grid's).
        result["cases"][f"{label}:knee_crossing"] = crossing | {
            "sim_shares": {f"{k:g}": grid[k] for k in sorted(grid)}
        }
        by_scale = {
            scale: result["cases"][label if len(scales) == 1 else f"{label}@{scale:g}"] for scale in scales
        }
        scores[label] = score(by_scale, scales, knees["measured"]) | {
            "knee_as_measured": knees["measured"] == knees["sim"],
            "knee_crossing_error": crossing["error"],
        }
        if any(case.get("classes") for case in by_scale.values()):
            scores[label]["classes"] = scoring.class_score(by_scale, scales, knees["measured"])
        rows.append(
            f"| {label} | knee | measured x{knees['measured']} / simulated x{knees['sim']} | | | | | | |"
        )
        rows.append(f"| {label} | knee, interpolated | measured {crossing_text(crossing)} | | | | | | |")
        if args.knee_scales:
            curves.append(f"{label}: " + ", ".join(f"x{k:g} {grid[k]:.1%}" for k in sorted(grid)))
    header = (
        "| config | load | TTFT p50 ms meas / sim | TTFT p90 | ITL p50 | ITL p90 | goodput req/s | in SLO | worker-s |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"
    )
    table = f"workload: `{args.workload}`, SLO {args.slo}, {args.duration:g} s, profile {args.profile}\n\n"
    if speeds:
        scaled = "not scaled (--unscaled); the" if args.unscaled else "scaled to the"
        table += f"the profile {scaled} host's speed checks: " + "; ".join(speeds) + "\n\n"
    table += header + "\n" + "\n".join(rows) + "\n"
    result["score"] = scores
    table += (
        "\nAt or below the measured knee (every load where the SLO held throughout), TTFT and ITL p50/p90: "
    )
    table += "; ".join(
        f"{label} {s['within']} of {s['cells']} within 10% ({s['within_spread']} within 10% or the runs' "
        f"spread), the knee {'as measured' if s['knee_as_measured'] else 'missed'}"
        + (
            f" (interpolated: {'within' if abs(s['knee_crossing_error']) <= 0.10 else 'off by more than'} 10%)"
            if s["knee_crossing_error"] is not None
            else ""
        )
        for label, s in scores.items()
    )
    table += ".\n"
    if curves:
        table += "\nSimulated share of the requests in the SLO by rate (with --knee-scales):\n\n"
        table += "\n".join(f"- {curve}" for curve in curves) + "\n"
    table += scoring.class_table(result["cases"], scores)
    if parts_rows:
        table += "\nTTFT by part (remotely prefilled requests; mean ms, the router's own breakdown) and prompts by path:\n\n"
        table += (
            "| config | load | part | measured | simulated | error |\n| --- | --- | --- | --- | --- | --- |\n"
        )
        table += "\n".join(parts_rows) + "\n"
    (args.out / "fidelity.md").write_text(table)
    (args.out / "fidelity.json").write_text(json.dumps(result, indent=2))
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
