"""Chaos under load: a real `pdserve serve` (1 prefill + 2 decode workers) serving greedy streams
while workers are killed (SIGKILL) and frozen (SIGSTOP, then SIGCONT), KV transfers fail on
purpose (--kv-fault-rate) or land with a bit flipped (--kv-corrupt-rate: the KV checksum turns
each into a counted, retried failure), and clients disconnect at random points. Bounded in time and requests,
on 127.0.0.1 only; it stops by itself.

    .venv/bin/python benchmarks/chaos.py --model smollm2-135m --duration 300 --clients 64   # soak
    .venv/bin/python benchmarks/chaos.py --model PATH --duration 30 --clients 16            # CI

Afterwards it checks, and exits 1 (with the reasons) unless every one holds:
- no hung request: every request ended (completed, refused, or ended with an error) within the
  run's deadline;
- no wrong token: the text of every completed stream is the offline engine's greedy text for its
  prompt, and the text of every stream that ended early is a prefix of it;
- no leaked KV block (every worker reports 0 blocks in use), process or shared-memory segment
  (after the server stops);
- every failure counted: the router's retries, KV transfer failures and KV checksum failures are
  in its metrics.
Prints a JSON summary on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test helper that starts and checks a server
from serving import Server  # noqa: E402

PROMPT_WORDS = ["the", "sea", "was", "calm", "and", "ships", "came", "home", "one", "by", "before", "storm"]


@dataclass
class Outcome:
    prompt: int
    max_tokens: int
    kind: str = "pending"  # completed | refused | error | disconnected | hung
    text: str = ""
    detail: str = ""


@dataclass
class Faults:
    kills: int = 0
    freezes: int = 0
    log: list[str] = field(default_factory=list)


def prompts(n: int, rng: random.Random) -> list[str]:
    return [" ".join(rng.choice(PROMPT_WORDS) for _ in range(rng.randint(4, 60))) for _ in range(n)]


async def one_stream(
    client: httpx.AsyncClient, model: str, prompt: str, out: Outcome, cut_after: int | None
) -> None:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": out.max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
    }
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                out.kind, out.detail = (
                    ("refused" if response.status_code in (429, 503) else "error"),
                    str(response.status_code),
                )
                if response.status_code >= 500 and response.status_code != 503:
                    out.detail = f"HTTP {response.status_code}: {(await response.aread())[:200]!r}"
                return
            chunks = 0
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    out.kind, out.detail = "error", event["error"]["message"][:200]
                    return
                out.text += event["choices"][0]["text"]
                chunks += 1
                if cut_after is not None and chunks >= cut_after:
                    out.kind = "disconnected"  # leaving the block closes the connection
                    return
            out.kind = "completed"
    except httpx.HTTPError as exc:
        out.kind, out.detail = "error", f"{type(exc).__name__}: {exc}"


async def load(
    server: Server, texts: list[str], args: argparse.Namespace, rng: random.Random
) -> list[Outcome]:
    outcomes: list[Outcome] = []
    deadline = time.monotonic() + args.duration
    limits = httpx.Limits(max_connections=None)
    async with httpx.AsyncClient(base_url=server.url, timeout=httpx.Timeout(60.0), limits=limits) as client:

        async def client_loop(seed: int) -> None:
            mine = random.Random(seed)
            while time.monotonic() < deadline and len(outcomes) < args.max_requests:
                index = mine.randrange(len(texts))
                out = Outcome(index, mine.randint(4, args.max_tokens))
                outcomes.append(out)
                cut = mine.randint(1, out.max_tokens) if mine.random() < args.disconnect_share else None
                try:
                    await asyncio.wait_for(
                        one_stream(client, server.model, texts[index], out, cut), args.request_timeout
                    )
                except TimeoutError:
                    out.kind, out.detail = "hung", f"no end within {args.request_timeout} s"

        await asyncio.gather(*(client_loop(rng.randrange(1 << 30)) for _ in range(args.clients)))
    return outcomes


async def chaos(server: Server, args: argparse.Namespace, rng: random.Random, faults: Faults) -> None:
    """A fault every --fault-interval seconds, until the load's end: a SIGKILL and a SIGSTOP by
    turns, each of a worker drawn at random (a prefill or a decode one)."""
    deadline = time.monotonic() + args.duration - 5  # the last seconds are quiet: streams finish
    kill = True
    while time.monotonic() + args.fault_interval < deadline:
        await asyncio.sleep(args.fault_interval)
        pids = server._worker_pids()
        if not pids:
            continue
        worker, pid = rng.choice(sorted(pids.items()))
        kill = not kill
        if not kill:  # the first fault is a kill
            os.kill(pid, signal.SIGKILL)
            faults.kills += 1
            faults.log.append(f"{time.strftime('%H:%M:%S')} SIGKILL {worker}")
        else:
            seconds = rng.uniform(1.0, 6.0)  # past the 3 s heartbeat timeout or not
            os.kill(pid, signal.SIGSTOP)
            faults.freezes += 1
            faults.log.append(f"{time.strftime('%H:%M:%S')} SIGSTOP {worker} for {seconds:.1f} s")
            await asyncio.sleep(seconds)
            with contextlib.suppress(ProcessLookupError):  # killed meanwhile by its own death
                os.kill(pid, signal.SIGCONT)


async def scenario(
    server: Server, texts: list[str], args: argparse.Namespace, faults: Faults
) -> list[Outcome]:
    rng = random.Random(args.seed)
    chaos_task = asyncio.ensure_future(chaos(server, args, rng, faults))
    try:
        return await load(server, texts, args, rng)
    finally:
        await chaos_task


def expected_texts(model: str, texts: list[str], max_tokens: int) -> list[str]:
    from pdserve import LLM, SamplingParams

    llm = LLM(model, dtype="float32")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].text for o in llm.generate(texts, params)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--duration", type=float, default=60.0, help="seconds of load (faults stop 5 s before)")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients, each one request at a time")
    p.add_argument("--max-requests", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument(
        "--prompts", type=int, default=24, help="distinct prompts (each checked against the offline engine)"
    )
    p.add_argument(
        "--disconnect-share", type=float, default=0.3, help="share of clients that leave mid-stream"
    )
    p.add_argument("--fault-interval", type=float, default=6.0)
    p.add_argument("--kv-fault-rate", type=float, default=0.05)
    p.add_argument("--kv-corrupt-rate", type=float, default=0.05)
    p.add_argument("--transport", default="shm")
    p.add_argument("--request-timeout", type=float, default=90.0, help="a request not over by then is hung")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    texts = prompts(args.prompts, random.Random(args.seed))
    expected = expected_texts(args.model, texts, args.max_tokens)
    server = Server(
        args.model,
        "--prefill", "1", "--decode", "2", "--transport", args.transport,
        "--kv-fault-rate", str(args.kv_fault_rate), "--kv-corrupt-rate", str(args.kv_corrupt_rate),
        "--kv-checksum", "on",  # also on a GPU cache, where auto leaves it off
        "--num-kv-blocks", "512",
        "--max-retries", "8", "--heartbeat-timeout", "3",
    )  # fmt: skip
    faults = Faults()
    problems: list[str] = []
    started = time.monotonic()
    try:
        outcomes = asyncio.run(scenario(server, texts, args, faults))
        for out in outcomes:
            want = expected[out.prompt]
            # A stream asked for fewer tokens than the reference: its text is a prefix of it.
            if out.kind == "hung":
                problems.append(f"hung: prompt {out.prompt}: {out.detail}")
            elif not want.startswith(out.text):
                problems.append(f"wrong tokens ({out.kind}): prompt {out.prompt}: {out.text!r} vs {want!r}")
            elif (
                out.kind == "error"
                and out.detail.startswith("HTTP 5")
                and not out.detail.startswith("HTTP 503")
            ):
                problems.append(f"a 5xx: {out.detail}")
        # Every worker back (dead ones are replaced), then every block free.
        server.wait_for(lambda: _pool_up(server), 120, "every pool back to its size")
        try:
            server.wait_kv_free(timeout=60)
        except TimeoutError as exc:
            problems.append(f"KV blocks still in use: {exc}")
        metrics = {
            "retries": _sum(server, "pdserve_request_retries_total"),
            "kv_transfer_failures": _sum(server, "pdserve_kv_transfer_failures_total"),
            "kv_checksum_failures": _sum(server, "pdserve_kv_checksum_failures_total"),
            "requests_error": server.metric("pdserve_requests_total", outcome="error"),
            "requests_aborted": server.metric("pdserve_requests_total", outcome="aborted"),
        }
    finally:
        try:
            code = server.stop()  # asserts: no worker process, no segment left
            if code != 0:
                problems.append(f"pdserve serve exited with {code}")
        except AssertionError as exc:
            problems.append(str(exc))
    kinds: dict[str, int] = {}
    for out in outcomes:
        kinds[out.kind] = kinds.get(out.kind, 0) + 1
    summary: dict[str, Any] = {
        "seconds": round(time.monotonic() - started, 1),
        "requests": len(outcomes),
        "outcomes": kinds,
        "faults": {"sigkill": faults.kills, "sigstop": faults.freezes, "log": faults.log},
        "metrics": metrics,
        "problems": problems,
    }
    print(json.dumps(summary, indent=2))
    return 1 if problems else 0


def _pool_up(server: Server) -> bool:
    pools = server.pools()
    return all(sum(w["state"] == "up" for w in p["workers"]) == p["target"] for p in pools.values())


def _sum(server: Server, name: str) -> float:
    total = 0.0
    for line in server.metrics().splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


if __name__ == "__main__":
    sys.exit(main())
