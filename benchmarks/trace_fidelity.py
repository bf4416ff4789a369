"""Where a simulation's miss comes from (issue 33): served runs simulated three ways, from what a
plan can know beforehand to what the run itself did.

Each run is a fresh `pdserve serve CONFIG --step-trace` under `pdserve bench` at one rate, with a
speed check of this host right before and right after it; then `pdserve sim` of the same
deployment and workload, its profile scaled
- `checks`: by the two checks (their geometric mean; the prompt work by the checks' prompt steps),
  what a plan can know of the host's speed around the run;
- `trace`: by the run's own steps (`--speed-trace`: the median of its decode steps over the
  profile's fit, its prompt-only and its mixed steps each by their own);
- `replay`: by those and by how the host's speed moved during the run (`--speed-window`).
What `trace` still misses is the model's (or the host's moving within the run); what `replay`
closes of it was the host's, a stall a run-wide factor cannot hold (pdserve/sim/trace_speed.py).

    python benchmarks/trace_fidelity.py --profile profiles/cpu-avx512-epyc-smollm2-served.json \\
        --out runs/trace-fidelity --duration 120 --slo ttft=3000,itl=200 \\
        --workload "chat: poisson(2) prompt=lognormal(96,0.4,32,256) output=uniform(24,48)" \\
        --run "dpd@2=--prefill 1 --decode 1" --run "colocated@0.9=--colocated 2"

`--measured`: simulate the runs already in --out again (no serving). Writes each run's folder
(LABEL@SCALE/: the checks, steps.jsonl, bench/, and sim-checks/, sim-trace/, sim-replay/, each
with a folder a draw) and `trace_fidelity.md` / `.json` (the table: each simulated cell the median of
its draws'; `--draws N` simulations a mode, each on its own draw of the steps' deviations). Run on a quiet machine: server and client share its cores.

Repeats: runs of the same flags at the same rate (under labels of their own, e.g. "dpd@2=..." and
"dpd-b@2=...") serve the same workload (the same --seed) again; the flags are compared as words, so
write them alike ("--prefill 1 --decode 1" and "--decode 1 --prefill 1" are two deployments here). Each then also reads `repeat`: its
cells as the median of its repeats' would have predicted them: the served system's own
repeatability on this host, the yardstick to read a simulation of one run by; and the table adds,
for each group, how many latency cells each column has within 10%, and the runs' range of each
cell beside the range of each mode's simulated draws (also as `repeats.json`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

MODES = ("checks", "trace", "replay")
REPEAT = "repeat"  # the column of a run predicted by its repeats
TOLERANCE = 0.10  # the target: within 10%
CELLS = (
    ("ttft_ms", "p50"),
    ("ttft_ms", "p90"),
    ("itl_ms", "p50"),
    ("itl_ms", "p90"),
)
PARTS = ("prefill_queue", "prefill_compute", "kv_transfer", "first_decode")
CHECK_TIMEOUT_S = 600.0  # a speed check is ~30 s of a fresh engine
SIM_TIMEOUT_S = 1800.0  # a simulated run of minutes takes seconds; an hour of trace about a minute


@dataclass(frozen=True)
class Run:
    label: str
    scale: float
    serve_args: str

    @property
    def name(self) -> str:
        return f"{self.label}@{self.scale:g}"


def parse_run(text: str) -> Run:
    """LABEL@SCALE=SERVE ARGS, e.g. "dpd@2=--prefill 1 --decode 1"."""
    head, sep, serve_args = text.partition("=")
    label, at, scale = head.partition("@")
    try:
        value = float(scale)
    except ValueError:
        value = -1.0
    if not (sep and at and label and serve_args.strip() and value > 0):
        raise argparse.ArgumentTypeError(
            f'a run is LABEL@RATE_SCALE=SERVE ARGS ("dpd@2=--prefill 1 --decode 1"), got {text!r}'
        )
    return Run(label, value, serve_args.strip())


def measure(args: argparse.Namespace, run: Run, folder: Path) -> None:
    """The run served and benched, with a speed check of the host on either side."""
    from pdserve.measure.server import running

    folder.mkdir(parents=True, exist_ok=True)
    check = [sys.executable, "-m", "pdserve.cli", "profile", "--model", args.model, "--speed-check"]
    subprocess.run([*check, "--out", str(folder / "check-before.json")], check=True, timeout=CHECK_TIMEOUT_S)
    flags = [*shlex.split(run.serve_args), "--step-trace", str(folder / "steps.jsonl")]
    with running(args.model, flags) as server:
        bench = [sys.executable, "-m", "pdserve.cli", "bench", "--url", server.url, "--model", args.model]
        bench += [
            "--workload",
            args.workload,
            "--rate-scale",
            f"{run.scale:g}",
            "--duration",
            str(args.duration),
        ]
        bench += ["--slo", args.slo, "--seed", str(args.seed), "--out", str(folder / "bench")]
        bench += ["--drain-timeout", str(args.drain_timeout)]
        # The load, its drain, and the client's start and report.
        subprocess.run(bench, check=True, timeout=args.duration + args.drain_timeout + 300)
    subprocess.run([*check, "--out", str(folder / "check-after.json")], check=True, timeout=CHECK_TIMEOUT_S)


def simulate(args: argparse.Namespace, run: Run, folder: Path, mode: str, draw: int) -> bool:
    """`pdserve sim` of the run, its profile scaled as `mode` says, on the steps' deviations'
    draw `draw`; False where the run lacks what the mode needs (no checks beside it)."""
    command = [sys.executable, "-m", "pdserve.cli", "sim", "--profile", str(args.profile)]
    command += [*shlex.split(run.serve_args), "--workload", args.workload, "--rate-scale", f"{run.scale:g}"]
    command += ["--duration", str(args.duration), "--seed", str(args.seed), "--report-slo", args.slo]
    command += ["--finish-timeout", str(args.drain_timeout)]  # as the bench drained
    command += ["--noise-seed", str(draw), "--out", str(folder / f"sim-{mode}" / f"draw-{draw}")]
    command.append("--client-on-host")  # the bench ran on the servers' host
    if mode == "checks":
        checks = [folder / "check-before.json", folder / "check-after.json"]
        if not all(path.exists() for path in checks):
            return False
        command += ["--speed-check", *map(str, checks)]
    else:
        command += ["--speed-trace", str(folder / "steps.jsonl")]
    if mode == "replay":
        command += ["--speed-window", str(args.window)]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, timeout=SIM_TIMEOUT_S)
    return True


def cells(summary: dict[str, Any]) -> dict[str, float | None]:
    """A summary's cells by name: overall and per class TTFT / ITL p50 and p90, the share of
    requests within the SLO, and the mean of each part of a remotely prefilled TTFT."""
    out: dict[str, float | None] = {}
    sections = {"all": summary.get("overall", {})} | summary.get("classes", {})
    for section, body in sections.items():
        for metric, stat in CELLS:
            v = body.get(metric, {}).get(stat)
            out[f"{section} {metric[:-3]} {stat}"] = None if v is None else float(v)
        requests = body.get("requests") or 0
        good = body.get("good_requests")
        out[f"{section} in SLO"] = None if good is None or not requests else good / requests
    for part in PARTS:
        mean = summary.get("ttft_parts", {}).get(part, {}).get("mean_ms")
        out[f"part {part} mean"] = None if mean is None else float(mean)
    return out


def error(name: str, sim: float | None, measured: float | None) -> float | None:
    """A latency's relative error; a share's difference in points (a share is a fraction already)."""
    if sim is None or measured is None:
        return None
    if name.endswith("in SLO"):
        return sim - measured
    return (sim - measured) / measured if measured else None


def compare(folder: Path, draws_a_mode: int) -> dict[str, Any]:
    """One run's measured cells, and each mode's simulated cells' error: the median of its draws'
    (a simulated run near a knee is one draw of the steps' deviations, as a served run is one run);
    and each mode's draws' lowest and highest (`draws`)."""
    measured = cells(json.loads((folder / "bench" / "summary.json").read_text()))
    draws = {
        mode: [
            cells(json.loads(path.read_text()))
            for path in (folder / f"sim-{mode}" / f"draw-{k}" / "summary.json" for k in range(draws_a_mode))
            if path.exists()
        ]
        for mode in MODES
    }
    rows: dict[str, Any] = {}
    for name, value in measured.items():
        row: dict[str, Any] = {"measured": value, "draws": {}}
        for mode in MODES:
            values = [v for v in (d.get(name) for d in draws[mode]) if v is not None]
            row[mode] = error(name, statistics.median(values), value) if values else None
            if values:
                row["draws"][mode] = [min(values), max(values)]
        rows[name] = row
    return rows


def repeat_groups(runs: list[Run]) -> list[list[Run]]:
    """The runs that repeat one another: the same serve flags at the same rate (labels differ)."""
    groups: dict[tuple[tuple[str, ...], float], list[Run]] = {}
    for run in runs:
        groups.setdefault((tuple(shlex.split(run.serve_args)), run.scale), []).append(run)
    return [group for group in groups.values() if len(group) > 1]


def add_repeats(results: dict[str, dict[str, Any]], groups: list[list[Run]]) -> None:
    """Each repeated run's `repeat` error: its cells against the median of its repeats' (the
    prediction one more serving of the same run would have made)."""
    for group in groups:
        for run in group:
            others = [results[other.name] for other in group if other is not run]
            for name, row in results[run.name].items():
                values = [o[name]["measured"] for o in others if o.get(name, {}).get("measured") is not None]
                row[REPEAT] = error(name, statistics.median(values), row["measured"]) if values else None


def latency(name: str) -> bool:
    return name.endswith((" p50", " p90"))


def within(rows: list[dict[str, Any]], column: str) -> tuple[int, int]:
    """(latency cells within TOLERANCE in `column`, latency cells `column` has) over the rows."""
    errors = [row[column] for row in rows if row.get(column) is not None]
    return sum(abs(e) <= TOLERANCE for e in errors), len(errors)


def repeat_summary(results: dict[str, dict[str, Any]], group: list[Run]) -> dict[str, Any]:
    """A group's cells within 10% by each column, and each latency cell's range over the runs
    beside its range over each mode's simulated draws (all the draws of the group's runs that have
    the mode: `checks` needs the checks beside a run)."""
    names = [run.name for run in group]
    cells_of = [(name, row) for run in names for name, row in results[run].items() if latency(name)]
    counts = {column: within([row for _, row in cells_of], column) for column in (REPEAT, *MODES)}
    ranges: dict[str, dict[str, list[float]]] = {}
    for name in dict.fromkeys(name for name, _ in cells_of):
        rows = [results[run][name] for run in names if results[run].get(name, {}).get("measured") is not None]
        if len(rows) < len(names):
            continue  # a class one of the runs did not serve
        runs_range = [min(r["measured"] for r in rows), max(r["measured"] for r in rows)]
        ranges[name] = {"runs": runs_range}
        for mode in MODES:
            # A run without the checks beside it has no checks draws.
            spans = [r["draws"][mode] for r in rows if mode in r.get("draws", {})]
            if spans:
                ranges[name][mode] = [min(s[0] for s in spans), max(s[1] for s in spans)]
    with_mode = {
        mode: sum(any(mode in row.get("draws", {}) for row in results[run].values()) for run in names)
        for mode in MODES
    }
    return {"runs": names, "within": counts, "ranges": ranges, "runs_simulated": with_mode}


def _spread(span: list[float] | None) -> str:
    if not span:
        return "-"
    low, high = span
    return f"{low:.0f}..{high:.0f} ({high / low - 1:.0%})" if low > 0 else f"{low:.0f}..{high:.0f}"


def _of(summary: dict[str, Any], mode: str) -> str:
    """ " (3 of 4 runs)" where some of the group's runs lack the mode (no checks beside them)."""
    simulated, runs = summary["runs_simulated"][mode], len(summary["runs"])
    return "" if simulated == runs else f" ({simulated} of {runs} runs)"


def repeat_table(summaries: list[dict[str, Any]]) -> str:
    lines = []
    for summary in summaries:
        counts = ", ".join(f"{column} {n} of {total}" for column, (n, total) in summary["within"].items())
        lines += [
            f"### repeats: {', '.join(summary['runs'])}",
            "",
            f"Latency cells within {TOLERANCE:.0%} of the run: {counts}.",
            "",
            "| cell | the runs' range (spread) | "
            + " | ".join(f"{m} draws" + _of(summary, m) for m in MODES)
            + " |",
            "|---" * (2 + len(MODES)) + "|",
        ]
        for name, spans in summary["ranges"].items():
            shown = [_spread(spans.get(mode)) for mode in MODES]
            lines.append(f"| {name} | {_spread(spans['runs'])} | " + " | ".join(shown) + " |")
        lines.append("")
    return "\n".join(lines)


def table(results: dict[str, dict[str, Any]]) -> str:
    columns = MODES + (
        (REPEAT,) if any(REPEAT in row for rows in results.values() for row in rows.values()) else ()
    )
    lines = []
    for run, rows in results.items():
        lines += [
            f"### {run}",
            "",
            "| cell | measured | " + " | ".join(columns) + " |",
            "|---" * (2 + len(columns)) + "|",
        ]
        for name, row in rows.items():
            if row["measured"] is None:
                continue
            share = name.endswith("in SLO")
            shown = f"{row['measured']:.0%}" if share else f"{row['measured']:.0f} ms"
            errors = [
                "-" if row.get(m) is None else (f"{100 * row[m]:+.0f} pt" if share else f"{row[m]:+.0%}")
                for m in columns
            ]
            lines.append(f"| {name} | {shown} | " + " | ".join(errors) + " |")
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", type=Path, required=True, help="a profile fitted to served steps")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--workload", required=True)
    p.add_argument("--run", type=parse_run, action="append", required=True, metavar="LABEL@SCALE=SERVE ARGS")
    p.add_argument("--duration", type=float, default=120.0, help="seconds of load a run")
    p.add_argument("--slo", default="ttft=3000,itl=200")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--window", type=float, default=5.0, help="the replay's windows, seconds")
    p.add_argument(
        "--draws", type=int, default=3, help="simulations a mode, each on its own draw of the steps"
    )
    p.add_argument("--drain-timeout", type=float, default=120.0)
    p.add_argument("--measured", action="store_true", help="simulate the runs in --out again, no serving")
    args = p.parse_args(argv)
    if not args.window >= 1:
        p.error("--window must be at least 1 second (a window holds a few steps)")
    if not (args.duration > 0 and args.drain_timeout > 0):
        p.error("--duration and --drain-timeout must be > 0 seconds")
    if args.draws < 1:
        p.error("--draws must be >= 1")
    if len({run.name for run in args.run}) != len(args.run):
        p.error("two runs share a LABEL@SCALE: each is a folder of its own")
    return args


def unusable(args: argparse.Namespace) -> str | None:
    """Why the runs cannot be simulated as asked, found before any serving (None: they can)."""
    from pdserve.sim import profile as profiles
    from pdserve.sim.step_time import ProfileError

    try:
        profile = profiles.load(args.profile)
    except ProfileError as exc:
        return str(exc)
    if profile.steps_from != "serving":
        return f"{args.profile}: a step trace scales only a profile fitted to served steps (pdserve profile --served)"
    if args.measured:
        for run in args.run:
            folder = args.out / run.name
            if not all((folder / name).exists() for name in ("bench/summary.json", "steps.jsonl")):
                return f"{folder}: no measured run there (its bench/ and steps.jsonl; drop --measured to serve it)"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    why = unusable(args)
    if why is not None:
        print(why, file=sys.stderr)
        return 2
    results = {}
    for run in args.run:
        folder = args.out / run.name
        if not args.measured:
            measure(args, run, folder)
        for mode in MODES:
            shutil.rmtree(folder / f"sim-{mode}", ignore_errors=True)  # no draw of an earlier reading
            for draw in range(args.draws):
                simulate(args, run, folder, mode, draw)
        results[run.name] = compare(folder, args.draws)
    groups = repeat_groups(args.run)
    add_repeats(results, groups)
    summaries = [repeat_summary(results, group) for group in groups]
    text = table(results) + ("\n" + repeat_table(summaries) if summaries else "")
    (args.out / "trace_fidelity.md").write_text(text)
    (args.out / "trace_fidelity.json").write_text(json.dumps(results, indent=1) + "\n")
    if summaries:
        (args.out / "repeats.json").write_text(json.dumps(summaries, indent=1) + "\n")
    else:  # none of an earlier reading of other runs
        (args.out / "repeats.json").unlink(missing_ok=True)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
