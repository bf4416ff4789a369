"""Keys on the router's routes: a real `pdserve serve` with API, admin and metrics keys from a file,
the environment and a flag, called as clients do (the official OpenAI client, plain HTTP, the
`pdserve pools` and `pdserve bench` command lines); and the middleware's rules on a small app."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
from serving import Server
from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from pdserve.router.auth import AccessKeys, AuthMiddleware, KeyRing, bearer_token, route_kind

API_KEY = "sk-test-api-0123456789abcdef"
SECOND_API_KEY = "sk-test-api-second-0123456789"
ADMIN_KEY = "admin-0123456789abcdef0123"
METRICS_KEY = "metrics-0123456789abcdef"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_a_key_ring_accepts_exactly_its_keys() -> None:
    ring = KeyRing([API_KEY, SECOND_API_KEY])
    assert ring.accepts(API_KEY.encode()) and ring.accepts(SECOND_API_KEY.encode())
    for wrong in (API_KEY[:-1], API_KEY + "x", "", API_KEY.upper()):
        assert not ring.accepts(wrong.encode()), wrong
    assert not ring.accepts(None)
    assert not KeyRing([]).accepts(API_KEY.encode())


def test_routes_and_the_bearer_header() -> None:
    kinds = {p: route_kind(p) for p in ("/health", "/metrics", "/pools", "/pools/decode", "/workers/x/drain")}
    assert kinds == {
        "/health": "open",
        "/metrics": "metrics",
        "/pools": "admin",
        "/pools/decode": "admin",
        "/workers/x/drain": "admin",
    }
    assert route_kind("/v1/completions") == route_kind("/poolside") == route_kind("/nope") == "api"
    assert bearer_token({"headers": [(b"authorization", b"Bearer  k1 ")]}) == b"k1"
    assert bearer_token({"headers": [(b"authorization", b"bearer k1")]}) == b"k1"
    assert bearer_token({"headers": [(b"authorization", b"Basic azE=")]}) is None
    assert bearer_token({"headers": [(b"authorization", b"Bearer ")]}) is None
    assert bearer_token({"headers": []}) is None


def small_app(keys: AccessKeys, refused: list[str]) -> TestClient:
    async def ok(_request: object) -> PlainTextResponse:
        return PlainTextResponse("ok")

    routes = [Route(p, ok) for p in ("/health", "/metrics", "/pools", "/v1/models")]
    app = Starlette(
        routes=routes, middleware=[Middleware(AuthMiddleware, keys=keys, on_refused=refused.append)]
    )
    return TestClient(app)


def test_api_keys_without_an_admin_key_close_the_admin_api() -> None:
    refused: list[str] = []
    client = small_app(AccessKeys(api=(API_KEY,)), refused)
    assert client.get("/health").status_code == 200
    assert client.get("/metrics").status_code == 200  # open: no metrics key
    assert client.get("/v1/models", headers=bearer(API_KEY)).status_code == 200
    closed = client.get("/pools", headers=bearer(API_KEY))
    assert closed.status_code == 401 and "admin API is closed" in closed.json()["error"]["message"]
    assert refused == ["admin"]


def test_no_key_at_all_leaves_every_route_open() -> None:
    client = small_app(AccessKeys(), [])
    assert [client.get(p).status_code for p in ("/health", "/metrics", "/pools", "/v1/models")] == [200] * 4


def test_a_server_with_keys_refuses_callers_without_them(tiny_llama: Path, tmp_path: Path) -> None:
    key_file = tmp_path / "api-keys"
    key_file.write_text(f"# the API keys\n{API_KEY}\n\n{SECOND_API_KEY}\n")
    key_file.chmod(0o600)
    server = Server(
        tiny_llama,
        "--prefill", "1", "--decode", "1",
        "--api-key-file", str(key_file),
        "--metrics-key", METRICS_KEY,
        env={"PDSERVE_ADMIN_KEY": ADMIN_KEY},
        api_key=API_KEY,
        admin_key=ADMIN_KEY,
    )  # fmt: skip
    try:
        plain = httpx.Client(base_url=server.url, timeout=30.0)
        assert plain.get("/health").status_code == 200  # a probe needs no key
        # The official client: no key or a wrong one is an AuthenticationError with OpenAI's body.
        for key in ("wrong-key", API_KEY + "x", ADMIN_KEY):
            stranger = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as refused:
                stranger.completions.create(model=server.model, prompt="hi", max_tokens=2)
            assert refused.value.code == "invalid_api_key"
        answer = plain.post("/v1/completions", json={"model": server.model, "prompt": "hi", "max_tokens": 2})
        assert answer.status_code == 401 and answer.headers["www-authenticate"].startswith("Bearer")
        assert "Authorization: Bearer" in answer.json()["error"]["message"]
        assert plain.get("/no-such-route").status_code == 401  # no route list for strangers
        # Both API keys work, on both endpoints.
        reply = server.client.completions.create(
            model=server.model, prompt="hi", max_tokens=3, extra_body={"ignore_eos": True}
        )
        assert reply.choices[0].finish_reason == "length"
        second = openai.OpenAI(base_url=f"{server.url}/v1", api_key=SECOND_API_KEY, max_retries=0)
        assert second.models.list().data[0].id == server.model
        # The admin API takes the admin key only; an API key does not scale a pool.
        assert plain.get("/pools", headers=bearer(API_KEY)).status_code == 401
        assert plain.put("/pools/decode", json={"replicas": 0}, headers=bearer(API_KEY)).status_code == 401
        assert server.pools()["decode"]["target"] == 1
        assert plain.get("/pools", headers=bearer(ADMIN_KEY)).status_code == 200
        # /metrics takes its own key; the refusals above are counted there.
        assert plain.get("/metrics", headers=bearer(API_KEY)).status_code == 401
        metrics = plain.get("/metrics", headers=bearer(METRICS_KEY))
        assert metrics.status_code == 200
        counted = {
            line.split('"')[1]: float(line.split()[-1])
            for line in metrics.text.splitlines()
            if line.startswith("pdserve_auth_failures_total{")
        }
        assert counted == {"api": 5.0, "admin": 2.0, "metrics": 1.0}
        # `pdserve pools` takes the admin key from the environment, or fails with the server's reason.
        pools = [sys.executable, "-m", "pdserve.cli", "pools", "--url", server.url, "--json"]
        shown = subprocess.run(
            pools, env={**_env(), "PDSERVE_ADMIN_KEY": ADMIN_KEY}, capture_output=True, text=True
        )
        assert shown.returncode == 0 and set(json.loads(shown.stdout)["pools"]) == {"prefill", "decode"}
        refused_cli = subprocess.run(
            [*pools, "--admin-key", API_KEY], env=_env(), capture_output=True, text=True
        )
        assert refused_cli.returncode != 0 and "incorrect admin key" in refused_cli.stderr
        # The OpenAPI document (an API route itself) says which routes take a key here.
        assert plain.get("/openapi.json").status_code == 401
        paths = plain.get("/openapi.json", headers=bearer(API_KEY)).json()["paths"]
        keyed = {path for path, ops in paths.items() if all(op.get("security") for op in ops.values())}
        assert keyed == set(paths) - {"/health"}  # /metrics has its key here too
    finally:
        assert server.stop() == 0


def test_bad_key_settings_stop_the_server_before_it_starts(tiny_llama: Path, tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.write_text("# nothing here\n")
    serve = [sys.executable, "-m", "pdserve.cli", "serve", "--model", str(tiny_llama), "--colocated", "1"]
    cases = [
        (["--api-key-file", str(empty)], {}, "holds no key"),
        (["--api-key-file", str(tmp_path / "missing")], {}, "cannot read the api key file"),
        (["--api-key", "has space"], {}, "printable ASCII"),
        (["--api-key", ADMIN_KEY], {"PDSERVE_ADMIN_KEY": ADMIN_KEY}, "must not also be an API"),
    ]
    for argv, env, fragment in cases:
        done = subprocess.run(
            [*serve, *argv], env={**_env(), **env}, capture_output=True, text=True, timeout=60
        )
        assert done.returncode != 0 and fragment in done.stderr, (argv, done.stderr[-500:])


def _env() -> dict[str, str]:
    """This environment without any PDSERVE_ key variable of the caller's."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
