"""GET /openapi.json, and the API fuzzed from it: schemathesis generates valid and invalid calls of
every route (fixed seed, bounded examples) against a real `pdserve serve`; none may answer a 5xx
or take more than a few seconds, and afterwards the server is alive and every KV block is free."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from serving import Server

from pdserve.router.openai_types import MAX_STOP_CHARS, MAX_STOP_STRINGS, REFUSED_FIELDS
from pdserve.router.openapi import build_openapi

SLOWEST_S = 10.0  # a tiny model, a 128-token context: every answer comes well within this
EXAMPLES = 40  # per route and per mode


@pytest.fixture(scope="module")
def server(tiny_llama: Path) -> Iterator[Server]:
    # A short context bounds what a generated max_tokens can ask for.
    srv = Server(tiny_llama, "--prefill", "1", "--decode", "1", "--max-model-len", "128")
    try:
        yield srv
    finally:
        assert srv.stop() == 0  # and no worker process, no segment left


def test_the_document_describes_every_route_and_offers_no_refused_field(server: Server) -> None:
    document = server.http.get("/openapi.json").json()
    assert document == build_openapi(server.model) and document["openapi"] == "3.1.0"
    assert set(document["paths"]) == {
        "/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics",
        "/pools", "/pools/{pool}", "/pools/{pool}/rebalance", "/workers/{worker}/drain",
    }  # fmt: skip
    body = document["components"]["schemas"]["CompletionRequest"]
    assert {"prompt", "max_tokens", "temperature", "stop"} <= set(body["properties"])
    assert not set(REFUSED_FIELDS) & set(body["properties"])
    assert "413" in document["paths"]["/v1/completions"]["post"]["responses"]
    assert not any(op.get("security") for ops in document["paths"].values() for op in ops.values())  # no keys
    # The bounds the server enforces are in the document.
    stop = body["properties"]["stop"]["anyOf"]
    assert stop[0]["maxLength"] == MAX_STOP_CHARS and stop[1]["maxItems"] == MAX_STOP_STRINGS
    assert body["properties"]["logprobs"]["anyOf"][0]["maximum"] == 20
    bias = body["properties"]["logit_bias"]["anyOf"][0]
    assert bias["additionalProperties"] == {"type": "number", "minimum": -100, "maximum": 100}
    # The document's examples are served as they are.
    for path in ("/v1/completions", "/v1/chat/completions"):
        example = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["example"]
        assert server.http.post(path, json=example).status_code == 200, path


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_fuzzed_calls_of_every_route_never_get_a_5xx_nor_hang(
    server: Server, mode: schemathesis.GenerationMode
) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    seen: dict[str, list[int]] = {}
    negative = mode is schemathesis.GenerationMode.NEGATIVE
    for result in schema.get_all_operations():
        operation = result.ok()
        label = f"{operation.method.upper()} {operation.path}"

        @settings(
            max_examples=EXAMPLES,
            derandomize=True,  # the same calls on every run
            database=None,
            deadline=None,
            phases=[Phase.explicit, Phase.generate],  # a failure is shown as found, not shrunk
            suppress_health_check=list(HealthCheck),
        )
        @given(case=operation.as_strategy(generation_mode=mode))
        def call(case: schemathesis.Case) -> None:
            started = time.monotonic()
            response = case.call(base_url=server.url, timeout=SLOWEST_S * 2)
            took = time.monotonic() - started
            seen.setdefault(label, []).append(response.status_code)  # noqa: B023 (run at once)
            assert response.status_code < 500, (case.as_curl_command(), response.text[:500])
            assert took < SLOWEST_S, (case.as_curl_command(), took)

        try:
            call()
        except Unsatisfiable:  # negative mode, where nothing in the call can be invalid (GET /health)
            assert negative, label
    assert len(seen) >= (4 if negative else 9), sorted(seen)
    assert {"POST /v1/completions", "POST /v1/chat/completions"} <= set(seen)
    if not negative:  # valid calls reach the engine and are served (which ones: the seed's choice)
        assert 200 in seen["POST /v1/completions"] + seen["POST /v1/chat/completions"], seen
    assert sum(len(codes) for codes in seen.values()) >= len(seen) * 5
    if negative:  # invalid input is refused, not served
        assert all(c >= 400 for label, codes in seen.items() if "completions" in label for c in codes)
    assert server.http.get("/health").status_code == 200
    server.wait_kv_free()
    assert server.pools()["decode"]["target"] == 1 and len(server.workers("decode", "up")) == 1
