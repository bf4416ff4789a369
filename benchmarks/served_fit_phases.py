"""How a served profile's step fit (`pdserve profile --served`, pdserve/sim/calibrate.py) meets the
served steps, phase by phase of the staircase they were traced under: in sample, and with the
light phase held out (fitted on the rest, as a fit from a staircase without it would be), for
the fit's forms side by side. No torch.

    pdserve profile --model smollm2-135m --served --out runs/p.json
    .venv/bin/python benchmarks/served_fit_phases.py --base runs/p-steps/alone.json \
        --trace runs/p-steps/steps-dpd.jsonl runs/p-steps/steps-colocated.jsonl

Forms: `ratio` (this version's: alone and busy free, a prompt's cost per token attended at the
sweep's ratio to its cost per token), `free` (that ratio fitted too). `--old FILE`: a
calibrate.py of another version (say `git show fad3c9c:pdserve/sim/calibrate.py > old.py`, whose
busy term could only add to alone) fitted as a third form. Each cell: the phase's measured
seconds over fitted seconds (what a simulation's time adds up to) / the median of the steps'
measured / fitted; and the same for the prompt steps that attended over 100k tokens or more.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from pathlib import Path
from types import ModuleType
from typing import Any

from pdserve.sim import calibrate
from pdserve.sim import profile as profiles

PHASES = 4  # the staircase's parts (pdserve/measure/served.py STAIRCASE)
LONG_ATTENTION = 100_000  # prompt tokens x tokens attended: a long prompt's later chunks


def phased(base: profiles.Profile, traces: list[Path], load_s: float) -> dict[str, list[dict[str, Any]]]:
    """Each pool's rows with how busy the other workers were (as the fit reads it) and the phase
    of the staircase they ran in (from the trace's first step; the drain counts as the last)."""
    pools = calibrate.read_busy_trace(traces, base.host.cpus if base.host is not None else 1)
    for rows in calibrate.by_run(pools):
        start = min(float(r["t_s"]) - float(r["seconds"]) for r in rows)
        for row in rows:
            row["phase"] = min(PHASES - 1, int((float(row["t_s"]) - start) / (load_s / PHASES)))
    return pools


def fit(
    module: ModuleType, form: str, base: profiles.Profile, role: str, rows: list[dict[str, Any]], donor: Any
) -> Any:
    timed = [
        (calibrate.read_step(r), float(r["seconds"]), float(r["busy"]))
        for r in rows
        if float(r["seconds"]) > 0
    ]
    passes = calibrate.stream_passes(base)
    if form != "ratio":  # the free form, or an older version's own
        return module.fit_alone_and_busy(timed, donor, passes)
    ratio = calibrate.attention_ratio(base, role) if donor is None else None
    return calibrate.fit_alone_and_busy(timed, donor, passes, ratio)


def cells(pair: Any, rows: list[dict[str, Any]]) -> str:
    alone, busy = pair
    out = []
    for phase in range(PHASES):
        chosen = [r for r in rows if r["phase"] == phase and float(r["seconds"]) > 0]
        if not chosen:
            out.append(f"{'-':>10}")
            continue
        fitted = [
            alone.seconds(s) * (1 - r["busy"]) + busy.seconds(s) * r["busy"]
            for r in chosen
            if (s := calibrate.read_step(r))
        ]
        measured = [float(r["seconds"]) for r in chosen]
        median = statistics.median(m / max(f, 1e-9) for m, f in zip(measured, fitted, strict=True))
        out.append(f"{sum(measured) / sum(fitted):5.2f}/{median:4.2f}")
    return " ".join(out)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", type=Path, required=True, help="the sweep's profile (alone.json)")
    p.add_argument("--trace", type=Path, nargs="+", required=True)
    p.add_argument("--load-seconds", type=float, default=120.0, help="the staircase's length")
    p.add_argument("--old", type=Path, default=None, help="another version's calibrate.py, fitted too")
    args = p.parse_args()
    base = profiles.load(args.base)
    pools = phased(base, args.trace, args.load_seconds)
    forms: list[tuple[str, ModuleType]] = [("ratio", calibrate), ("free", calibrate)]
    if args.old is not None:
        spec = importlib.util.spec_from_file_location("old_calibrate", args.old)
        assert spec is not None and spec.loader is not None
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        forms.append(("old", old))
    print(f"phases of {args.load_seconds / PHASES:g} s; each cell: sum measured / sum fitted / median ratio")
    for form, module in forms:
        print(f"\n{form}")
        fits: dict[str, Any] = {}
        for role in sorted(pools, key=lambda r: (r not in ("colocated", "prefill"), r)):
            rows = pools[role]
            donor = None
            if (
                sum(1 for r in rows if int(r["prefill_tokens"]) >= calibrate.PROMPT_CHUNK_TOKENS)
                < calibrate.MIN_STEPS
            ):
                donor = next((fits[d] for d in ("colocated", "prefill") if d in fits), None)
            fits[role] = fit(module, form, base, role, rows, donor)
            alone, busy = fits[role]
            print(
                f"  {role} ({len(rows)} steps): alone c2 {alone.coefficients[2]:.3g}, busy c2 {busy.coefficients[2]:.3g}"
            )
            print(f"    {'in sample':34s} {cells(fits[role], rows)}")
            held = fit(module, form, base, role, [r for r in rows if r["phase"] != 0], donor)
            print(f"    {'light phase held out':34s} {cells(held, rows)}")
            long = [r for r in rows if int(r["prefill_attention"]) >= LONG_ATTENTION]
            if long:
                print(f"    {f'attending >= 100k ({len(long)} steps)':34s} {cells(fits[role], long)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
