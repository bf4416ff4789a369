"""`pdserve profile --served`'s start probe: a real DPD server under load asked for a second prefill
worker, timed from asking to its being up."""

from __future__ import annotations

import asyncio
import http.server
import threading
from pathlib import Path

import httpx
import pytest

from pdserve.errors import PdserveError
from pdserve.measure import start
from pdserve.measure.server import free_port


def test_a_second_prefill_worker_is_timed_from_asked_to_up_while_the_server_serves(tiny_llama: Path) -> None:
    # Short prompts at 8 a second x3.5: the prefill worker has work when the start is asked for.
    workload = "chat: poisson(8) prompt=uniform(16,64) output=uniform(4,24)"
    seconds = start.start_beside_busy(str(tiny_llama), threads=1, workload=workload, probes=1, warm_s=0.5)
    # A worker process's start (its imports, the model, its KV cache) is never instant, and it came
    # up (the probe raises when it does not).
    assert 0.1 < seconds < start.START_TIMEOUT_S


def test_the_load_is_the_top_of_the_profiles_staircase() -> None:
    builtin = start.top_load(None, 1.0, 7)
    assert [c.arrival.rate for c in builtin.classes] == pytest.approx([2 * 3.5, 0.1 * 3.5])  # type: ignore[attr-defined]
    given = start.top_load("poisson(2) prompt=fixed(32) output=fixed(8)", 0.5, 7)
    assert given.classes[0].arrival.rate == pytest.approx(3.5)  # type: ignore[attr-defined]
    assert not builtin.steps and given.duration_s == start.LOAD_S
    with pytest.raises(PdserveError):
        start.top_load("poisson(2) prompt=nonsense", 1.0, 7)


def test_an_admin_route_that_fails_or_is_not_pdserves_is_said_plainly() -> None:
    class NotPdserve(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<html>not pdserve</html>" if self.path == "/pools" else b"{}"
            self.send_response(200 if self.path == "/pools" else 404)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), NotPdserve)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    closed = free_port()  # nothing listens there

    async def ask(url: str, path: str) -> str:
        async with httpx.AsyncClient(base_url=url, timeout=5.0) as client:
            with pytest.raises(PdserveError) as said:
                await start._admin(client, "GET", path)
            return str(said.value)

    try:
        url = f"http://127.0.0.1:{other.server_address[1]}"
        assert "answered something other than JSON" in asyncio.run(ask(url, "/pools"))
        assert "answered HTTP 404" in asyncio.run(ask(url, "/elsewhere"))
        assert "GET /pools failed: ConnectError" in asyncio.run(ask(f"http://127.0.0.1:{closed}", "/pools"))
    finally:
        other.shutdown()
        other.server_close()
