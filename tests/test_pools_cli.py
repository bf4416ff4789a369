"""`pdserve pools` against a real server, run as a user runs it: what it prints, its exit codes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from serving import Server


def pools(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "pools", *args], capture_output=True, text=True, timeout=60
    )


def test_show_scale_drain_and_rebalance_from_a_terminal(tiny_llama: Path) -> None:
    server = Server(tiny_llama, "--prefill", "1", "--decode", "1", "--decode-max", "2")
    url = ("--url", server.url)
    try:
        shown = pools(*url)
        assert shown.returncode == 0, shown.stderr
        assert "pool decode: 1 up, target 1 (min 1, max 2)" in shown.stdout
        assert any(line.split()[:2] == ["decode-0", "up"] for line in shown.stdout.splitlines())

        scaled = pools(*url, "scale", "decode", "2")
        assert scaled.returncode == 0 and "target 2 (min 1, max 2)" in scaled.stdout
        server.wait_pool("decode", up=2, starting=0)
        as_json = json.loads(pools(*url, "--json").stdout)
        assert [w["state"] for w in as_json["pools"]["decode"]["workers"]] == ["up", "up"]

        moved = pools(*url, "rebalance")
        assert moved.returncode == 0 and moved.stdout.strip() == "pool decode: nothing to move"
        drained = pools(*url, "drain", "decode-0")
        assert drained.returncode == 0 and drained.stdout.startswith("decode-0: draining")
        server.wait_pool("decode", up=1, draining=0)

        for args, message in [
            (("scale", "decode", "3"), "pool decode: replicas 3 is above its max 2"),
            (("drain", "decode-1"), "below its min 1"),
            (("drain", "nope"), "unknown worker 'nope'"),
            (("rebalance", "prefill"), "holds no streams"),
        ]:
            refused = pools(*url, *args)
            assert refused.returncode == 2 and refused.stdout == ""
            assert refused.stderr.startswith("pdserve: error: ") and message in refused.stderr
            assert len(refused.stderr.strip().splitlines()) == 1
    finally:
        assert server.stop() == 0
    gone = pools("--url", server.url, "--timeout", "2")
    assert gone.returncode == 2 and "cannot reach" in gone.stderr and "Traceback" not in gone.stderr
