"""`pdserve plan`: the deployment that serves a workload within its SLO at the best goodput per
worker, found by simulating every candidate (pdserve/sim/run.py). No torch.

    pdserve plan --profile h200-8b.json --workload "chat: poisson(20) ..." --duration 300 \\
        --slo ttft=1000,itl=50 --budget 8

The candidates: every split of at most `--budget` workers into a prefill and a decode pool
(P >= 1, D >= 1), and colocated pools of 1 .. budget workers, each with the engine and router
settings given (serve's flags and TOML), and with every combination of the values `--vary` lists
(`--vary prefill_chunk_size=256,512,1024`: the engine settings the profile's step model covers). A candidate meets the SLO when at least `--slo-percentile`
of its requests (0.9 by default) finished within every limit of `--slo`; among those, the one with
the most goodput per worker wins (fewer workers on a tie). Printed: the table of every candidate
(predicted TTFT and ITL at the SLO's percentile, goodput, requests within the SLO), the choice, and
a plain sentence when colocated chunked prefill is the better choice.

`--rate-scales 0.5,1,2,4`: for each multiple of the workload's rate, the fewest workers of each
kind (the best split, and colocated) that meet the SLO: "how many of each pool for this rate", as
a table and, with `--out`, the plot `plan.png`.

`--repeats 5`: each deployment simulated on five draws of the workload (seeds --seed, --seed + 1,
...) and of its steps' deviations from their fit (a trace replay, the same load each time,
varies by those); it meets the SLO when its median run does, the table shows each one's range,
and the choice says so when some of its runs missed: near its knee a deployment's runs differ, served as well as
simulated (a real 1P+1D at its knee gave a TTFT p50 of 442 and 726 ms in two runs).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from pdserve import serve_options
from pdserve.bench.compare import rate_scales
from pdserve.bench.summary import parse_slos, summarize
from pdserve.bench.workload import parse_workload
from pdserve.errors import PdserveError
from pdserve.sim import profile as profiles
from pdserve.sim import run as sim


def add_arguments(p: argparse.ArgumentParser) -> None:
    serve_options.add_arguments(p)
    sim.add_simulation_arguments(p)
    p.add_argument("--budget", type=int, required=True, help="workers (GPUs, with one per worker) at most")
    p.add_argument(
        "--rate-scales",
        default=None,
        help="a sweep: the fewest workers of each kind at each multiple of the rate (on top of --rate-scale)",
    )
    p.add_argument(
        "--kinds",
        default="disaggregated,colocated",
        help="which deployments to try: disaggregated, colocated or both",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="simulate each deployment this many times, on the workload drawn with --seed, --seed + 1, "
        "... and the steps' deviations drawn anew: it meets the SLO when its median run does, and the "
        "table shows the range (near its knee a deployment's runs differ, served or simulated)",
    )
    p.add_argument(
        "--vary",
        action="append",
        default=[],
        metavar="OPTION=V1,V2,...",
        help="also try each of these values of a serve option (repeatable; e.g. prefill_chunk_size=256,512,1024 "
        "or max_num_seqs=32,64): every deployment with every combination",
    )


@dataclass(frozen=True)
class Candidate:
    prefill: int = 0
    decode: int = 0
    colocated: int = 0
    settings: tuple[tuple[str, Any], ...] = ()  # serve options tried with it (--vary)

    @property
    def workers(self) -> int:
        return self.prefill + self.decode + self.colocated

    @property
    def kind(self) -> str:
        return "colocated" if self.colocated else "disaggregated"

    def __str__(self) -> str:
        pools = f"colocated {self.colocated}" if self.colocated else f"{self.prefill}P + {self.decode}D"
        return pools + "".join(f", {key}={value}" for key, value in self.settings)


@dataclass(frozen=True)
class Outcome:
    candidate: Candidate
    ttft_ms: float | None  # at the SLO's percentile
    itl_ms: float | None
    goodput: float  # requests per second within the SLO
    within_slo: float  # share of the requests
    errors: int
    meets: bool
    runs: int = 1  # simulated, each on the workload drawn with its own seed (--repeats)
    runs_meeting: int = 1
    within_slo_range: tuple[float, float] | None = None  # the lowest and highest run's share

    @property
    def per_worker(self) -> float:
        return self.goodput / self.candidate.workers


def candidates(budget: int, kinds: set[str], vary: dict[str, list[Any]] | None = None) -> list[Candidate]:
    found = []
    if "disaggregated" in kinds:
        found += [
            Candidate(p, d) for total in range(2, budget + 1) for p in range(1, total) for d in [total - p]
        ]
    if "colocated" in kinds:
        found += [Candidate(colocated=n) for n in range(1, budget + 1)]
    for key, values in (vary or {}).items():
        found = [replace(c, settings=(*c.settings, (key, v))) for c in found for v in values]
    return found


def parse_vary(texts: list[str]) -> dict[str, list[Any]]:
    """`--vary option=v1,v2`: values typed as serve's option table types them."""
    vary: dict[str, list[Any]] = {}
    for text in texts:
        key, _, values = text.partition("=")
        key = key.strip().replace("-", "_")
        if (
            key not in serve_options.OPTIONS
            or key in ("prefill", "decode", "colocated")
            or not values.strip()
        ):
            raise PdserveError(
                f"--vary takes OPTION=V1,V2 with a serve option (such as prefill_chunk_size), got {text!r}"
            )
        kind = serve_options.OPTIONS[key][0]
        if kind not in (int, float, str):  # bool("false") is True; a list or a file is no setting
            raise PdserveError(f"--vary takes a number or a word setting, and {key} is a {kind.__name__}")
        try:
            vary[key] = [kind(v.strip()) for v in values.split(",") if v.strip()]
        except ValueError:
            raise PdserveError(
                f"--vary {key}: the values must be of type {kind.__name__}, got {values!r}"
            ) from None
    return vary


def evaluate(
    base: dict[str, Any],
    profile: profiles.Profile,
    args: argparse.Namespace,
    candidate: Candidate,
    scale: float,
    slos: dict[str, float],
) -> Outcome:
    o = dict(base) | {
        "prefill": candidate.prefill,
        "decode": candidate.decode,
        "colocated": candidate.colocated,
    }
    o = sim.checked(o, profile)
    percentile = o["slo_percentile"]
    key = f"p{round(percentile * 100):d}"
    runs = []
    for repeat in range(args.repeats):
        workload = parse_workload(
            args.workload, args.seed + repeat, args.max_requests, args.duration, args.rate_scale * scale
        )
        # Each run draws its own steps' deviations too: a trace replay is the same load every
        # time, and what varies between its served runs is how the steps come out.
        result = sim.simulate(
            o,
            profile,
            workload,
            finish_timeout_s=args.finish_timeout,
            pool_sample_interval_s=0,
            client_on_host=args.client_on_host,
            noise_seed=repeat,
        )
        runs.append(summarize(result.records, result.duration_s, slos)["overall"])
    shares = [s["good_requests"] / s["requests"] if s["requests"] else 0.0 for s in runs]
    errors = max(s["errors"] for s in runs)
    share = statistics.median(shares)
    return Outcome(
        candidate,
        _median([s["ttft_ms"].get(key) for s in runs]),
        _median([s["itl_ms"].get(key) for s in runs]),
        statistics.median(s["goodput"] for s in runs),
        share,
        errors,
        share >= percentile and errors == 0,
        len(runs),
        sum(1 for s, run in zip(shares, runs, strict=True) if s >= percentile and run["errors"] == 0),
        (min(shares), max(shares)) if len(runs) > 1 else None,
    )


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def best(outcomes: list[Outcome]) -> Outcome | None:
    meeting = [o for o in outcomes if o.meets]
    return max(meeting, key=lambda o: (round(o.per_worker, 6), -o.candidate.workers), default=None)


def fewest(outcomes: list[Outcome], kind: str) -> Outcome | None:
    meeting = [o for o in outcomes if o.meets and o.candidate.kind == kind]
    return min(meeting, key=lambda o: (o.candidate.workers, -o.goodput), default=None)


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def table(outcomes: list[Outcome], percentile: float) -> str:
    p = f"p{round(percentile * 100):d}"
    lines = [
        f"| deployment | workers | TTFT {p} ms | ITL {p} ms | goodput req/s | per worker | within SLO | errors | meets |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for o in sorted(outcomes, key=lambda o: (-o.meets, -o.per_worker, o.candidate.workers)):
        within = f"{o.within_slo:.0%}"
        meets = "yes" if o.meets else "no"
        if o.within_slo_range is not None:  # several runs: the median, its range, how many met
            within += f" ({o.within_slo_range[0]:.0%}-{o.within_slo_range[1]:.0%})"
            meets += f" ({o.runs_meeting} of {o.runs} runs)"
        lines.append(
            f"| {o.candidate} | {o.candidate.workers} | {_ms(o.ttft_ms)} | {_ms(o.itl_ms)} | {o.goodput:.2f} | "
            f"{o.per_worker:.3f} | {within} | {o.errors} | {meets} |"
        )
    return "\n".join(lines)


def verdict(outcomes: list[Outcome], budget: int, percentile: float) -> str:
    choice = best(outcomes)
    if choice is None:
        return (
            f"No deployment of at most {budget} workers meets the SLO for {percentile:.0%} of the requests: "
            "give a larger --budget, a looser --slo, or less load."
        )
    sentence = (
        f"Choice: {choice.candidate} ({choice.candidate.workers} workers): {choice.goodput:.2f} req/s within the "
        f"SLO, {choice.per_worker:.3f} per worker."
    )
    if choice.runs_meeting < choice.runs:
        sentence += (
            f" It met the SLO in {choice.runs_meeting} of {choice.runs} simulated runs: it is near its knee, "
            "so measure it (pdserve bench) before you rely on it."
        )
    other = "disaggregated" if choice.candidate.kind == "colocated" else "colocated"
    rival = best([o for o in outcomes if o.candidate.kind == other])
    if choice.candidate.kind == "colocated":
        against = (
            f"the best split, {rival.candidate}, gives {rival.per_worker:.3f}"
            if rival
            else "no split meets it"
        )
        sentence += (
            f" Colocated chunked prefill is the better choice for this workload: {against} per worker."
        )
    elif rival is not None:
        sentence += (
            f" The best colocated deployment, {rival.candidate}, gives {rival.per_worker:.3f} per worker."
        )
    else:
        sentence += " No colocated deployment within the budget meets the SLO."
    return sentence


# Not printed in a command line: the pools come from the candidate, and a key is a secret.
_NOT_IN_COMMAND = {"prefill", "decode", "colocated", "pools", "metrics_key"}


def serve_command(candidate: Candidate, base: dict[str, Any], config: Path | None) -> str:
    """The `pdserve serve` command line of a candidate as it was simulated: its pools and settings,
    and every serve option given to plan that is not the default (the SLO among them: it is the
    server's ITL budget for its path choice, and it moves the result)."""
    words = ["pdserve", "serve"] + (["--config", str(config)] if config is not None else [])
    pools = (
        {"colocated": candidate.colocated}
        if candidate.colocated
        else {"prefill": candidate.prefill, "decode": candidate.decode}
    )
    chosen = dict(candidate.settings)
    for name, (_, default, _) in serve_options.OPTIONS.items():
        value = pools.get(name, chosen.get(name, base.get(name)))
        if name in pools or name in chosen or (name not in _NOT_IN_COMMAND and value != default):
            flag = "--" + name.replace("_", "-")
            if isinstance(value, bool):
                words.append(flag if value else "--no-" + name.replace("_", "-"))
            elif value is not None:
                words += [flag, str(value)]
    return shlex.join(words)


def run(args: argparse.Namespace) -> int:
    if args.budget < 1:
        raise PdserveError("--budget must be >= 1")
    if args.repeats < 1:
        raise PdserveError("--repeats must be >= 1")
    kinds = {k.strip() for k in args.kinds.split(",") if k.strip()}
    if not kinds or not kinds <= {"disaggregated", "colocated"}:
        raise PdserveError("--kinds takes disaggregated, colocated or both")
    profile, _, _ = sim.load_inputs(args)
    base = serve_options.layered(args)
    base["model"] = base["model"] or profile.model
    slos = parse_slos(args.report_slo if args.report_slo is not None else base["slo"])
    if not slos:
        raise PdserveError("pdserve plan needs an SLO to plan for: --slo ttft=MS,itl=MS")
    scales = rate_scales(args.rate_scales) if args.rate_scales else [1.0]
    tried = candidates(args.budget, kinds, parse_vary(args.vary))
    percentile = base["slo_percentile"]
    report: dict[str, Any] = {
        "profile": str(args.profile),
        "speed_factor": profile.meta.get("speed_factor"),
        "speed_factor_prompt": profile.meta.get("speed_factor_prompt"),
        "speed_factor_mixed": profile.meta.get("speed_factor_mixed"),
        "speed_factor_gemm": profile.meta.get("speed_factor_gemm"),
        "speed_factors_by_role": profile.meta.get("speed_factors_by_role"),
        "workload": args.workload,
        "slo": slos,
        "rate_scale": args.rate_scale,  # "scales" are keyed by --rate-scales, each on top of this
        "scales": {},
    }
    print(f"profile {args.profile}: {profile.model} ({profile.source}) {profile.meta.get('machine', '')}")
    for assumption in profile.assumptions:
        print(f"  assumes: {assumption}")
    sweep_rows = []
    for scale in scales:
        outcomes = [evaluate(base, profile, args, c, scale, slos) for c in tried]
        # The load as the workload runs: --rate-scales on top of --rate-scale.
        print(
            f"\n== load x{args.rate_scale * scale:g} of {args.workload}: {len(outcomes)} deployments simulated\n"
        )
        print(table(outcomes, percentile))
        print("\n" + verdict(outcomes, args.budget, percentile))
        chosen = best(outcomes)
        if chosen is not None:
            print(f"Serve it as simulated: {serve_command(chosen.candidate, base, args.config)}")
        dpd, coloc = fewest(outcomes, "disaggregated"), fewest(outcomes, "colocated")
        sweep_rows.append((scale, dpd, coloc))
        report["scales"][f"{scale:g}"] = {
            "outcomes": [asdict(o) | {"per_worker": o.per_worker} for o in outcomes],
            "choice": str(best(outcomes).candidate) if best(outcomes) else None,  # type: ignore[union-attr]
            "verdict": verdict(outcomes, args.budget, percentile),
            "serve": serve_command(chosen.candidate, base, args.config) if chosen else None,
        }
    if len(scales) > 1:
        print("\n== the fewest workers that meet the SLO, by load\n")
        print("| load | disaggregated | colocated |\n| --- | --- | --- |")
        for scale, dpd, coloc in sweep_rows:
            cells = [
                f"{o.candidate} ({o.candidate.workers})" if o else f"more than {args.budget}"
                for o in (dpd, coloc)
            ]
            print(f"| x{args.rate_scale * scale:g} | {cells[0]} | {cells[1]} |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "plan.json").write_text(json.dumps(report, indent=2, default=str))
        if len(scales) > 1:
            rows = [(args.rate_scale * scale, dpd, coloc) for scale, dpd, coloc in sweep_rows]
            _plot(rows, args.budget, args.out / "plan.png")
        print(f"wrote plan.json{', plan.png' if len(scales) > 1 else ''} in {args.out}", file=sys.stderr)
    return 0


def _plot(rows: list[tuple[float, Outcome | None, Outcome | None]], budget: int, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    scales = [r[0] for r in rows]
    for index, label in ((1, "disaggregated (P + D)"), (2, "colocated")):
        ys = [r[index].candidate.workers if r[index] else None for r in rows]  # type: ignore[union-attr]
        ax.plot(scales, [y if y is not None else float("nan") for y in ys], marker="o", label=label)
    for scale, dpd, _ in rows:
        if dpd is not None:
            ax.annotate(
                str(dpd.candidate), (scale, dpd.candidate.workers), textcoords="offset points", xytext=(4, 4)
            )
    ax.axhline(budget, color="grey", linestyle=":", label=f"budget ({budget})")
    ax.set_xlabel("load (multiple of the workload's rate)")
    ax.set_ylabel("workers that meet the SLO")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
