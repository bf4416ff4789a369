"""`pdserve pools` against a real server, run as a user runs it: what it prints, its exit codes."""

from __future__ import annotations

import copy
import itertools
import json
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from serving import Server, free_port

from pdserve.pools.cli import render_frame


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

        watched = pools(*url, "--watch", "--frames", "2", "--interval", "0.2")
        assert watched.returncode == 0 and watched.stderr == "", watched.stderr
        frames = watched.stdout.split(f"\n\n{server.url} · ")  # piped: a blank line between frames
        assert len(frames) == 2 and frames[0].startswith(f"{server.url} · ")
        for shown in frames:
            assert "\x1b[" not in shown  # no terminal codes when stdout is not a terminal
            assert "pool decode: 1 up, target 1 (min 1, max 2)" in shown
            assert any(line.split()[:2] == ["decode", "1/1"] for line in shown.splitlines())
            assert any(line.split()[:2] == ["decode-1", "up"] for line in shown.splitlines())
            assert "paths: " in shown and "planner decisions" in shown
    finally:
        assert server.stop() == 0
    gone = pools("--url", server.url, "--timeout", "2")
    assert gone.returncode == 2 and "cannot reach" in gone.stderr and "Traceback" not in gone.stderr


# -- `pdserve pools --watch` ------------------------------------------------------------------------
URL = "http://127.0.0.1:8000"
NOW = 1764590500.0


def worker(pool: str, i: int, state: str = "up") -> dict[str, Any]:
    return {
        "id": f"{pool}-{i}", "pool": pool, "state": state, "detail": "", "streams": 0, "running": 0,
        "waiting": 0, "kv_blocks_used": 0, "kv_blocks_free": 100, "queued_prompt_tokens": 0,
        "held_leases": 0, "rpc_address": f"tcp://127.0.0.1:{5000 + i}",
    }  # fmt: skip


OLD_SERVER = {  # GET /pools before the planner and the signals
    "pools": {
        "prefill": {
            "pool": "prefill", "target": 2, "min": 1, "max": 2, "last_error": None,
            "workers": [worker("prefill", 0), worker("prefill", 1, "starting")],
        },
        "decode": {
            "pool": "decode", "target": 1, "min": 1, "max": 2, "last_error": "decode-9 exited with 1",
            "workers": [worker("decode", 0)],
        },
    }
}  # fmt: skip

DECISIONS = [  # oldest first, as a server may keep them
    {"at": NOW - 600 + 60 * i, "pool": "prefill", "from": i, "to": i + 1, "direction": "up",
     "reason": "predictive", "detail": f"step {i}"}
    for i in range(7)
]  # fmt: skip

FULL = {
    **OLD_SERVER,
    "planner": {
        "mode": "slo", "interval_s": 5.0, "max_workers": 3,
        "slo": {"ttft_s": 1.0, "itl_s": 0.1, "percentile": 0.9},
        "pools": {
            "prefill": {"desired": 2, "predicted": {"ttft_s": 0.8, "itl_s": None},
                        "observed": {"ttft_s": 1.2, "itl_s": None}, "reason": "predictive: 850 tok/s",
                        "stale": False},
            "decode": {"desired": 1, "predicted": {"ttft_s": None, "itl_s": 0.05},
                       "observed": {"ttft_s": None, "itl_s": 0.04}, "reason": "", "stale": True},
        },
        "decisions": DECISIONS,
    },
    "signals": {
        "window_s": 30.0,
        "pools": {
            "prefill": {"ttft_s": {"p50": 0.1, "p90": 1.3, "p99": 1.5}, "itl_s": None, "kv_used": 0.12,
                        "prompt_tokens_per_s": 850.0, "streams": 3},
            "decode": {"ttft_s": None, "itl_s": {"p50": 0.004, "p90": 0.05, "p99": 0.2}, "kv_used": None,
                       "prompt_tokens_per_s": 0.0, "streams": 2},
        },
        "paths": {"remote": 120, "local": 30},
    },
}  # fmt: skip


def pool_rows(text: str) -> dict[str, dict[str, str]]:
    """The pool table of a frame as a user reads it: per pool, its cells under their titles."""
    lines = text.splitlines()
    head = next(line for line in lines if line.split()[:1] == ["pool"])
    titles = re.split(r"\s{2,}", head.strip())
    starts = [head.index(t) for t in titles] + [None]
    rows = {}
    for line in lines[lines.index(head) + 1 :]:
        if not line.strip() or not line.startswith("  ") or line.startswith("   "):
            break
        cells = [line[a:b].strip() for a, b in itertools.pairwise(starts)]
        if cells[0] in FULL["pools"]:
            rows[cells[0]] = dict(zip(titles, cells, strict=True))
    return rows


def clock(at: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(at))


def test_a_frame_shows_the_pools_the_planner_and_the_signals() -> None:
    text = render_frame(copy.deepcopy(FULL), URL, NOW)
    lines = text.splitlines()
    assert lines[0].startswith(f"{URL} · {clock(NOW)} · planner slo · SLO p90 ttft 1000 ms, itl 100 ms")
    assert "budget 3 workers" in lines[0] and "signals over 30 s" in lines[0]

    rows = pool_rows(text)
    prefill, decode = rows["prefill"], rows["decode"]
    assert prefill["up/target (min..max)"] == "1/2 (1..2)" and decode["up/target (min..max)"] == "1/1 (1..2)"
    assert prefill["desired"] == "2" and decode["desired"] == "1 stale"
    assert prefill["ttft p50/90/99 ms"] == "100/1300!/1500"  # p90 is the SLO's: only it is marked
    assert decode["itl p50/90/99 ms"] == "4.0/50/200"  # p90 within 100 ms: no mark, p99 not the SLO's
    assert prefill["itl p50/90/99 ms"] == "-/-/-" and decode["ttft p50/90/99 ms"] == "-/-/-"
    assert prefill["kv used"] == "12%" and decode["kv used"] == "-"
    assert prefill["prompt tok/s"] == "850" and decode["prompt tok/s"] == "0"
    assert prefill["streams"] == "3" and decode["streams"] == "2"
    assert prefill["pred/obs ms"] == "ttft 800/1200!" and decode["pred/obs ms"] == "itl 50/40"
    assert "  prefill wants 2: predictive: 850 tok/s" in lines

    assert "pool decode: 1 up, target 1 (min 1, max 2)" in lines  # the workers, as `pdserve pools`
    assert "  last error: decode-9 exited with 1" in lines
    assert any(line.split()[:2] == ["prefill-1", "starting"] for line in lines)
    assert "paths: remote 120, local 30 (local share 20%)" in lines

    at = lines.index("planner decisions (last 5 of 7, newest first):")
    shown = [line.split() for line in lines[at + 2 :]]
    assert lines[at + 1].split() == ["at", "pool", "size", "why", "detail"]
    assert shown == [
        [clock(d["at"]), "prefill", f"{d['from']}→{d['to']}", "predictive", "step", str(d["from"])]
        for d in reversed(DECISIONS[2:])
    ]


def test_a_frame_from_an_older_server_or_with_the_planner_off() -> None:
    text = render_frame(copy.deepcopy(OLD_SERVER), URL, NOW)
    lines = text.splitlines()
    assert lines[0] == f"{URL} · {clock(NOW)} · planner -"
    for row in pool_rows(text).values():
        assert row["desired"] == row["kv used"] == row["streams"] == row["pred/obs ms"] == "-"
        assert row["ttft p50/90/99 ms"] == row["itl p50/90/99 ms"] == "-/-/-"
    assert pool_rows(text)["prefill"]["up/target (min..max)"] == "1/2 (1..2)"
    assert any(line.split()[:2] == ["decode-0", "up"] for line in lines)
    assert lines[-3:] == ["paths: -", "", "planner decisions: -"]

    off = copy.deepcopy(FULL)
    off["planner"] = {
        "mode": "off",
        "slo": {"ttft_s": None, "itl_s": 0.1, "percentile": 0.99},
        "decisions": [],
    }
    off["signals"]["paths"] = {"remote": 0, "local": 0}
    text = render_frame(off, URL, NOW)
    assert "planner off · SLO p99 itl 100 ms" in text.splitlines()[0]
    rows = pool_rows(text)
    assert rows["prefill"]["desired"] == "-" and rows["prefill"]["ttft p50/90/99 ms"] == "100/1300/1500"
    assert rows["decode"]["itl p50/90/99 ms"] == "4.0/50/200!"  # now the SLO is on p99
    assert "paths: remote 0, local 0 (local share -)" in text and text.endswith("planner decisions: none yet")


def test_watch_keeps_trying_a_server_it_cannot_reach() -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    watched = pools("--url", url, "--watch", "--frames", "2", "--interval", "0.1", "--timeout", "2")
    assert watched.returncode == 0 and "Traceback" not in watched.stderr, watched.stderr
    frames = watched.stdout.split("\n\n")
    assert len(frames) == 2 and frames[-1].endswith("\n")
    for shown in frames:
        assert shown.startswith(f"cannot reach {url}: ") and len(shown.strip().splitlines()) == 1

    for args, message in [
        (("--frames", "2"), "--interval and --frames go with --watch"),
        (("--watch", "scale", "decode", "2"), "it does not go with `scale`"),
        (("--watch", "--interval", "0"), "must be above 0"),
    ]:
        refused = pools("--url", url, *args)
        assert refused.returncode == 2 and message in refused.stderr and refused.stdout == ""


def test_watch_on_a_terminal_redraws_in_place_until_ctrl_c() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pdserve.cli", "pools", "--url", url, "--watch", "--interval", "0.1"],
        stdin=follower, stdout=follower, stderr=follower, close_fds=True,
    )  # fmt: skip
    os.close(follower)
    seen = b""

    def read(wait: float) -> bool:
        nonlocal seen
        if not select.select([leader], [], [], wait)[0]:
            return False
        try:
            seen += os.read(leader, 4096)
        except OSError:  # the terminal has closed with the process
            return False
        return True

    try:
        deadline = time.monotonic() + 30
        while seen.count(b"cannot reach") < 2 and time.monotonic() < deadline and proc.poll() is None:
            read(1)
        proc.send_signal(signal.SIGINT)  # Ctrl-C
        assert proc.wait(timeout=10) == 0, seen.decode()
        while read(0.2):
            pass
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(leader)
    text = seen.decode()
    assert text.count("\x1b[H") >= 2 and "\x1b[J" in text  # home, the frame, clear the rest
    assert f"cannot reach {url}: " in text and "Traceback" not in text
