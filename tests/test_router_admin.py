"""The admin API of a real server: what GET /pools shows, and bad admin input answered with a 400
that says what is wrong (never a 5xx, never a change)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serving import Server


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[Server]:
    srv = Server(tiny_llama, "--prefill", "1", "--decode", "1", "--decode-max", "3")
    try:
        yield srv
    finally:
        assert srv.stop() == 0


def test_get_pools_shows_each_pool_and_its_workers(server: Server) -> None:
    pools = server.pools()
    assert sorted(pools) == ["decode", "prefill"]
    decode = pools["decode"]
    assert (decode["target"], decode["min"], decode["max"], decode["last_error"]) == (1, 1, 3, None)
    [worker] = decode["workers"]
    assert worker["id"] == "decode-0" and worker["state"] == "up" and worker["pool"] == "decode"
    assert worker["rpc_address"].startswith("tcp://127.0.0.1:") and worker["pid"] > 0
    for key in (
        "running",
        "waiting",
        "kv_blocks_used",
        "kv_blocks_free",
        "queued_prompt_tokens",
        "held_leases",
    ):
        assert isinstance(worker[key], int), key
    assert pools["prefill"]["min"] == pools["prefill"]["max"] == 1  # bounds default to the start count


def message(answer: Any) -> str:
    assert answer.status_code == 400, answer.text
    body = answer.json()
    assert body["error"]["type"] == "invalid_request_error" and body["error"]["code"] == 400
    return str(body["error"]["message"])


@pytest.mark.parametrize(
    ("path", "body", "fragment"),
    [
        ("/pools/nope", {"replicas": 1}, "unknown pool 'nope'"),
        ("/pools/decode", {"replicas": 4}, "above its max 3"),
        ("/pools/decode", {"replicas": 0}, "below its min 1"),
        ("/pools/decode", {"replicas": -1}, "below its min 1"),
        ("/pools/decode", {"replicas": 2**70}, "above its max 3"),
        ("/pools/prefill", {"replicas": 2}, "above its max 1"),
        ("/pools/decode", {"replicas": 1.5}, "must be an integer"),
        ("/pools/decode", {"replicas": "2"}, "must be an integer"),
        ("/pools/decode", {"replicas": True}, "must be an integer"),
        ("/pools/decode", {"replicas": None}, "must be an integer"),
        ("/pools/decode", {}, "missing required field `replicas`"),
        ("/pools/decode", {"replicas": 2, "force": True}, "unknown field `force`"),
        ("/pools/decode", [2], "Expected `object`"),
    ],
)
def test_bad_scale_requests_get_a_400_naming_the_problem(
    server: Server, path: str, body: Any, fragment: str
) -> None:
    assert fragment in message(server.http.put(path, json=body))
    assert server.pools()["decode"]["target"] == 1  # nothing changed


def test_bodies_that_are_not_json_or_too_large_get_a_400(server: Server) -> None:
    assert "not JSON" in message(server.http.put("/pools/decode", content=b"{replicas: 2"))
    assert "not JSON" in message(server.http.put("/pools/decode", content=b""))
    too_large = server.http.put("/pools/decode", content=b" " * 10_000)
    assert too_large.status_code == 413, too_large.text
    assert "over this server's limit of 4096 bytes" in too_large.json()["error"]["message"]


def test_bad_drains_get_a_400_and_the_last_worker_needs_to_be_asked_for(server: Server) -> None:
    assert "unknown worker 'decode-9'" in message(server.http.post("/workers/decode-9/drain"))
    # decode-0 is the pool's only worker and its min is 1.
    assert "below its min 1" in message(server.http.post("/workers/decode-0/drain"))
    assert "below its min 1" in message(server.drain("decode-0", force=True))
    assert "unknown field `now`" in message(server.drain("prefill-0", now=True))
    assert "Expected `bool`" in message(server.http.post("/workers/prefill-0/drain", json={"force": 1}))
    assert "holds no streams" in message(server.http.post("/pools/prefill/rebalance"))
    assert "unknown pool 'nope'" in message(server.http.post("/pools/nope/rebalance"))
    answer = server.http.post("/pools/decode/rebalance")  # one worker: nothing to move
    assert answer.status_code == 200 and answer.json() == {"pool": "decode", "moved": {}}
    assert [w["state"] for p in server.pools().values() for w in p["workers"]] == ["up", "up"]
    reply = server.client.completions.create(
        model=server.model, prompt="still serving", max_tokens=3, extra_body={"ignore_eos": True}
    )
    assert reply.choices[0].finish_reason == "length"
