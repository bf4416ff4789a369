"""`pdserve pools`: the admin API from a terminal. No torch.

    pdserve pools [--url URL]                           each pool and its workers
    pdserve pools scale POOL N                          start or drain workers until POOL has N
    pdserve pools drain WORKER [--force] [--replace]    drain a worker, then stop it
    pdserve pools rebalance [POOL]                      move streams onto the idlest workers

What the server refuses (an unknown pool, replicas out of bounds, the last worker of a pool) is
printed as one `pdserve: error:` line with exit code 2.
"""

from __future__ import annotations

import argparse
import json
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


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the router (default: %(default)s)")
    p.add_argument("--json", action="store_true", help="print the server's JSON answer")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server")
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


def run(args: argparse.Namespace) -> int:
    try:
        with httpx.Client(base_url=args.url, timeout=args.timeout) as client:
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
        error = body.get("error", {}) if isinstance(body, dict) else {}
        raise PdserveError(error.get("message") or f"{args.url} answered {answer.status_code}")
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


def describe_pool(pool: dict[str, Any]) -> str:
    up = sum(w["state"] == "up" for w in pool["workers"])
    head = f"pool {pool['pool']}: {up} up, target {pool['target']} (min {pool['min']}, max {pool['max']})"
    if pool["last_error"]:
        head += f"\n  last error: {pool['last_error']}"
    return head + ("\n" + table(pool["workers"]) if pool["workers"] else "\n  (no workers)")


def table(workers: list[dict[str, Any]]) -> str:
    rows = [[title for title, _ in COLUMNS]]
    rows += [["-" if w.get(key) is None else str(w[key]) for _, key in COLUMNS] for w in workers]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join(
        "  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )
