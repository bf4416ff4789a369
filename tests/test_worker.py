"""Worker processes end to end: real processes, real ZeroMQ sockets, KV through each transport
(shared memory, TCP, NIXL where it is installed).

A prefill worker answers with the first token and a KV handle; a decode worker pulls that KV and
continues; the result is token for token what the offline engine produces."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zmq
from serving import alive

from pdserve import LLM, SamplingParams, wire
from pdserve.cluster.local import start_worker_process
from pdserve.config import EngineConfig, Role, WorkerConfig
from pdserve.security import DeploymentSecrets, curve_client
from pdserve.transfer import nixl_backend
from pdserve.transfer.segments import leftover_segments

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(20, 20 + n)) for n in (3, 17, 40)]


TRANSPORTS = [
    "shm",
    "tcp",
    pytest.param(
        "nixl",
        marks=pytest.mark.skipif(
            nixl_backend.unavailable_reason() is not None, reason=str(nixl_backend.unavailable_reason())
        ),
    ),
]


POOLS = {"prefill": "prefill", "decode": "decode", "mixed": "colocated"}
SECRETS = DeploymentSecrets.generate()  # this test module is the router of its workers


class Worker:
    """A real worker process, started as the local cluster backend starts one (its configuration
    in its environment, its Ready on a pipe), and a DEALER socket speaking to it as a router does."""

    def __init__(
        self,
        model: Path,
        role: str,
        worker_id: str,
        engine_settings: dict[str, int] | None = None,
        **settings: object,
    ) -> None:
        engine = EngineConfig(
            model=str(model), dtype="float32", role=Role(role), num_kv_blocks=64, **(engine_settings or {})
        )
        config = WorkerConfig(worker_id, POOLS[role], engine, **settings)  # type: ignore[arg-type]
        # Returns once the model is loaded and the RPC socket bound.
        self.proc, reported = start_worker_process(config, SECRETS.for_workers(), stderr=subprocess.PIPE)
        self.address = reported.rpc_address
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        curve_client(self.sock, SECRETS.router, reported.rpc_public_key)
        self.sock.connect(self.address)
        self.sock.send(b"")  # hello: the worker answers with its next load report, then Ready
        self.kv_pulled: list[wire.KVPulled] = []  # every KVPulled seen, in order
        self.first_load = self.recv(timeout=30)
        assert isinstance(self.first_load, wire.Load)
        self.ready = self.recv(timeout=30)
        assert self.ready == reported

    def send(self, message: wire.Message) -> None:
        self.sock.send(wire.encode(message))

    def recv(self, timeout: float = 30) -> wire.Message:
        if not self.sock.poll(timeout=int(timeout * 1000)):
            raise TimeoutError(f"no message from worker within {timeout} s")
        message = wire.decode(self.sock.recv())
        if isinstance(message, wire.KVPulled):
            self.kv_pulled.append(message)
        return message

    def recv_tokens(self, timeout: float = 30) -> wire.Tokens:
        deadline = time.monotonic() + timeout
        while True:
            message = self.recv(max(0.1, deadline - time.monotonic()))
            if isinstance(message, wire.Tokens):
                return message

    def last_load(self, timeout: float = 5) -> wire.Load:
        deadline = time.monotonic() + timeout
        load = None
        while time.monotonic() < deadline:
            message = self.recv(timeout)
            if isinstance(message, wire.Load):
                load = message
                if load.kv_blocks_used == 0:
                    return load
        assert load is not None
        return load

    def stop(self) -> int:
        self.send(wire.Shutdown())
        try:
            code = self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        self.sock.close()
        return code


def hand_over(
    decode: Worker, request_id: str, prompt: list[int], params: wire.WireSamplingParams, first: wire.Tokens
) -> None:
    """What the router does with a prefill worker's answer: the request goes to the decode worker."""
    decode.send(wire.AddRequest(request_id, prompt, params, output_token_ids=first.token_ids, kv=first.kv))


@pytest.fixture(params=TRANSPORTS)
def pair(tiny_llama: Path, request: pytest.FixtureRequest) -> Iterator[tuple[Worker, Worker]]:
    transport = request.param
    prefill = Worker(tiny_llama, "prefill", "p0", transport=transport)
    decode = Worker(tiny_llama, "decode", "d0", transport=transport)
    try:
        yield prefill, decode
    finally:
        for worker in (prefill, decode):
            if worker.proc.poll() is None:
                assert worker.stop() == 0


def test_prefill_to_decode_matches_offline(tiny_llama: Path, pair: tuple[Worker, Worker]) -> None:
    prefill, decode = pair
    transport = prefill.ready.kv_transport  # type: ignore[union-attr]
    expected = [
        o.outputs[0].token_ids for o in LLM(str(tiny_llama), dtype="float32").generate(PROMPTS, GREEDY)
    ]
    params = wire.WireSamplingParams.from_params(GREEDY)
    for i, prompt in enumerate(PROMPTS):
        prefill.send(wire.AddRequest(f"r{i}", prompt, params))
    handles: dict[str, wire.Tokens] = {}
    while len(handles) < len(PROMPTS):
        tokens = prefill.recv_tokens()
        assert tokens.finish_reason == "prefilled" and tokens.kv is not None
        assert tokens.kv.transport == transport and tokens.kv.num_tokens > 0
        if transport == "shm":
            assert tokens.kv.address.startswith("pdserve-kv-")
        else:  # tcp, nixl: the prefill worker's KV server; its cache is not in shared memory
            assert tokens.kv.address.startswith("127.0.0.1:")
            assert leftover_segments(prefill.proc.pid) == []
        handles[tokens.request_id] = tokens
    for i, prompt in enumerate(PROMPTS):
        first = handles[f"r{i}"]
        hand_over(decode, f"r{i}", prompt, params, first)
    got = {f"r{i}": list(handles[f"r{i}"].token_ids) for i in range(len(PROMPTS))}
    done = 0
    while done < len(PROMPTS):
        tokens = decode.recv_tokens()
        assert tokens.error is None, tokens.error
        got[tokens.request_id] += tokens.token_ids
        done += tokens.finish_reason is not None
    for i in range(len(PROMPTS)):
        prefill.send(wire.Release(f"r{i}"))
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == expected
    # The decode side acknowledged each transfer with what it moved.
    assert sorted(p.request_id for p in decode.kv_pulled) == ["r0", "r1", "r2"]
    assert all(p.ok and p.nbytes > 0 and p.seconds > 0 for p in decode.kv_pulled)
    assert prefill.last_load().kv_blocks_used == 0 and decode.last_load().kv_blocks_used == 0


def steps_until_done(
    worker: Worker, at_least: int, timeout: float = 30
) -> tuple[list[wire.StepSample], list[wire.Load]]:
    """The step samples of the worker's load reports until its request finished and at least
    `at_least` steps were reported (or `timeout`), and the reports themselves."""
    steps: list[wire.StepSample] = []
    loads: list[wire.Load] = []
    deadline = time.monotonic() + timeout
    finished = False
    while time.monotonic() < deadline and not (finished and len(steps) >= at_least):
        message = worker.recv()
        if isinstance(message, wire.Tokens) and message.finish_reason:
            finished = True
        elif isinstance(message, wire.Load):
            steps += message.steps
            loads.append(message)
    return steps, loads


def test_load_reports_carry_each_step_for_the_cost_model(tiny_llama: Path) -> None:
    worker = Worker(tiny_llama, "mixed", "m0")
    try:
        ready = worker.ready
        assert isinstance(ready, wire.Ready)
        assert (ready.chunk_size, ready.max_num_batched_tokens, ready.max_num_seqs) == (512, 2048, 64)
        params = wire.WireSamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
        worker.send(wire.AddRequest("r1", list(range(20, 60)), params))
        steps, loads = steps_until_done(worker, 6)
        assert all(load.kv_blocks_total == 64 and load.block_size == 64 for load in loads)
        # One prompt step of 40 tokens (attending to 1..40: 40 * 20 on average), then five decode
        # steps of one stream whose context grows by one each time; each step once, in order.
        assert [s.prefill_tokens for s in steps] == [40, 0, 0, 0, 0, 0]
        assert steps[0].prefill_attention == 40 * 20 and steps[0].decode_streams == 0
        assert [s.decode_context for s in steps[1:]] == [41, 42, 43, 44, 45]
        assert all(s.decode_streams == 1 and s.seconds > 0 for s in steps[1:])
    finally:
        assert worker.stop() == 0


def test_what_the_prefix_cache_stored_is_reported_without_waiting_for_the_next_load_report(
    tiny_llama: Path,
) -> None:
    # Load reports every 60 s: after the one that greets the router (with Ready), only the prompt
    # report of the prefix cache's news can tell it, within the wait below, what the worker cached.
    worker = Worker(tiny_llama, "mixed", "m0", load_interval=60.0)
    try:
        params = wire.WireSamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        worker.send(wire.AddRequest("r1", list(range(20, 120)), params))  # one full 64-token block
        stored: list[object] = []
        deadline = time.monotonic() + 30
        while not stored:
            message = worker.recv(max(0.1, deadline - time.monotonic()))
            if isinstance(message, wire.Load):
                stored += message.prefix_stored
        assert len(stored) == 1
    finally:
        assert worker.stop() == 0


def test_a_request_s_chunk_limit_reaches_the_engine(tiny_llama: Path) -> None:
    # What the router sends for a prompt it prefills on a decode worker: at most 16 tokens a step.
    worker = Worker(tiny_llama, "mixed", "m0")
    try:
        params = wire.WireSamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        worker.send(wire.AddRequest("r1", list(range(20, 60)), params, max_chunk_tokens=16))
        steps, _ = steps_until_done(worker, 4)
        assert [s.prefill_tokens for s in steps] == [16, 16, 8, 0]
        worker.send(wire.AddRequest("r2", [20, 21, 22], params, max_chunk_tokens=-1))
        answer = worker.recv_tokens()
        assert answer.request_id == "r2" and answer.finish_reason == "error"
        assert "max_chunk_tokens" in (answer.error or "")
        # ... and the step budget the decode worker sizes each chunk to (checked the same way)
        for rid, field, bad in (("r3", "max_step_seconds", -0.1), ("r4", "step_percentile", 1.5)):
            worker.send(wire.AddRequest(rid, [20, 21, 22], params, **{field: bad}))  # type: ignore[arg-type]
            answer = worker.recv_tokens()
            assert answer.request_id == rid and answer.finish_reason == "error" and answer.invalid
            assert field in (answer.error or "")
    finally:
        assert worker.stop() == 0


def test_a_request_s_wait_counts_from_its_arrival_not_from_when_the_step_ends() -> None:
    # A request that arrives while a long step runs waits for the rest of that step: its queue
    # time (and the step budget a decode worker sizes its chunks to) counts from when the RPC
    # thread took it off the socket, not from when the engine thread got to it after the step.
    # The real model, so that the step is long (a 1000-token prompt: ~1 s on one thread).
    worker = Worker(
        Path("smollm2-135m"),
        "mixed",
        "m0",
        engine_settings={"chunk_size": 1024, "max_num_batched_tokens": 1024},
    )
    try:
        params = wire.WireSamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
        worker.send(wire.AddRequest("long", [400 + i % 900 for i in range(1000)], params))
        time.sleep(0.3)  # the engine thread is (almost surely) inside the long prompt's step now
        sent = time.monotonic()
        # 100 tokens do not fit beside the 1000 in a 1024-token step: this one runs in the next.
        worker.send(wire.AddRequest("short", [400 + i for i in range(100)], params))
        finished: dict[str, tuple[float, wire.Tokens]] = {}
        while len(finished) < 2:
            answer = worker.recv_tokens(timeout=60)
            finished[answer.request_id] = (time.monotonic(), answer)
        long_done = finished["long"][0]
        waited = finished["short"][1].queue_seconds
        assert waited is not None and long_done - sent > 0.2  # it did arrive during a long step
        # It waited at least from its arrival to the end of that step (less the messages' way here,
        # given 0.1 s on a busy machine; without the arrival stamp it would read ~0).
        assert waited >= long_done - sent - 0.1
    finally:
        assert worker.stop() == 0


def first_tokens_in_order(interrupts: bool) -> tuple[bool, list[tuple[str, list[int]]], wire.Load]:
    """A SmolLM2 prefill worker given a 1000-token prompt, then, while its step runs, a 40-token
    one: (what its Ready says, the answers in the order they came, its load report once both are
    released)."""
    worker = Worker(
        Path("smollm2-135m"),
        "prefill",
        "p0",
        engine_settings={"chunk_size": 1024, "max_num_batched_tokens": 1024},
        prefill_interrupts=interrupts,
    )
    try:
        assert isinstance(worker.ready, wire.Ready)
        params = wire.WireSamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        worker.send(wire.AddRequest("long", [400 + i % 900 for i in range(1000)], params))
        time.sleep(0.3)  # the engine thread is (almost surely) inside the long prompt's step now
        worker.send(wire.AddRequest("short", [500 + i for i in range(40)], params))
        answers = [worker.recv_tokens(timeout=60) for _ in range(2)]
        assert all(a.finish_reason == "prefilled" and a.kv is not None for a in answers)
        for answer in answers:
            worker.send(wire.Release(answer.request_id))
        load = worker.last_load(timeout=10)
        return worker.ready.prefill_interrupts, [(a.request_id, a.token_ids) for a in answers], load
    finally:
        assert worker.stop() == 0


def test_a_prefill_worker_answers_a_short_prompt_from_inside_a_long_step() -> None:
    # The real model, so that the long step takes ~1-2 s. With interruption on (the default) the
    # 40-token prompt is prefilled between two layers of the 1000-token step and answered first;
    # off, it waits for the step. The tokens are the same either way, and every block is freed.
    said, answers, load = first_tokens_in_order(interrupts=True)
    assert said and [rid for rid, _ in answers] == ["short", "long"]
    assert load.kv_blocks_used == 0 and load.steps_between_layers == 1
    said_off, answers_off, load_off = first_tokens_in_order(interrupts=False)
    assert not said_off and [rid for rid, _ in answers_off] == ["long", "short"]
    assert load_off.kv_blocks_used == 0 and load_off.steps_between_layers == 0
    assert dict(answers) == dict(answers_off)


def test_an_abort_that_arrives_inside_a_step_frees_its_blocks_once_the_step_ends() -> None:
    # Between two layers the worker takes only new prompts; an Abort of the request whose layers
    # are running is applied after its step. The client hears nothing more of the aborted one,
    # the short prompt that came with the Abort is answered from inside the step, and every block
    # is free at the end. (What this cannot see: blocks freed under the running step and reused by
    # the short one would corrupt its KV, not its first token.)
    worker = Worker(
        Path("smollm2-135m"),
        "prefill",
        "p0",
        engine_settings={"chunk_size": 1024, "max_num_batched_tokens": 1024},
    )
    try:
        params = wire.WireSamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
        worker.send(wire.AddRequest("long", [400 + i % 900 for i in range(1000)], params))
        time.sleep(0.3)  # the engine thread is (almost surely) inside the long prompt's step now
        worker.send(wire.Abort("long"))
        worker.send(wire.AddRequest("short", [500 + i for i in range(40)], params))
        answer = worker.recv_tokens(timeout=60)
        assert answer.request_id == "short" and answer.finish_reason == "prefilled"
        worker.send(wire.Release("short"))
        load = worker.last_load(timeout=10)
        assert load.kv_blocks_used == 0 and load.steps_between_layers == 1 and load.num_held == 0
        with pytest.raises(TimeoutError):
            worker.recv_tokens(timeout=1)  # nothing for the aborted request
    finally:
        assert worker.stop() == 0


def test_failed_kv_pull_is_reported_not_recomputed(tiny_llama: Path) -> None:
    prefill = Worker(tiny_llama, "prefill", "p0")
    decode = Worker(tiny_llama, "decode", "d0", kv_fault_rate=1.0)
    try:
        params = wire.WireSamplingParams.from_params(GREEDY)
        prefill.send(wire.AddRequest("r", PROMPTS[1], params))
        first = prefill.recv_tokens()
        hand_over(decode, "r", PROMPTS[1], params, first)
        answer = decode.recv_tokens()
        assert answer.finish_reason == "error" and answer.error and "injected fault" in answer.error
        assert not answer.invalid  # a fault: worth another attempt
        assert [(p.request_id, p.ok) for p in decode.kv_pulled] == [("r", False)]
        assert decode.last_load().kv_blocks_used == 0
    finally:
        assert prefill.stop() == 0 and decode.stop() == 0


def test_a_pull_is_not_started_on_a_lease_about_to_expire(tiny_llama: Path) -> None:
    # The shm copy has no lease check of its own: with 3 s of lease left (under the 5 s margin)
    # the decode worker refuses to start it rather than race the prefill worker's free.
    prefill = Worker(tiny_llama, "prefill", "p0", lease_seconds=3.0)
    decode = Worker(tiny_llama, "decode", "d0")
    try:
        params = wire.WireSamplingParams.from_params(GREEDY)
        prefill.send(wire.AddRequest("r", PROMPTS[1], params))
        first = prefill.recv_tokens()
        hand_over(decode, "r", PROMPTS[1], params, first)
        answer = decode.recv_tokens()
        assert answer.finish_reason == "error" and answer.error and "expires too soon" in answer.error
        assert decode.last_load().kv_blocks_used == 0
        assert prefill.last_load(timeout=10).kv_blocks_used == 0  # its lease ran out
    finally:
        assert prefill.stop() == 0 and decode.stop() == 0


def test_lease_expiry_frees_prefilled_blocks(tiny_llama: Path) -> None:
    prefill = Worker(tiny_llama, "prefill", "p0", lease_seconds=0.5)
    try:
        prefill.send(wire.AddRequest("r", PROMPTS[2], wire.WireSamplingParams.from_params(GREEDY)))
        assert prefill.recv_tokens().finish_reason == "prefilled"
        assert prefill.last_load(timeout=10).kv_blocks_used == 0
    finally:
        assert prefill.stop() == 0


def test_bad_requests_get_an_error_and_the_worker_keeps_serving(tiny_llama: Path) -> None:
    worker = Worker(tiny_llama, "mixed", "m0")
    try:
        worker.send(wire.AddRequest("empty", [], wire.WireSamplingParams(max_tokens=3)))
        answer = worker.recv_tokens()
        assert answer.finish_reason == "error" and answer.error and "empty" in answer.error
        assert answer.invalid  # the router fails it at once instead of retrying it
        worker.sock.send(b"\x00 not a frame")
        worker.send(wire.AddRequest("ok", PROMPTS[0], wire.WireSamplingParams(max_tokens=2, temperature=0.0)))
        tokens: list[int] = []
        while True:
            answer = worker.recv_tokens()
            tokens += answer.token_ids
            if answer.finish_reason:
                break
        assert answer.request_id == "ok" and len(tokens) <= 2
    finally:
        assert worker.stop() == 0


def test_sigterm_stops_the_worker_and_removes_its_segment(tiny_llama: Path) -> None:
    worker = Worker(tiny_llama, "prefill", "p0")
    segment = worker.ready.kv_address  # type: ignore[union-attr]
    assert segment in leftover_segments()
    os.kill(worker.proc.pid, signal.SIGTERM)
    assert worker.proc.wait(timeout=30) == 0
    worker.sock.close()
    assert segment not in leftover_segments()


def test_a_burst_of_signals_still_stops_the_worker(tiny_llama: Path) -> None:
    # A handler that took a lock could run while the main thread held it and wait on itself:
    # the worker then outlived a SIGKILLed server (its parent-death SIGTERM came with others).
    for attempt in range(3):
        worker = Worker(tiny_llama, "decode", f"d{attempt}")
        deadline = time.monotonic() + 1.0
        while time.monotonic() < deadline and worker.proc.poll() is None:
            os.kill(worker.proc.pid, signal.SIGTERM)  # some land while a handler runs
            time.sleep(0.0002)
        # 0, or SIGTERM's own exit if one lands after the handlers are gone (interpreter exit)
        assert worker.proc.wait(timeout=30) in (0, -signal.SIGTERM)
        worker.sock.close()
        assert worker.ready.kv_address not in leftover_segments()  # type: ignore[union-attr]


def test_tcp_pull_after_release_is_refused(tiny_llama: Path) -> None:
    """The prefill worker's exporter serves only leased blocks: once released, a (late) pull of the
    same handle fails instead of reading blocks that another request may now own."""
    prefill = Worker(tiny_llama, "prefill", "p0", transport="tcp")
    decode = Worker(tiny_llama, "decode", "d0", transport="tcp")
    try:
        params = wire.WireSamplingParams.from_params(GREEDY)
        prefill.send(wire.AddRequest("r", PROMPTS[2], params))
        first = prefill.recv_tokens()
        assert first.kv is not None
        prefill.send(wire.Release("r"))
        assert prefill.last_load().kv_blocks_used == 0
        hand_over(decode, "r", PROMPTS[2], params, first)
        answer = decode.recv_tokens()
        assert answer.finish_reason == "error" and answer.error and "no lease" in answer.error
        assert decode.last_load().kv_blocks_used == 0
    finally:
        assert prefill.stop() == 0 and decode.stop() == 0


def test_the_transport_is_chosen_per_pair_shm_on_one_node_tcp_across(tiny_llama: Path) -> None:
    """A tcp deployment with same-node shm: the holder's handle names its node and its segment;
    a puller on that node copies from the segment, one on another node reads over tcp, and each
    says which it used. The tokens are the offline engine's either way."""
    tcp = {"transport": "tcp", "same_node_shm": True}
    prefill = Worker(tiny_llama, "prefill", "p0", node_id="node-a", **tcp)
    near = Worker(tiny_llama, "decode", "d-near", node_id="node-a", **tcp)
    far = Worker(tiny_llama, "decode", "d-far", node_id="node-b", **tcp)
    try:
        assert isinstance(prefill.ready, wire.Ready) and prefill.ready.node_id == "node-a"
        assert prefill.ready.kv_address.startswith("127.0.0.1:")
        assert prefill.ready.kv_shm_address.startswith("pdserve-kv-")
        expected = [
            o.outputs[0].token_ids
            for o in LLM(str(tiny_llama), dtype="float32").generate(PROMPTS[1:], GREEDY)
        ]
        params = wire.WireSamplingParams.from_params(GREEDY)
        got = []
        for decode, prompt in zip((near, far), PROMPTS[1:], strict=True):
            prefill.send(wire.AddRequest("r", prompt, params))
            first = prefill.recv_tokens()
            assert first.kv is not None and first.kv.transport == "tcp"
            assert (first.kv.node_id, first.kv.shm_address) == ("node-a", prefill.ready.kv_shm_address)
            hand_over(decode, "r", prompt, params, first)
            tokens = list(first.token_ids)
            while True:
                answer = decode.recv_tokens()
                assert answer.error is None, answer.error
                tokens += answer.token_ids
                if answer.finish_reason:
                    break
            prefill.send(wire.Release("r"))
            got.append(tokens)
        assert got == expected
        assert [(p.ok, p.transport) for p in near.kv_pulled] == [(True, "shm")]
        assert [(p.ok, p.transport) for p in far.kv_pulled] == [(True, "tcp")]
        assert prefill.last_load().kv_blocks_used == 0
    finally:
        for worker in (prefill, near, far):
            assert worker.stop() == 0
    assert prefill.ready.kv_shm_address not in leftover_segments()  # type: ignore[union-attr]


def test_a_worker_that_ignores_its_sigterm_still_ends_once_its_parent_is_gone() -> None:
    """PR_SET_PDEATHSIG asks for a clean stop; an engine wedged in a step never makes it. The
    parent watch ends the process a grace period after its parent is gone."""
    child = (
        "import os, signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
        "from pdserve.worker.main import watch_parent; watch_parent(os.getppid(), 1.0);"
        "print(os.getpid(), flush=True); time.sleep(60)"
    )
    parent = (
        f"import subprocess, sys, time;subprocess.Popen([sys.executable, '-c', {child!r}]); time.sleep(60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        orphan = int(proc.stdout.readline())
        time.sleep(1.5)
        assert alive(orphan)  # its parent lives: left alone
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while alive(orphan) and time.monotonic() < deadline:
        time.sleep(0.1)
    gone = not alive(orphan)
    if not gone:
        os.kill(orphan, signal.SIGKILL)
    assert gone, "the orphaned worker outlived its grace period"
