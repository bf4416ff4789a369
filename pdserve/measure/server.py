"""A real `pdserve serve` on this machine for the probes of `pdserve profile` (no torch here):
started on a free loopback port, waited for until /health answers, stopped with SIGTERM (SIGKILL
after a minute), its stderr kept in a file and quoted when it fails to start."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import IO

import httpx

from pdserve.errors import PdserveError

START_TIMEOUT_S = 300.0  # a first start may build the CPU kernels (about 20 s) and load the model
STOP_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class RunningServer:
    process: subprocess.Popen[bytes]
    url: str
    start_s: float  # from the command to /health answering


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running(model: str, flags: list[str], threads: int | None = None) -> Iterator[RunningServer]:
    """`pdserve serve --model MODEL FLAGS` on 127.0.0.1, ready; stopped on the way out."""
    port = free_port()
    command = [sys.executable, "-m", "pdserve.cli", "serve", "--model", model, *flags]
    command += ["--host", "127.0.0.1", "--port", str(port), "--log-level", "WARNING"]
    if threads is not None:
        command += ["--threads", str(threads)]
    with tempfile.TemporaryFile() as log:
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        try:
            url = f"http://127.0.0.1:{port}"
            _wait_ready(process, url, log)
            yield RunningServer(process, url, time.perf_counter() - started)
        finally:
            _stop(process)


def _wait_ready(process: subprocess.Popen[bytes], url: str, log: IO[bytes]) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                log.seek(0)
                err = log.read().decode(errors="replace")
                raise PdserveError(
                    f"pdserve serve exited with {process.returncode} while starting: {err[-2000:]}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{url}/health").status_code == 200:
                    return
            time.sleep(0.2)
    raise PdserveError(f"pdserve serve was not ready after {START_TIMEOUT_S:g} s")


def _stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.kill(process.pid, signal.SIGKILL)
            process.wait(timeout=30)
