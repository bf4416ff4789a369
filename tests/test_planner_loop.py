"""The planner beside a real router: SmolLM2 served by real `pdserve serve` processes, a
prefill-heavy step, a decode-heavy step and idle, with the planner sizing the pools as it goes.

Started with 1 prefill + 1 decode worker and a budget of 3: long prompts must add a prefill worker
(and not a decode one), many streams must bring a decode worker (moved from the prefill pool once
that is idle, the budget being full), and idle must bring both back to their minimum. Every request
completes. Short intervals and windows keep it to a couple of minutes; the law itself is tested
against scripted signals in test_planner_law.py.
"""

from __future__ import annotations

import asyncio
import random
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from serving import Server

WORDS = [
    "the",
    "quick",
    "brown",
    "fox",
    "jumps",
    "over",
    "a",
    "lazy",
    "dog",
    "while",
    "it",
    "rains",
    "in",
    "the",
]


@pytest.fixture(scope="module")
def smollm2() -> str:
    pytest.importorskip("tokenizers")
    return "smollm2-135m"


def text(words: int, rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


async def send(url: str, prompts: list[tuple[str, int]], gap_s: float, concurrency: int) -> list[int]:
    """POST each (prompt, max_tokens) `gap_s` apart, at most `concurrency` at once; their statuses."""
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=300.0) as client:

        async def one(prompt: str, max_tokens: int) -> int:
            async with limit:
                body = {
                    "model": "smollm2-135m",
                    "prompt": prompt,
                    "max_tokens": max_tokens,
                    "ignore_eos": True,
                }
                return (await client.post("/v1/completions", json=body)).status_code

        tasks = []
        for prompt, max_tokens in prompts:
            tasks.append(asyncio.create_task(one(prompt, max_tokens)))
            await asyncio.sleep(gap_s)
        return list(await asyncio.gather(*tasks))


def targets(server: Server) -> dict[str, int]:
    return {name: pool["target"] for name, pool in server.pools().items()}


def decisions(server: Server) -> list[dict[str, Any]]:
    """Oldest first."""
    return list(reversed(server.admin_view()["planner"]["decisions"]))


def test_the_planner_follows_a_prefill_step_a_decode_step_and_idle(smollm2: str, tmp_path: Path) -> None:
    config = tmp_path / "pdserve.toml"
    # Few sequences per decode worker: 20 streams are then plainly more than one worker's share.
    config.write_text("[pools.decode]\nmax_num_seqs = 8\n")
    server = Server(
        smollm2,
        "--prefill", "1", "--decode", "1", "--max-workers", "3", "--planner", "slo",
        "--slo", "ttft=2000,itl=2000", "--planner-interval", "1", "--planner-cooldown", "2",
        "--planner-downscale-window", "6", "--num-kv-blocks", "512", "--config", str(config),
        "--log-level", "INFO",
    )  # fmt: skip
    rng = random.Random(0)
    try:
        time.sleep(6)  # past the workers' cold start: their steps now enter the cost model
        # 1. Prefill-heavy: long prompts (~800 tokens, 4 s each here) faster than one worker takes them.
        long_prompts = [(text(800, rng), 2) for _ in range(8)]
        statuses = asyncio.run(send(server.url, long_prompts, gap_s=2.0, concurrency=10))
        assert statuses == [200] * len(long_prompts)
        ups = [d for d in decisions(server) if d["direction"] == "up"]
        assert any(d["pool"] == "prefill" for d in ups), decisions(server)
        assert not any(d["pool"] == "decode" for d in ups), decisions(server)
        assert targets(server)["prefill"] == 2 and targets(server)["decode"] == 1
        # Each prefill worker's throughput, measured from its steps (prompt tokens per second).
        rates = [w["prefill_tokens_per_s"] for w in server.workers("prefill", "up")]
        assert any(r is not None and r > 10 for r in rates), rates

        # 2. Decode-heavy: many streams of short prompts. The budget is full: a worker moves.
        streams = [(text(10, rng), 48) for _ in range(24)]
        statuses = asyncio.run(send(server.url, streams, gap_s=0.1, concurrency=24))
        assert statuses == [200] * len(streams)
        decode_ups = [d for d in decisions(server) if d["pool"] == "decode" and d["direction"] == "up"]
        assert decode_ups, decisions(server)
        assert decode_ups[-1]["reason"] in ("move", "predictive", "reactive")
        # By now the cost model has the workers' steps: it chose the paths.
        assert server.metric("pdserve_path_choices_total", reason="cost_model") > 0

        # 3. Idle: back to the minimum, through drains that lose nothing.
        server.wait_for(lambda: targets(server) == {"prefill": 1, "decode": 1}, 90, "both pools at 1")
        server.wait_pool("prefill", 60, up=1, draining=0, starting=0)
        server.wait_pool("decode", 60, up=1, draining=0, starting=0)
        assert server.metric("pdserve_requests_total", outcome="error") == 0
        assert server.metric("pdserve_planner_decisions_total", pool="prefill", direction="down") >= 1
        server.wait_kv_free()
    finally:
        assert server.stop() == 0
