"""`pdserve serve` as a user runs it: flags and config file, colocated and disaggregated, and what
it leaves behind when stopped (nothing: no process, no shared-memory segment)."""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from serving import Server, alive, children, free_port

from pdserve import devices, serve
from pdserve.errors import PdserveError
from pdserve.transfer.segments import leftover_segments

SERVE = [sys.executable, "-m", "pdserve.cli", "serve"]


def options(*argv: str, config: Path | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args([*argv, *(["--config", str(config)] if config else [])])
    return serve.resolve_options(args)


def test_a_log_level_is_taken_in_either_case() -> None:
    assert options("--model", "m", "--colocated", "1", "--log-level", "debug")["log_level"] == "DEBUG"


def test_the_command_line_wins_over_the_config_file_which_wins_over_defaults(tmp_path: Path) -> None:
    config = tmp_path / "pdserve.toml"
    config.write_text(
        'model = "m"\nprefill = 2\ndecode = 1\nport = 9000\nkv-pull-timeout = 3\npin_cpus = false\n'
    )
    o = options("--port", "9100", config=config)
    assert (o["model"], o["prefill"], o["decode"], o["port"]) == ("m", 2, 1, 9100)
    assert o["kv_pull_timeout"] == 3.0 and o["pin_cpus"] is False and o["transport"] == "shm"
    assert serve.pool_replicas(o) == {"prefill": 2, "decode": 1}
    prefill, decode = serve.worker_config(o, "prefill", "p"), serve.worker_config(o, "decode", "d")
    assert (prefill.role.value, decode.role.value) == ("prefill", "decode")
    assert prefill.kv_pull_timeout == decode.kv_pull_timeout == 3.0
    # On CPU the prefill pool's chunks are smaller than the decode pool's by default, or as asked;
    # a GPU's steps are larger (the engine resolves what is left unset by its device).
    assert (prefill.engine.chunk_size, decode.engine.chunk_size) == (None, None)
    assert (prefill.engine.step_budget("cpu"), decode.engine.step_budget("cpu")) == ((2048, 256), (2048, 512))
    assert prefill.engine.step_budget("cuda") == decode.engine.step_budget("cuda") == (8192, 2048)
    tuned = options("--prefill-chunk-size", "128", config=config)
    assert serve.worker_config(tuned, "prefill", "p").engine.chunk_size == 128
    small = options("--chunk-size", "64", config=config)
    assert serve.worker_config(small, "prefill", "p").engine.chunk_size == 64  # already smaller
    large = options("--chunk-size", "1024", config=config)
    assert serve.worker_config(large, "prefill", "p").engine.chunk_size == 256  # capped
    assert serve.worker_config(large, "decode", "d").engine.step_budget("cuda") == (8192, 1024)
    # Pool bounds default to the start counts; a pool may start empty if it may grow.
    assert serve.pool_bounds(o, "decode") == (1, 1)
    elastic = options("--prefill", "0", "--prefill-max", "2", "--decode-min", "0", config=config)
    assert [(s.name, s.replicas, s.min, s.max) for s in serve.pool_specs(elastic)] == [
        ("prefill", 0, 0, 2),
        ("decode", 1, 0, 1),
    ]


def test_each_pools_workers_get_their_gpus_and_a_transport_that_serves_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(devices, "cuda_gpu_count", lambda: 2)  # a host with two GPUs
    config = tmp_path / "pdserve.toml"
    config.write_text('model = "m"\nprefill = 2\ndecode = 1\n[pools.decode]\ngpus = [1]\n')
    o = options("--prefill-gpus", "0-1", config=config)
    assert (o["device_type"], o["transport"]) == ("cuda", "tcp")  # shm cannot share a GPU's cache
    workers = [serve.worker_config(o, "prefill", f"prefill-{n}") for n in range(3)]
    workers.append(serve.worker_config(o, "decode", "decode-0"))
    assert [(w.gpu, w.engine.device, w.transport, w.same_node_shm) for w in workers] == [
        (0, "cuda", "tcp", False),
        (1, "cuda", "tcp", False),
        (0, "cuda", "tcp", False),  # a third prefill worker (the planner's) shares GPU 0
        (1, "cuda", "tcp", False),
    ]
    cpu = tmp_path / "cpu.toml"
    cpu.write_text('model = "m"\ncolocated = 1\ndevice = "cpu"\n')
    o = options(config=cpu)
    assert (o["device_type"], o["transport"], serve.worker_config(o, "colocated", "colocated-0").gpu) == (
        "cpu",
        "shm",
        None,
    )
    # Both pools on one GPU, each held to its share of the multiprocessors (CUDA MPS).
    config.write_text(config.read_text() + "sm_share = 60\ngpu_memory_utilization = 0.55\n")  # [pools.decode]
    shared = options(
        "--prefill-gpus", "1", "--prefill-sm-share", "40", "--gpu-memory-utilization", "0.3", config=config
    )  # fmt: skip
    pair = [serve.worker_config(shared, p, f"{p}-0") for p in ("prefill", "decode")]
    assert [(w.gpu, w.sm_share, w.engine.gpu_memory_utilization) for w in pair] == [
        (1, 40, 0.3),
        (1, 60, 0.55),
    ]
    with pytest.raises(PdserveError, match="--colocated-sm-share shares a GPU's multiprocessors"):
        options("--colocated-sm-share", "50", config=cpu)
    with pytest.raises(PdserveError, match="--transport shm keeps each KV cache in host shared memory"):
        options("--transport", "shm", config=config)
    with pytest.raises(PdserveError, match="pool prefill: GPU 2 does not exist here"):
        options("--prefill-gpus", "1,2", config=config)


def test_gpus_asked_for_on_a_host_without_one_are_refused_before_any_worker_starts(tiny_llama: Path) -> None:
    for flags, fragment in (
        (["--device", "cuda"], "--device cuda, but no CUDA GPU can be used here"),
        (["--colocated-gpus", "0"], "but no CUDA GPU can be used here"),
    ):
        done = subprocess.run(
            [*SERVE, "--model", str(tiny_llama), "--colocated", "1", "--port", "0", *flags],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 2 and fragment in done.stderr, done.stderr
        assert "Traceback" not in done.stderr


def test_pool_tables_set_each_pools_engine_bounds_and_slos(tmp_path: Path) -> None:
    config = tmp_path / "pdserve.toml"
    config.write_text(
        'model = "m"\nprefill = 1\ndecode = 1\nslo = "ttft=800,itl=80"\nplanner = "slo"\nmax-workers = 4\n'
        "[pools.prefill]\nchunk_size = 128\nmax-num-batched-tokens = 1024\nmax = 3\nslo_ttft_ms = 500\n"
        "[pools.decode]\nmax_num_seqs = 16\nmin = 1\nslo-itl-ms = 60\n"
    )
    o = options(config=config)
    prefill, decode = serve.worker_config(o, "prefill", "p"), serve.worker_config(o, "decode", "d")
    assert (prefill.engine.chunk_size, prefill.engine.max_num_batched_tokens) == (128, 1024)
    assert (decode.engine.step_budget("cpu")[1], decode.engine.max_num_seqs) == (512, 16)
    # The planner's defaults: min 1, max the budget; a table or a flag wins.
    assert serve.pool_bounds(o, "prefill") == (1, 3) and serve.pool_bounds(o, "decode") == (1, 4)
    assert serve.pool_bounds(options("--prefill-max", "2", config=config), "prefill") == (1, 2)
    planner = serve.planner_settings(o)
    assert planner.mode == "slo" and planner.max_workers == 4
    assert (planner.slo.ttft_s, planner.slo.itl_s) == (0.8, 0.08)
    assert (planner.pool_slo("prefill").ttft_s, planner.pool_slo("prefill").itl_s) == (0.5, 0.08)
    assert (planner.pool_slo("decode").ttft_s, planner.pool_slo("decode").itl_s) == (0.8, 0.06)
    # Without the planner the bounds stay the start counts.
    static = options("--planner", "off", config=config)
    assert serve.pool_bounds(static, "decode") == (1, 1)


def test_each_pools_ray_placement_comes_from_its_flag_or_its_table(tmp_path: Path) -> None:
    config = tmp_path / "pdserve.toml"
    config.write_text(
        'model = "m"\nprefill = 1\ndecode = 1\ncluster = "ray"\ntransport = "tcp"\n'
        '[pools.prefill.ray]\nresources = {pdserve_prefill = 1}\nstrategy = "spread"\nnum_cpus = 2\n'
        "[pools.decode.ray]\nresources = {pdserve_decode = 1}\n"
    )
    o = options("--ray-decode-resources", '{"big_memory": 0.5}', "--ray-strategy", "pack", config=config)
    placements = serve.ray_placements(o)
    prefill, decode = placements["prefill"], placements["decode"]
    assert (prefill.resources, prefill.strategy, prefill.num_cpus) == (
        {"pdserve_prefill": 1.0},
        "spread",
        2.0,
    )
    assert (decode.resources, decode.strategy, decode.num_cpus) == ({"big_memory": 0.5}, "pack", 1.0)


def test_same_node_shm_is_on_under_ray_and_where_asked_for() -> None:
    def same_node_shm(*argv: str) -> bool:
        o = options("--model", "m", "--prefill", "1", "--decode", "1", *argv)
        return serve.worker_config(o, "decode", "d").same_node_shm

    # On one host --transport names what every pair uses; on Ray, workers that share a node
    # copy over shm and the others use the transport.
    assert not same_node_shm("--transport", "tcp")
    assert same_node_shm("--transport", "tcp", "--cluster", "ray")
    assert not same_node_shm("--transport", "nixl", "--cluster", "ray", "--same-node-kv", "off")
    assert same_node_shm("--transport", "tcp", "--same-node-kv", "shm")
    assert not same_node_shm("--transport", "shm", "--same-node-kv", "shm")  # shm everywhere already


@pytest.mark.parametrize(
    ("text", "argv", "fragment"),
    [
        ('model = "m"\nprefil = 1\n', (), "unknown option 'prefil'"),
        ('model = "m"\nprefill = "one"\n', (), "prefill must be a int"),
        ("model = [", (), "not valid TOML"),
        (
            'model = "m"\n',
            ("--prefill", "1"),
            "needs --prefill >= 1 (or --prefill-max >= 1) and --decode >= 1",
        ),
        ('model = "m"\n', ("--colocated", "2", "--prefill", "1"), "either --colocated"),
        ('model = "m"\n', ("--colocated", "1", "--transport", "udp"), "--transport must be"),
        (
            'model = "m"\n',
            ("--colocated", "1", "--kv-checksum", "yes"),
            "--kv-checksum must be auto, on or off",
        ),
        (
            'model = "m"\n',
            ("--colocated", "1", "--kv-corrupt-rate", "2"),
            "--kv-corrupt-rate must be in [0, 1]",
        ),
        ('model = "m"\n', ("--colocated", "1", "--kv-fault-rate", "-0.1"), "--kv-fault-rate must be in"),
        (
            'model = "m"\n',
            ("--prefill", "1", "--decode", "1", "--kv-corrupt-rate", "0.1", "--kv-checksum", "off"),
            "would send clients wrong tokens",
        ),
        ('model = "m"\n', ("--colocated", "1", "--cluster", "k8s"), "--cluster must be local or ray"),
        ('model = "m"\n', ("--colocated", "1", "--same-node-kv", "on"), "--same-node-kv must be auto"),
        ('model = "m"\n', ("--prefill", "1", "--decode", "1", "--cluster", "ray"), "needs --transport tcp"),
        (
            'model = "m"\n',
            ("--colocated", "1", "--cluster", "ray", "--transport", "tcp", "--ray-decode-resources", "{gpu"),
            "--ray-decode-resources: expected a JSON object",
        ),
        (
            'model = "m"\n',
            ("--colocated", "1", "--cluster", "ray", "--transport", "tcp", "--ray-strategy", "scatter"),
            "pack or spread",
        ),
        (
            'model = "m"\n',
            (
                "--colocated",
                "1",
                "--cluster",
                "ray",
                "--transport",
                "tcp",
                "--planner",
                "slo",
                "--slo",
                "ttft=500",
            ),
            "--cluster ray needs --max-workers",
        ),
        (
            'model = "m"\n',
            ("--colocated", "1", "--max-body-bytes", "100"),
            "--max-body-bytes must be >= 1024",
        ),
        ('model = "m"\n', ("--colocated", "1", "--body-timeout", "0"), "--body-timeout > 0"),
        ('model = "m"\n', ("--colocated", "1", "--log-level", "loud"), "--log-level must be one of DEBUG,"),
        ('model = "m"\ndecode = 2\nprefill = 1\ndecode-max = 1\n', (), "pool decode: need 0 <= --decode-min"),
        ('model = "m"\n', ("--colocated", "2", "--colocated-min", "3"), "3 <= 2 <= 2"),
        ('model = "m"\n', ("--prefill", "1", "--decode", "1", "--drain-timeout", "0"), "--drain-timeout"),
        ('model = "m"\n', ("--prefill", "1", "--decode", "1", "--planner", "pid"), "--planner must be"),
        ('model = "m"\n', ("--colocated", "1", "--path-choice", "random"), "--path-choice must be"),
        ('model = "m"\n', ("--prefill", "1", "--decode", "1", "--planner", "slo"), "needs an SLO"),
        ('model = "m"\n', ("--prefill", "1", "--decode", "1", "--slo", "ttft=fast"), "milliseconds"),
        ('model = "m"\n', ("--prefill", "1", "--decode", "1", "--slo", "e2e=5"), "ttft=MS and/or itl=MS"),
        ('model = "m"\n', ("--colocated", "1", "--reject-on-slo-miss"), "needs a TTFT SLO"),
        ('model = "m"\ncolocated = 1\n[pools.prefill]\nmin = 1\n', (), "does not have"),
        ('model = "m"\ncolocated = 1\n[pools.gpu]\nmin = 1\n', (), "unknown pool [pools.gpu]"),
        ('model = "m"\ncolocated = 1\n[pools.mixed]\nchunk = 1\n', (), "unknown key 'chunk'"),
        (
            'model = "m"\ncolocated = 1\n[pools.mixed.ray]\ncpus = 1\n',
            (),
            "[pools.mixed.ray] has unknown key",
        ),
        (
            'model = "m"\ncolocated = 1\n[pools.colocated.ray]\nresources = {gpu = "yes"}\n',
            (),
            "resources must map resource names to numbers",
        ),
        ('model = "m"\ncolocated = 1\n[pools.mixed]\nmax = "2"\n', (), "max must be a int"),
        ('model = "m"\nprefill = 1\ndecode = 1\n[pools.decode]\nslo_ttft_ms = 9\n', (), "by its ITL only"),
    ],
)
def test_bad_options_are_refused_before_anything_starts(
    tmp_path: Path, text: str, argv: tuple[str, ...], fragment: str
) -> None:
    config = tmp_path / "pdserve.toml"
    config.write_text(text)
    with pytest.raises(PdserveError) as failure:
        options(*argv, config=config)
    assert fragment in str(failure.value)


def test_a_bad_model_exits_with_a_clear_error_and_starts_no_worker() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pdserve.cli", "serve", "--model", "no-such-model", "--colocated", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "not found" in done.stderr


def test_a_bad_engine_setting_is_refused_before_any_worker_starts(tiny_llama: Path) -> None:
    done = subprocess.run(
        [*SERVE, "--model", str(tiny_llama), "--colocated", "1", "--block-size", "0", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "block_size must be a power of two" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_port_in_use_is_said_at_once_and_starts_no_worker(tiny_llama: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        server = subprocess.Popen(
            [*SERVE, "--model", str(tiny_llama), "--colocated", "1", "--port", str(port)],
            stderr=subprocess.PIPE,
            text=True,
        )
        workers: set[int] = set()
        while server.poll() is None:  # until it exits (communicate's timeout bounds it below)
            workers.update(children(server.pid))
            time.sleep(0.01)
        _, stderr = server.communicate(timeout=60)
    assert server.returncode == 2
    assert f"cannot listen on 127.0.0.1:{port}: Address already in use" in stderr, stderr
    assert not workers and "Traceback" not in stderr


def test_the_port_is_held_while_the_workers_start(tiny_llama: Path) -> None:
    """A worker's transport binds an ephemeral port while it starts; the API's port is bound
    before, so no worker can take it (which one did in CI: the server then died with EADDRINUSE
    after its workers had loaded). Until the workers are up a client is refused, not kept waiting."""
    port = free_port()
    server = subprocess.Popen(
        [*SERVE, "--model", str(tiny_llama), "--prefill", "1", "--decode", "1", "--port", str(port)],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not children(server.pid) and server.poll() is None:
            time.sleep(0.01)
        assert children(server.pid), "no worker was started"
        with pytest.raises(OSError) as taken, socket.socket() as other:
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", port), timeout=10).close()
    finally:
        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=60)
    assert server.returncode == 1 and "start-up stopped: interrupted" in stderr, stderr


def test_a_worker_that_dies_while_starting_stops_the_server_with_the_reason(tiny_llama: Path) -> None:
    started = time.monotonic()
    server = subprocess.Popen(
        [*SERVE, "--model", str(tiny_llama), "--colocated", "1", "--port", "0", "--dtype", "float32"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        while not (workers := children(server.pid)) and server.poll() is None:
            time.sleep(0.01)
        assert workers, "no worker was started"
        os.kill(workers[0], signal.SIGKILL)  # while it loads its model
        _, stderr = server.communicate(timeout=60)
    finally:
        if server.poll() is None:
            server.kill()
    assert server.returncode != 0
    assert "colocated-0 killed by signal 9 (SIGKILL) while starting" in stderr, stderr
    assert time.monotonic() - started < 60


def test_colocated_from_a_config_file_serves_and_sigterm_leaves_nothing(
    tiny_llama: Path, tmp_path: Path
) -> None:
    config = tmp_path / "pdserve.toml"
    config.write_text(
        f'model = "{tiny_llama}"\ncolocated = 2\nmax-num-seqs = 8\nstep-trace = "runs/steps.jsonl"\n'
    )
    server = Server(tiny_llama, "--config", str(config))
    try:
        assert sorted(server.worker_pids) == ["colocated-0", "colocated-1"]
        answer = server.client.chat.completions.create(
            model=server.model,
            messages=[{"role": "user", "content": "hello there, how are you?"}],
            max_tokens=6,
        )
        assert answer.choices[0].message.content is not None
        assert server.metric("pdserve_requests_total", path="colocated", outcome="ok") == 1
        assert server.metric("pdserve_worker_up", pool="colocated") == 2
        # The step trace (relative to the config file): the request's prompt step and its decode
        # steps, as the worker's load reports bring them.
        tokens = answer.usage.completion_tokens if answer.usage else 0
        assert tokens >= 1
        trace = tmp_path / "runs" / "steps.jsonl"
        deadline = time.monotonic() + 60
        while len(rows := _trace_rows(trace)) < tokens and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(rows) == tokens, rows  # a step a token: the prompt's, then one a token
        assert {row["pool"] for row in rows} == {"colocated"}
        assert rows[0]["prefill_tokens"] > 0 and rows[0]["seconds"] > 0
        assert [row["decode_streams"] for row in rows[1:]] == [1] * (tokens - 1)
        assert all(row["loop_seconds"] >= 0 for row in rows) and any(row["loop_seconds"] > 0 for row in rows)
        assert all(row["pull_wait_seconds"] == 0 for row in rows)  # colocated: nothing to pull
    finally:
        assert server.stop(signal.SIGTERM) == 0


def _trace_rows(trace: Path) -> list[dict[str, Any]]:
    if not trace.exists():
        return []
    return [json.loads(line) for line in trace.read_text().splitlines() if line.endswith("}")]


def test_sigint_stops_a_disaggregated_server_and_its_segments(tiny_llama: Path) -> None:
    server = Server(tiny_llama, "--prefill", "1", "--decode", "1")
    prefill_pid = server.worker_pids["prefill-0"]
    assert leftover_segments(prefill_pid)  # the prefill worker's KV cache lives in /dev/shm
    assert server.stop(signal.SIGINT) == 0  # stop() checks: no worker left, no segment left


def test_a_server_killed_with_sigkill_takes_its_workers_with_it(tiny_llama: Path) -> None:
    server = Server(tiny_llama, "--prefill", "1", "--decode", "1")
    workers = list(server.worker_pids.values())
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=10)
    deadline = time.monotonic() + 20
    while any(alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in workers if alive(p)], "workers outlived a SIGKILLed server"
    assert not children(server.proc.pid)
    assert server.stop() == -signal.SIGKILL  # and no segment is left
