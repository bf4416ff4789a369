"""`pdserve pools`: the admin API from a terminal. No torch.

    pdserve pools [--url URL]                           each pool and its workers
    pdserve pools --watch [--interval S] [--frames N]   the same, with the planner's view, every S s
    pdserve pools scale POOL N                          start or drain workers until POOL has N
    pdserve pools drain WORKER [--force] [--replace]    drain a worker, then stop it
    pdserve pools rebalance [POOL]                      move streams onto the idlest workers

What the server refuses (an unknown pool, replicas out of bounds, the last worker of a pool) is
printed as one `pdserve: error:` line with exit code 2.

`--watch` redraws every S seconds (default 2) until Ctrl-C (or N frames): per pool the workers up
against the target, the planner's desired size, TTFT and ITL p50/p90/p99 (`!` where the SLO
percentile is above the SLO), KV in use, prompt tokens/s, streams, predicted against observed; then
the workers, the path choices (remote and local prefill) and the planner's last decisions, newest
first. On a terminal it redraws in place; piped, it prints the frames one after another, a blank
line between them. A server it cannot reach is a `cannot reach URL: ...` frame, and it keeps trying.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any

import httpx

from pdserve.errors import PdserveError

COLUMNS = (
    ("worker", "id"),
    ("state", "state"),
    ("streams", "streams"),
    ("running", "running"),
    ("waiting", "waiting"),
    ("kv used", "kv_blocks_used"),
    ("kv free", "kv_blocks_free"),
    ("queued tok", "queued_prompt_tokens"),
    ("leases", "held_leases"),
    ("where", "rpc_address"),
)
BREACH = "!"  # after a latency above its SLO
DECISIONS_SHOWN = 5
QUANTILES = ("p50", "p90", "p99")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the router (default: %(default)s)")
    p.add_argument(
        "--admin-key",
        default=os.environ.get("PDSERVE_ADMIN_KEY"),
        help="the server's admin key (default: $PDSERVE_ADMIN_KEY); sent as Authorization: Bearer",
    )
    p.add_argument("--json", action="store_true", help="print the server's JSON answer")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server")
    p.add_argument("--watch", action="store_true", help="redraw the pools every --interval s until Ctrl-C")
    p.add_argument(
        "--interval", type=_positive(float), help="with --watch: seconds between frames (default 2)"
    )
    p.add_argument("--frames", type=_positive(int), help="with --watch: stop after N frames")
    sub = p.add_subparsers(dest="action")
    scale = sub.add_parser("scale", help="start or drain workers until the pool has N")
    scale.add_argument("pool")
    scale.add_argument("replicas", type=int)
    drain = sub.add_parser("drain", help="drain a worker (its streams move to others), then stop it")
    drain.add_argument("worker")
    drain.add_argument("--force", action="store_true", help="even the last worker of its pool that is up")
    drain.add_argument("--replace", action="store_true", help="keep the pool's size: start one in its place")
    rebalance = sub.add_parser("rebalance", help="move streams from the busiest workers to the idlest")
    rebalance.add_argument("pool", nargs="?", default="decode")


def _positive(kind: type[float] | type[int]) -> Any:
    def parse(text: str) -> float | int:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be above 0: {text!r}")
        return value

    return parse


def auth_headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def run(args: argparse.Namespace) -> int:
    if args.watch:
        if args.action is not None:
            raise PdserveError(f"--watch shows the pools; it does not go with `{args.action}`")
        if args.json:
            raise PdserveError("--watch draws frames for people; for the JSON, leave out --watch")
        return watch(args)
    if args.interval is not None or args.frames is not None:
        raise PdserveError("--interval and --frames go with --watch")
    try:
        with httpx.Client(
            base_url=args.url, timeout=args.timeout, headers=auth_headers(args.admin_key)
        ) as client:
            if args.action == "scale":
                answer = client.put(f"/pools/{args.pool}", json={"replicas": args.replicas})
            elif args.action == "drain":
                body = {"force": args.force, "replace": args.replace}
                answer = client.post(f"/workers/{args.worker}/drain", json=body)
            elif args.action == "rebalance":
                answer = client.post(f"/pools/{args.pool}/rebalance")
            else:
                answer = client.get("/pools")
    except httpx.HTTPError as exc:
        raise PdserveError(f"cannot reach {args.url}: {exc}") from None
    body = _body(answer)
    if answer.status_code != 200:
        raise PdserveError(_message(body) or f"{args.url} answered {answer.status_code}")
    if args.json:
        print(json.dumps(body, indent=2))
    elif args.action == "rebalance":
        moved = body["moved"]
        print(
            f"pool {body['pool']}: "
            + (", ".join(f"{n} from {w}" for w, n in moved.items()) or "nothing to move")
        )
    elif args.action == "drain":
        print(f"{body['id']}: {body['state']}")
        print(table([body]))
    elif args.action == "scale":
        print(describe_pool(body))
    else:
        print("\n\n".join(describe_pool(pool) for pool in body["pools"].values()))
    return 0


def _body(answer: httpx.Response) -> Any:
    try:
        return answer.json()
    except ValueError:
        raise PdserveError(
            f"the server answered {answer.status_code} with something that is not JSON"
        ) from None


def _message(body: Any) -> str | None:
    """The message of an error answer ({"error": {"message": ...}}), if it has one."""
    error = body.get("error") if isinstance(body, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return str(message) if message else None


def describe_pool(pool: dict[str, Any]) -> str:
    workers = pool.get("workers") or []
    up = sum(w.get("state") == "up" for w in workers)
    head = (
        f"pool {pool.get('pool', '-')}: {up} up, target {_cell(pool.get('target'))} "
        f"(min {_cell(pool.get('min'))}, max {_cell(pool.get('max'))})"
    )
    if pool.get("last_error"):
        head += f"\n  last error: {pool['last_error']}"
    return head + ("\n" + table(workers) if workers else "\n  (no workers)")


def table(workers: list[dict[str, Any]]) -> str:
    rows = [[title for title, _ in COLUMNS]]
    rows += [[_cell(w.get(key)) for _, key in COLUMNS] for w in workers]
    return _grid(rows)


def _grid(rows: list[list[str]]) -> str:
    """Rows of cells as fixed-width columns, indented by two spaces; the first row is the titles."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


# -- --watch ---------------------------------------------------------------------------------------


def watch(args: argparse.Namespace) -> int:
    """Frames until Ctrl-C (exit 0) or `--frames`. Every error is a frame: the watch goes on."""
    interval = 2.0 if args.interval is None else args.interval
    on_tty = sys.stdout.isatty()
    shown = 0
    try:
        with httpx.Client(
            base_url=args.url, timeout=args.timeout, headers=auth_headers(args.admin_key)
        ) as client:
            due = time.monotonic()
            while True:
                text = frame(client, args.url)
                if on_tty:  # home, each line over the old one, then clear what the old frame had below
                    out = "\x1b[H" + "".join(line + "\x1b[K\n" for line in text.splitlines()) + "\x1b[J"
                else:
                    out = ("\n" if shown else "") + text + "\n"
                sys.stdout.write(out)
                sys.stdout.flush()
                shown += 1
                if args.frames is not None and shown >= args.frames:
                    return 0
                # on a beat: a slow answer shortens the wait; one slower than the beat starts a new beat
                due = max(due + interval, time.monotonic())
                time.sleep(max(0.0, due - time.monotonic()))
    except KeyboardInterrupt:
        if on_tty:
            sys.stdout.write("\n")
        return 0
    except BrokenPipeError:  # `pdserve pools --watch | head`: the reader has gone, and so do we
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 0


def frame(client: httpx.Client, url: str) -> str:
    """One frame: GET /pools rendered, or one line saying why there is nothing to render."""
    try:
        answer = client.get("/pools")
    except httpx.HTTPError as exc:
        return (
            _one_line(f"cannot reach {url}: {str(exc) or type(exc).__name__}") + f" · {_clock(time.time())}"
        )
    try:
        body = _body(answer)
    except PdserveError as exc:
        return _one_line(f"{url}: {exc}")
    if answer.status_code != 200:
        message = _message(body)
        return _one_line(f"{url} answered {answer.status_code}" + (f": {message}" if message else ""))
    if not isinstance(body, dict):
        return _one_line(f"{url}: GET /pools answered something that is not an object")
    return render_frame(body, url, time.time())


def _one_line(text: str) -> str:
    return " ".join(text.split())


def render_frame(body: dict[str, Any], url: str, now: float) -> str:
    """The watch view of a GET /pools answer. Pure; every key may be missing (an older server, the
    planner off): what is missing shows as `-`."""
    pools = _dict(body.get("pools"))
    planner = _dict(body.get("planner"))
    signals = _dict(body.get("signals"))
    slo = _dict(planner.get("slo"))
    plans = _dict(planner.get("pools"))
    measured = _dict(signals.get("pools"))
    percentile = _number(slo.get("percentile"))
    slo_key = f"p{round(percentile * 100)}" if percentile is not None else None

    header = [url, _clock(now), f"planner {planner.get('mode') or '-'}"]
    if planner:
        targets = [
            f"{name} {_ms(slo.get(f'{name}_s'))} ms"
            for name in ("ttft", "itl")
            if _number(slo.get(f"{name}_s")) is not None
        ]
        header.append(
            f"SLO {slo_key or '-'} {', '.join(targets)} ({BREACH} above it)" if targets else "SLO -"
        )
        header.append(f"budget {_cell(planner.get('max_workers'))} workers")
    if signals.get("window_s") is not None:
        header.append(f"signals over {_number_text(signals.get('window_s'))} s")
    lines = [" · ".join(header), ""]

    names = list(dict.fromkeys([*pools, *plans, *measured]))  # the pools the manager has first
    rows = [
        [
            "pool",
            "up/target (min..max)",
            "desired",
            "ttft p50/90/99 ms",
            "itl p50/90/99 ms",
            "kv used",
            "prompt tok/s",
            "streams",
            "pred/obs ms",
        ]
    ]
    reasons = []
    for name in names:
        pool, plan, seen = _dict(pools.get(name)), _dict(plans.get(name)), _dict(measured.get(name))
        workers = pool.get("workers") if isinstance(pool.get("workers"), list) else None
        up = "-" if workers is None else str(sum(_dict(w).get("state") == "up" for w in workers))
        size = f"{up}/{_cell(pool.get('target'))} ({_cell(pool.get('min'))}..{_cell(pool.get('max'))})"
        latency = [
            _quantiles(_dict(seen.get(f"{metric}_s")), slo_key, _number(slo.get(f"{metric}_s")))
            for metric in ("ttft", "itl")
        ]
        kv = _number(seen.get("kv_used"))
        rate = _number(seen.get("prompt_tokens_per_s"))
        rows.append(
            [
                name,
                size,
                _cell(plan.get("desired")) + (" stale" if plan.get("stale") else ""),
                *latency,
                "-" if kv is None else f"{kv * 100:.0f}%",
                "-" if rate is None else f"{rate:.0f}",
                _cell(seen.get("streams")),
                _predicted_observed(plan, slo),
            ]
        )
        if plan.get("reason"):
            reasons.append(f"  {name} wants {_cell(plan.get('desired'))}: {_one_line(str(plan['reason']))}")
    lines += _grid(rows).splitlines() if names else ["  (no pools)"]
    lines += reasons

    for name in names:
        if isinstance(pools.get(name), dict):
            lines += ["", *describe_pool(pools[name]).splitlines()]

    lines += ["", _paths(_dict(signals.get("paths")) if "paths" in signals else None)]
    lines += ["", *_decisions(planner.get("decisions") if planner else None)]
    return "\n".join(lines)


def _quantiles(values: dict[str, Any], slo_key: str | None, slo: float | None) -> str:
    cells = []
    for key in QUANTILES:
        value = _number(values.get(key))
        breach = value is not None and slo is not None and key == slo_key and value > slo
        cells.append(_ms(value) + (BREACH if breach else ""))
    return "/".join(cells)


def _predicted_observed(plan: dict[str, Any], slo: dict[str, Any]) -> str:
    predicted, observed = _dict(plan.get("predicted")), _dict(plan.get("observed"))
    parts = []
    for metric in ("ttft", "itl"):
        key = f"{metric}_s"
        guess, seen, target = _number(predicted.get(key)), _number(observed.get(key)), _number(slo.get(key))
        if guess is None and seen is None:
            continue
        breach = seen is not None and target is not None and seen > target
        parts.append(f"{metric} {_ms(guess)}/{_ms(seen)}{BREACH if breach else ''}")
    return ", ".join(parts) or "-"


def _paths(paths: dict[str, Any] | None) -> str:
    if paths is None:
        return "paths: -"
    remote, local = _number(paths.get("remote")), _number(paths.get("local"))
    share = "-"
    if remote is not None and local is not None and remote + local > 0:
        share = f"{local / (remote + local) * 100:.0f}%"
    return f"paths: remote {_number_text(remote)}, local {_number_text(local)} (local share {share})"


def _decisions(decisions: Any) -> list[str]:
    if not isinstance(decisions, list):
        return ["planner decisions: -"]
    if not decisions:
        return ["planner decisions: none yet"]
    entries = [_dict(d) for d in decisions]
    # newest first, whatever order the server keeps them in (a decision without a time: oldest)
    entries.sort(key=lambda d: _number(d.get("at")) or 0.0, reverse=True)
    rows = [
        [
            "-" if _number(d.get("at")) is None else _clock(d["at"]),
            _cell(d.get("pool")),
            f"{_cell(d.get('from'))}→{_cell(d.get('to'))}",
            _cell(d.get("reason")),
            _one_line(_cell(d.get("detail"))),
        ]
        for d in entries[:DECISIONS_SHOWN]
    ]
    shown = f"last {len(rows)} of {len(entries)}" if len(entries) > len(rows) else f"{len(rows)}"
    return [
        f"planner decisions ({shown}, newest first):",
        *_grid([["at", "pool", "size", "why", "detail"], *rows]).splitlines(),
    ]


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _number(value: Any) -> float | None:
    """A finite JSON number, or None (missing, null, a string, a bool, NaN)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _number_text(value: Any) -> str:
    number = _number(value)
    if number is None:
        return "-"
    return str(int(number)) if number == int(number) else f"{number:g}"


def _ms(seconds: Any) -> str:
    value = _number(seconds)
    if value is None:
        return "-"
    ms = value * 1000
    return f"{ms:.0f}" if ms >= 10 else f"{ms:.1f}"


def _cell(value: Any) -> str:
    return "-" if value is None or value == "" else str(value)


def _clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))
