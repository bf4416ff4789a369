"""The worker's thread-free core, in one process with no socket and no model: the real engine core
and scheduler over a modelled runner, commands in, messages out. Leases (held, released, run
out), streams handed over between tokens, an abort that waits for its pull, pulls that fail,
requests refused. (tests/test_worker.py runs the same worker for real, over sockets.)"""

from __future__ import annotations

import time

from pdserve import wire
from pdserve.config import EngineConfig, Role, WorkerConfig
from pdserve.engine.core import EngineCore, RunnerOutput, engine_core
from pdserve.engine.kv import KVCacheManager
from pdserve.engine.sched_types import SchedulerOutput
from pdserve.modelfiles.config import ModelConfig
from pdserve.worker.core import KVDone, WorkerCore

BLOCK = 16
MODEL = ModelConfig(
    model_type="llama", vocab_size=50000, hidden_size=64, intermediate_size=128, num_layers=2,
    num_heads=4, num_kv_heads=2, head_dim=16, max_position_embeddings=4096, rms_norm_eps=1e-5,
    rope_theta=10000.0, rope_scaling=None, tie_word_embeddings=True, attention_bias=False,
    sliding_window=None,
)  # fmt: skip


class CountingRunner:
    """A modelled runner: the token sampled at position i is 1000 + i."""

    def execute(
        self, out: SchedulerOutput, kv: KVCacheManager, between_layers: object = None
    ) -> RunnerOutput:
        return RunnerOutput(
            {c.request.request_id: 1000 + c.start + c.num_tokens for c in out.chunks if c.sample}
        )

    def release(self, request_id: str) -> None:
        pass

    def generator_state(self, request_id: str) -> bytes | None:
        return None


class Exporter:
    """What a transport that serves reads is told: which blocks are leased, under which token."""

    def __init__(self) -> None:
        self.leases: dict[str, list[int]] = {}

    def register(self, request_id: str, block_ids: list[int]) -> bytes:
        self.leases[request_id] = block_ids
        return b"\x01" * 16

    def unregister(self, request_id: str) -> None:
        self.leases.pop(request_id, None)


class Importer:
    def __init__(self) -> None:
        self.forgotten: list[str] = []

    def forget(self, address: str) -> None:
        self.forgotten.append(address)


class Worker:
    """A worker core and what it sent, for one role."""

    def __init__(self, role: Role, *, lease_seconds: float = 30.0, importer: bool = False) -> None:
        pool = {Role.PREFILL: "prefill", Role.DECODE: "decode", Role.MIXED: "colocated"}[role]
        engine_config = EngineConfig("modelled", role=role, block_size=BLOCK, num_kv_blocks=64)
        config = WorkerConfig(f"{pool}-0", pool, engine_config, transport="tcp", lease_seconds=lease_seconds)
        self.engine: EngineCore[CountingRunner] = engine_core(
            engine_config, MODEL, CountingRunner(), (2,), 64, "cpu"
        )
        self.sent: list[tuple[wire.Message, bool]] = []
        self.forgotten: list[str] = []
        self.exporter, self.importer = Exporter(), Importer() if importer else None
        self.core = WorkerCore(
            self.engine, config, send=lambda m, final: self.sent.append((m, final)),
            forget=self.forgotten.append, kv_address="127.0.0.1:9", exporter=self.exporter,  # type: ignore[arg-type]
            importer=self.importer,  # type: ignore[arg-type]
        )  # fmt: skip

    def step(self) -> None:
        for out in self.engine.step():
            self.core.emit(out)
        self.core.hand_over()

    def messages(self, kind: type) -> list:  # type: ignore[type-arg]
        return [m for m, _ in self.sent if isinstance(m, kind)]

    @property
    def free_blocks(self) -> int:
        return self.engine.stats().kv_blocks_free


def add(request_id: str, prompt: int, max_tokens: int = 5, **kw: object) -> wire.AddRequest:
    params = wire.WireSamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return wire.AddRequest(request_id, list(range(10, 10 + prompt)), params, **kw)  # type: ignore[arg-type]


def test_a_prefilled_prompts_blocks_are_held_under_a_lease_until_released() -> None:
    w = Worker(Role.PREFILL)
    free = w.free_blocks
    w.core.apply(add("a", 40))
    w.step()
    (tokens,) = w.messages(wire.Tokens)
    assert tokens.finish_reason == "prefilled" and tokens.token_ids == [1040]
    assert tokens.kv.num_tokens == 40 and tokens.kv.block_ids == w.exporter.leases["a"]
    assert len(tokens.kv.block_ids) == 3 and tokens.kv.lease_token == "01" * 16
    assert w.sent[-1][1] is False  # not over here: its owner still has to release it
    assert w.free_blocks == free - 3
    w.core.apply(wire.Release("a"))
    assert w.free_blocks == free and w.exporter.leases == {} and w.core.requests == {}


def test_a_lease_that_runs_out_frees_the_blocks_and_forgets_the_request() -> None:
    w = Worker(Role.PREFILL, lease_seconds=5.0)
    free = w.free_blocks
    w.core.apply(add("a", 40))
    w.step()
    w.core.expire_leases(time.monotonic())  # not yet
    assert w.free_blocks == free - 3 and "a" in w.exporter.leases
    w.core.expire_leases(time.monotonic() + 6.0)
    assert w.free_blocks == free and w.exporter.leases == {} and w.forgotten == ["a"]
    assert w.core.lease_expiries == 1 and w.core.requests == {}


def test_a_stream_asked_to_move_stops_between_two_tokens_and_holds_its_kv() -> None:
    w = Worker(Role.MIXED)
    w.core.apply(add("s", 20, max_tokens=50))
    w.core.apply(add("queued", 20, max_tokens=50))
    w.step()  # both prompts in one step: two first tokens
    w.step()
    w.core.apply(wire.Migrate(["s", "never-here"]))
    w.step()
    (moved,) = w.messages(wire.Migrated)
    assert moved.request_id == "s" and moved.output_token_ids == [1020, 1021, 1022]
    assert moved.kv is not None and moved.kv.num_tokens == 22  # every token but the last
    assert w.exporter.leases["s"] == moved.kv.block_ids == w.engine.held_blocks("s", 22)
    assert set(w.core.requests) == {"s"}  # only what it holds for another worker
    w.core.apply(wire.Release("s"))
    assert w.core.requests == {} and "s" not in w.exporter.leases


def test_a_request_with_nothing_computed_yet_is_handed_back_without_kv() -> None:
    w = Worker(Role.MIXED)
    w.core.apply(add("q", 20))
    w.core.apply(wire.Migrate(["q"]))
    w.core.hand_over()
    assert w.sent == [(wire.Migrated("q", []), True)] and w.core.requests == {}


def test_an_abort_during_a_pull_frees_the_blocks_only_once_the_pull_is_over() -> None:
    w = Worker(Role.DECODE, importer=True)
    free = w.free_blocks
    handle = wire.KVHandle("prefill-0", "tcp", "10.0.0.1:9", [0, 1], 20, 30.0, "r", "01" * 16)
    w.core.apply(add("r", 20, output_token_ids=[1020], kv=handle))
    w.engine.admit_remote_kv()
    (order,) = w.core.pulls_to_start()
    assert order.handle == handle and order.transport == "tcp" and w.core.pulls_in_flight
    w.core.apply(wire.Abort("r"))
    assert w.free_blocks < free  # the pull still writes into them
    w.core.apply(KVDone("r", True, None, 4096, 0.01))
    assert w.free_blocks == free and w.core.requests == {} and not w.core.pulls_in_flight
    assert w.messages(wire.KVPulled) == []  # nobody waits for it


def test_a_decode_worker_pulls_only_the_blocks_its_prefix_cache_lacks() -> None:
    w = Worker(Role.DECODE, importer=True)
    first = wire.KVHandle("prefill-0", "tcp", "10.0.0.1:9", [0, 1, 2], 40, 30.0, "t1", "01" * 16)
    w.core.apply(add("t1", 40, output_token_ids=[1040], kv=first))
    w.engine.admit_remote_kv()
    (order,) = w.core.pulls_to_start()
    assert order.src_blocks == [0, 1, 2] and len(order.dst_blocks) == 3  # nothing cached yet
    w.core.apply(KVDone("t1", True, None, 4096, 0.01))
    while w.engine.has_unfinished:  # it decodes 1041..1044 here: 44 tokens of KV, 2 full blocks
        w.step()
    conversation = [*range(10, 50), 1040, 1041, 1042, 1043, 1044]
    # The next turn, prefilled elsewhere: 48 tokens of KV in the holder's blocks 5, 6, 7, with a
    # digest each. This worker has the first two blocks: it pulls the third only.
    second = wire.KVHandle(
        "prefill-0",
        "tcp",
        "10.0.0.1:9",
        [5, 6, 7],
        48,
        30.0,
        "t2",
        "01" * 16,
        kv_block_digests=["a", "b", "c"],
    )
    params = wire.WireSamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    w.core.apply(wire.AddRequest("t2", [*conversation, 7, 8, 9], params, output_token_ids=[2000], kv=second))
    w.engine.admit_remote_kv()
    (order,) = w.core.pulls_to_start()
    assert (order.src_blocks, order.block_digests, len(order.dst_blocks)) == ([7], ["c"], 1)
    w.core.apply(KVDone("t2", True, None, 2048, 0.01))
    assert w.messages(wire.KVPulled)[-1].ok
    # A turn whose KV this worker has in full (32 tokens: two whole blocks): no pull at all, and
    # the prefill worker is still told it can let go of its lease.
    third = wire.KVHandle("prefill-0", "tcp", "10.0.0.1:9", [8, 9], 32, 30.0, "t3", "01" * 16)
    w.core.apply(wire.AddRequest("t3", conversation[:32], params, output_token_ids=[3000], kv=third))
    w.engine.admit_remote_kv()
    assert w.core.pulls_to_start() == []
    assert w.messages(wire.KVPulled)[-1] == wire.KVPulled("t3", True, 0, 0.0, None, transport="tcp")
    while w.engine.has_unfinished:
        w.step()
    assert [m.request_id for m in w.messages(wire.Tokens) if m.finish_reason] == ["t1", "t2", "t3"]
    assert w.engine.stats().kv_blocks_used == 0 and w.engine.stats().prefix_hits == 32 + 32


def test_a_failed_pull_is_reported_and_fails_the_request_never_recomputed_silently() -> None:
    w = Worker(Role.DECODE, importer=True)
    handle = wire.KVHandle("prefill-0", "tcp", "10.0.0.1:9", [0, 1], 20, 30.0, "r", "01" * 16)
    w.core.apply(add("r", 20, output_token_ids=[1020], kv=handle))
    w.engine.admit_remote_kv()
    w.core.pulls_to_start()
    w.core.apply(KVDone("r", False, "connection refused", transport="tcp"))
    pulled, failed = w.sent
    assert pulled == (wire.KVPulled("r", False, 0, 0.0, "connection refused", transport="tcp"), False)
    assert failed == (wire.Tokens("r", [], "error", error="KV transfer failed: connection refused"), True)
    assert w.core.kv_failures == 1 and w.engine.stats().kv_blocks_used == 0


def test_requests_this_worker_cannot_serve_are_refused_as_invalid() -> None:
    handle = wire.KVHandle("prefill-0", "tcp", "10.0.0.1:9", [0, 1], 20, 30.0, "r", "01" * 16)
    no_importer = Worker(Role.MIXED)
    no_importer.core.apply(add("a", 20, output_token_ids=[1020], kv=handle))
    wrong_length = Worker(Role.DECODE, importer=True)
    wrong_length.core.apply(add("b", 25, output_token_ids=[1020], kv=handle))
    for w, why in (
        (no_importer, "does not take KV"),
        (wrong_length, "holds 20 tokens, the request needs 25"),
    ):
        ((refusal, final),) = w.sent
        assert isinstance(refusal, wire.Tokens) and refusal.invalid and final and why in str(refusal.error)
        assert w.engine.stats().num_waiting == 0


def test_forget_drops_what_is_kept_to_read_another_workers_kv_but_never_its_own() -> None:
    w = Worker(Role.DECODE, importer=True)
    w.core.apply(wire.Forget("127.0.0.1:9"))  # its own address: nothing to forget
    w.core.apply(wire.Forget("10.0.0.1:9"))
    assert w.importer is not None and w.importer.forgotten == ["10.0.0.1:9"]
    w.core.apply(wire.Shutdown())
    assert w.core.stop_asked
