"""scripts/demo.sh (the README's first command, after setup) stops as soon as the server it started
exits, saying so with the server's exit code and last error line, instead of polling /health for
its whole start timeout."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from serving import free_port

ROOT = Path(__file__).resolve().parent.parent


def test_the_demo_stops_at_once_when_the_server_exits() -> None:
    # A server that exits at start: a PDSERVE_CPU_ISA that names no level (refused before any worker).
    env = {**os.environ, "PDSERVE_CPU_ISA": "sse9", "PORT": str(free_port())}
    done = subprocess.run(
        # far less than the 300 s the demo gives a server that is still starting
        ["bash", str(ROOT / "scripts" / "demo.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr
    assert "pdserve serve exited with code 2 before it was ready" in done.stderr
    assert "its last error: pdserve: error: PDSERVE_CPU_ISA='sse9' is not a level" in done.stderr
