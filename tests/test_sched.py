"""Scheduler: pure Python, no torch. Every test ends with a leak check: every block free."""

import random
import subprocess
import sys
import time
from collections.abc import Callable

import pytest

from pdserve.config import Role
from pdserve.costmodel import Step, chunk_attention
from pdserve.engine.kv import KVCacheManager
from pdserve.engine.request import Request, RequestStatus
from pdserve.engine.sched import MIN_TIMED_CHUNK, Scheduler
from pdserve.engine.sched_types import Handover, SchedulerConfig, SchedulerOutput
from pdserve.sampling_params import SamplingParams

EOS = 0


def make(
    role: Role = Role.MIXED,
    blocks: int = 64,
    block_size: int = 4,
    clock: Callable[[], float] = time.monotonic,
    prefix_cache: bool = False,
    **kw: int,
) -> Scheduler:
    config = SchedulerConfig(max_model_len=kw.pop("max_model_len", 1024), role=role, **kw)
    return Scheduler(config, KVCacheManager(blocks, block_size, prefix_cache), clock)


def req(rid: str, prompt_len: int, max_tokens: int = 4, **kw: object) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(rid, list(range(1, prompt_len + 1)), params, (EOS,), **kw)  # type: ignore[arg-type]


def run_step(s: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[Request]]:
    out = s.schedule()
    sampled = {c.request.request_id: token for c in out.chunks if c.sample}
    return out, s.update_from_output(out, sampled)


def drain(s: Scheduler, max_steps: int = 1000) -> None:
    for _ in range(max_steps):
        if not s.has_unfinished:
            return
        run_step(s)
    raise AssertionError("scheduler did not finish its requests")


def assert_no_leak(s: Scheduler) -> None:
    s.kv.check_consistency()
    assert s.kv.num_free_blocks == s.kv.num_blocks, f"{s.kv.num_used_blocks} KV blocks leaked"


def test_scheduler_and_kv_manager_never_import_torch() -> None:
    code = "import sys, pdserve.engine.sched, pdserve.engine.kv, pdserve.text.detok; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_long_prompt_is_chunked_and_sampled_only_at_its_end() -> None:
    s = make(chunk_size=8, max_num_batched_tokens=100)
    s.add_request(req("a", 20))
    chunks = []
    for _ in range(3):
        out, _ = run_step(s)
        chunks.append((out.chunks[0].start, out.chunks[0].num_tokens, out.chunks[0].sample))
    assert chunks == [(0, 8, False), (8, 8, False), (16, 4, True)]
    assert s.get("a").output_token_ids == [7]  # type: ignore[union-attr]
    drain(s)
    assert_no_leak(s)


def test_a_request_s_own_chunk_limit_splits_its_prompt_further() -> None:
    s = make(chunk_size=8, max_num_batched_tokens=100)
    s.add_request(req("small", 10, max_chunk_tokens=3))
    s.add_request(req("big", 10, max_chunk_tokens=50))  # above the engine's chunk: the chunk wins
    out, _ = run_step(s)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("small", 3), ("big", 8)]
    sizes = []
    while s.get("small").num_computed_tokens < 10:  # type: ignore[union-attr]
        out, _ = run_step(s)
        sizes.append(next(c.num_tokens for c in out.chunks if c.request.request_id == "small"))
    assert sizes == [3, 3, 1]  # and then it decodes one token a step, as any request
    drain(s)
    assert_no_leak(s)


def test_mixed_role_decodes_first_then_fills_budget_with_prompt_chunks() -> None:
    s = make(chunk_size=64, max_num_batched_tokens=10)
    s.add_request(req("a", 3, max_tokens=10))
    s.add_request(req("b", 3, max_tokens=10))
    run_step(s)  # both prompts (3 + 3 tokens)
    s.add_request(req("long", 30, max_tokens=2))
    out, _ = run_step(s)
    kinds = [(c.request.request_id, c.num_tokens) for c in out.chunks]
    assert kinds == [("a", 1), ("b", 1), ("long", 8)]  # decodes first, prompt chunk takes the rest
    assert out.num_batched_tokens == 10
    drain(s)
    assert_no_leak(s)


def test_max_num_seqs_limits_the_running_batch() -> None:
    s = make(max_num_seqs=2)
    for i in range(4):
        s.add_request(req(f"r{i}", 2, max_tokens=3))
    out, _ = run_step(s)
    assert len(out.chunks) == 2 and len(s.waiting) == 2
    drain(s)
    assert_no_leak(s)


def test_stop_conditions_eos_stop_token_length_and_context() -> None:
    s = make(max_model_len=6)
    s.add_request(req("eos", 2, max_tokens=10))
    _, updated = run_step(s, token=EOS)
    assert updated[0].status is RequestStatus.FINISHED_STOPPED and updated[0].stop_reason is None

    r = req("stoptok", 2, max_tokens=10)
    r.sampling_params.stop_token_ids = [9]
    s.add_request(r)
    _, updated = run_step(s, token=9)
    assert updated[0].status is RequestStatus.FINISHED_STOPPED and updated[0].stop_reason == 9

    s.add_request(req("ctx", 4, max_tokens=10))  # context 6: 2 tokens then out of room
    drain(s)
    assert s.get("ctx") is None
    assert_no_leak(s)


def test_min_tokens_holds_off_eos_and_stop_tokens_but_not_max_tokens() -> None:
    s = make()
    r = req("a", 2, max_tokens=6)
    r.sampling_params.min_tokens = 3
    r.sampling_params.stop_token_ids = [9]
    s.add_request(r)
    for token in (EOS, 9, EOS):  # the first three cannot end it
        _, updated = run_step(s, token=token)
        assert updated[0].status is RequestStatus.RUNNING
    _, updated = run_step(s, token=9)  # the fourth can
    assert updated[0].status is RequestStatus.FINISHED_STOPPED and updated[0].stop_reason == 9
    short = req("b", 2, max_tokens=2)
    short.sampling_params.min_tokens = 2
    s.add_request(short)
    drain(s)
    assert short.status is RequestStatus.FINISHED_LENGTH and len(short.output_token_ids) == 2
    assert_no_leak(s)


def test_ignore_eos_keeps_going_to_max_tokens() -> None:
    s = make()
    r = req("a", 2, max_tokens=3)
    r.sampling_params.ignore_eos = True
    s.add_request(r)
    for _ in range(3):
        run_step(s, token=EOS)
    assert r.output_token_ids == [EOS, EOS, EOS] and r.status is RequestStatus.FINISHED_LENGTH
    assert_no_leak(s)


def test_preemption_when_blocks_run_out_recomputes_prompt_and_outputs() -> None:
    # 6 blocks of 4: two requests of 8-token prompts fill 4 blocks; decoding grows them until
    # one must give its blocks back.
    s = make(blocks=6, block_size=4, max_num_batched_tokens=64)
    a, b = req("a", 8, max_tokens=8), req("b", 8, max_tokens=8)
    s.add_request(a)
    s.add_request(b)
    preempted: list[str] = []
    for _ in range(200):
        if not s.has_unfinished:
            break
        out, _ = run_step(s)
        preempted += out.preempted
        s.kv.check_consistency()
    assert preempted and preempted[0] == "b"  # the latest arrival goes first
    assert b.num_preemptions >= 1
    assert a.output_token_ids == [7] * 8 and b.output_token_ids == [7] * 8
    assert_no_leak(s)


def test_request_that_preempts_itself_waits_and_completes() -> None:
    s = make(blocks=3, block_size=4, max_num_batched_tokens=64)
    s.add_request(req("a", 4, max_tokens=8))
    s.add_request(req("b", 4, max_tokens=8))
    drain(s)
    assert s.num_preemptions >= 1
    assert_no_leak(s)


def test_abort_frees_blocks_wherever_the_request_is() -> None:
    s = make(chunk_size=4, max_num_seqs=1)
    s.add_request(req("running", 12))
    s.add_request(req("waiting", 4))
    run_step(s)
    assert s.kv.num_used_blocks > 0
    assert s.abort("running") is not None and s.abort("waiting") is not None
    assert s.abort("unknown") is None
    assert not s.has_unfinished
    assert_no_leak(s)


def test_prefill_role_stops_after_first_token_and_holds_blocks_until_release() -> None:
    s = make(role=Role.PREFILL)
    s.add_request(req("a", 10, max_tokens=5))
    _, updated = run_step(s, token=42)
    assert updated[0].status is RequestStatus.PREFILLED and updated[0].output_token_ids == [42]
    assert not s.has_unfinished
    assert s.kv.block_table("a") == [0, 1, 2]  # the prompt's 10 tokens, held
    assert s.stats().num_held == 1
    assert s.schedule().is_empty  # never decodes
    assert s.release("a") and not s.release("a")
    assert_no_leak(s)


def test_prefill_role_first_token_eos_finishes_and_frees() -> None:
    s = make(role=Role.PREFILL)
    s.add_request(req("a", 10))
    _, updated = run_step(s, token=EOS)
    assert updated[0].status is RequestStatus.FINISHED_STOPPED
    assert_no_leak(s)


def test_decode_role_receives_prompt_kv_then_decodes() -> None:
    s = make(role=Role.DECODE)
    r = req("a", 10, max_tokens=3, remote_kv=True)
    r.output_token_ids.append(42)  # sampled by the prefill worker
    s.add_request(r)
    out = s.schedule()
    assert out.is_empty and out.kv_to_receive == [("a", [0, 1, 2])]
    assert r.status is RequestStatus.WAITING_FOR_REMOTE_KV and s.stats().num_receiving_kv == 1
    assert s.schedule().is_empty  # nothing runs until the KV has arrived
    s.remote_kv_done("a", ok=True)
    out, _ = run_step(s)
    assert [(c.start, c.num_tokens, c.sample) for c in out.chunks] == [(10, 1, True)]
    drain(s)
    assert r.output_token_ids == [42, 7, 7] and r.status is RequestStatus.FINISHED_LENGTH
    assert_no_leak(s)


def remote(rid: str, prompt_len: int, max_tokens: int = 3) -> Request:
    r = req(rid, prompt_len, max_tokens=max_tokens, remote_kv=True)
    r.output_token_ids.append(42)  # sampled by the prefill worker
    return r


def test_decode_role_admits_remote_kv_between_steps_so_a_newcomer_joins_the_next_step() -> None:
    s = make(role=Role.DECODE)
    s.add_request(remote("running", 8, max_tokens=10))
    s.admit_remote_kv()
    s.remote_kv_done("running", ok=True)
    run_step(s)
    s.add_request(remote("new", 10))
    # Blocks and the pull before any step: once the KV is in, the next step decodes both.
    assert s.admit_remote_kv() == [("new", [3, 4, 5])]  # "running" holds 0-2
    assert s.get("new").status is RequestStatus.WAITING_FOR_REMOTE_KV  # type: ignore[union-attr]
    s.remote_kv_done("new", ok=True)
    out, _ = run_step(s)
    assert sorted(c.request.request_id for c in out.chunks) == ["new", "running"]
    assert not out.kv_to_receive  # admitted once, not again by schedule()
    drain(s)
    assert_no_leak(s)


def test_admitting_remote_kv_keeps_arrival_order_and_the_limits() -> None:
    s = make(role=Role.DECODE, blocks=6, max_num_seqs=2)
    s.add_request(req("local", 5, max_tokens=2))
    s.add_request(remote("behind-local", 4))
    assert s.admit_remote_kv() == []  # the local prompt ahead of it goes first, in a step
    out, _ = run_step(s)
    assert out.kv_to_receive == [("behind-local", [2])]  # the step admits it behind the prompt
    assert s.admit_remote_kv() == []  # once
    s.add_request(remote("too-many", 4))
    assert s.admit_remote_kv() == []  # max_num_seqs: local + behind-local
    s.abort("too-many")
    s.remote_kv_done("behind-local", ok=True)
    drain(s)
    s.add_request(remote("too-big", 30))  # 8 blocks > 6
    assert s.admit_remote_kv() == [] and s.get("too-big").status is RequestStatus.WAITING  # type: ignore[union-attr]
    s.abort("too-big")
    assert_no_leak(s)


def test_decode_role_failed_transfer_ends_request_and_frees_blocks() -> None:
    s = make(role=Role.DECODE)
    r = req("a", 10, remote_kv=True)
    r.output_token_ids.append(42)
    s.add_request(r)
    s.schedule()
    failed = s.remote_kv_done("a", ok=False)
    assert failed is r and r.status is RequestStatus.FINISHED_ERROR
    assert not s.has_unfinished
    assert_no_leak(s)


def test_decode_role_also_prefills_short_prompts_locally() -> None:
    s = make(role=Role.DECODE)
    s.add_request(req("local", 5, max_tokens=2))
    drain(s)
    assert_no_leak(s)


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        SchedulerConfig(max_model_len=0)
    s = make()
    s.add_request(req("a", 2))
    with pytest.raises(ValueError, match="already"):
        s.add_request(req("a", 2))
    with pytest.raises(ValueError, match="must carry the tokens"):
        s.add_request(req("b", 2, remote_kv=True))  # remote KV without the tokens sampled there
    s.abort("a")
    assert_no_leak(s)
    prefill = make(role=Role.PREFILL)
    moved = req("c", 2, remote_kv=True)
    moved.output_token_ids.append(3)
    with pytest.raises(ValueError, match="prefill-role"):
        prefill.add_request(moved)


def test_stats_count_queued_prompt_tokens() -> None:
    s = make(chunk_size=4, max_num_seqs=1)
    s.add_request(req("a", 10))
    s.add_request(req("b", 7))
    assert s.stats().queued_prompt_tokens == 17
    run_step(s)  # 4 tokens of a computed
    stats = s.stats()
    assert stats.queued_prompt_tokens == 13 and stats.num_running == 1 and stats.num_waiting == 1
    drain(s)
    assert_no_leak(s)


def test_queue_time_is_measured_from_arrival_to_first_schedule() -> None:
    s = make(max_num_seqs=1)
    first, second = req("a", 4, max_tokens=2), req("b", 4, max_tokens=2)
    s.add_request(first)
    s.add_request(second)
    run_step(s)
    assert first.queue_seconds is not None and first.queue_seconds >= 0
    assert second.queue_seconds is None  # still waiting behind max_num_seqs=1
    drain(s)
    assert second.queue_seconds is not None and second.queue_seconds >= first.queue_seconds
    assert_no_leak(s)


def test_prefill_role_lets_a_short_prompt_overtake_a_long_prompts_next_chunk() -> None:
    s = make(Role.PREFILL, blocks=256, chunk_size=8, max_num_batched_tokens=100)
    s.add_request(req("long", 40))
    out, _ = run_step(s)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("long", 8)]
    s.add_request(req("short", 5))
    out, done = run_step(s)
    # A step of the short prompt alone: its first token does not wait for the long chunk.
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("short", 5)]
    assert [r.request_id for r in done] == ["short"]
    out, _ = run_step(s)
    assert [(c.request.request_id, c.start) for c in out.chunks] == [("long", 8)]  # then it goes on
    for _ in range(10):
        run_step(s)
    for rid in ("long", "short"):
        s.release(rid)
    assert_no_leak(s)


def test_between_two_layers_only_waiting_short_prompts_below_the_bound_run() -> None:
    s = make(Role.PREFILL, blocks=256, chunk_size=8, max_num_batched_tokens=100)
    s.add_request(req("long", 40))
    running = s.schedule()  # the long prompt's first chunk: the step whose layers run now
    for rid, n in (("a", 5), ("b", 6), ("too_long", 20)):
        s.add_request(req(rid, n))
    # Fewer tokens than the bound, oldest first, prompts of one chunk at most: a then b is 11.
    first = s.schedule_between_layers(10.5)
    assert [c.request.request_id for c in first.chunks] == ["a"]
    assert [r.request_id for r in s.update_from_output(first, {"a": 7})] == ["a"]  # prefilled
    second = s.schedule_between_layers(20.0)
    assert [c.request.request_id for c in second.chunks] == ["b"]  # too_long is over a chunk
    s.update_from_output(second, {"b": 7})
    s.update_from_output(running, {})  # the step whose layers ran ends: untouched till now
    after = [(c.request.request_id, c.start) for c in s.schedule().chunks]
    assert after == [("long", 8), ("too_long", 0)]  # long went on from its 8 computed tokens
    assert s.schedule_between_layers(1.0).is_empty  # nothing is shorter than one token
    for role in (Role.DECODE, Role.MIXED):  # their steps carry streams: nothing runs inside them
        other = make(role)
        other.add_request(req("x", 3))
        assert other.schedule_between_layers(100.0).is_empty


def test_prefill_role_does_not_stall_when_a_short_prompt_cannot_start() -> None:
    s = make(Role.PREFILL, blocks=256, chunk_size=8, max_num_batched_tokens=100, max_num_seqs=1)
    s.add_request(req("long", 24))
    run_step(s)
    s.add_request(req("short", 5))  # max_num_seqs=1: it must wait for the long one
    out, _ = run_step(s)
    assert [c.request.request_id for c in out.chunks] == ["long"]
    drain_prefill = 0
    while s.has_unfinished and drain_prefill < 20:
        run_step(s)
        drain_prefill += 1
    assert not s.has_unfinished
    for rid in ("long", "short"):
        s.release(rid)
    assert_no_leak(s)


def test_hand_over_holds_a_decoding_request_until_release() -> None:
    s = make()
    s.add_request(req("a", 6, max_tokens=8))
    run_step(s)  # the prompt, and its first token
    run_step(s)  # a decode step
    assert s.hand_over("a") is Handover.HELD
    request = s.held["a"]
    assert request.status is RequestStatus.MIGRATED and request.num_tokens_to_compute == 1
    assert s.stats().num_held == 1 and s.kv.num_used_blocks == s.kv.blocks_for_tokens(7)
    assert not s.has_unfinished and s.schedule().is_empty  # it is not scheduled here any more
    assert s.hand_over("a") is Handover.UNKNOWN  # already held
    assert s.release("a") and not s.release("a")
    assert_no_leak(s)


def test_hand_over_waits_for_a_prompt_and_for_incoming_kv() -> None:
    s = make(role=Role.DECODE, chunk_size=4, max_num_batched_tokens=4)
    s.add_request(req("long", 10))
    incoming = req("in", 5, remote_kv=True)
    incoming.output_token_ids += [9, 9]  # moved here after two tokens elsewhere
    s.add_request(incoming)
    run_step(s)
    assert s.hand_over("long") is Handover.NOT_YET  # mid-prompt
    [(_, blocks)] = s.admit_remote_kv()
    assert len(blocks) == s.kv.blocks_for_tokens(6)  # prompt + outputs, but the last
    assert s.hand_over("in") is Handover.NOT_YET  # its KV is on its way
    s.remote_kv_done("in", ok=True)
    assert incoming.num_computed_tokens == 6
    assert s.hand_over("in") is Handover.HELD
    while s.hand_over("long") is Handover.NOT_YET:
        run_step(s)
    s.release("in")
    s.release("long")
    assert_no_leak(s)


def test_a_queued_request_is_handed_back_with_nothing_to_move() -> None:
    s = make(max_num_seqs=1)
    s.add_request(req("running", 3))
    s.add_request(req("queued", 3))
    run_step(s)
    assert s.hand_over("queued") is Handover.NO_KV
    assert s.get("queued") is None and s.hand_over("nope") is Handover.UNKNOWN
    drain(s)
    assert_no_leak(s)


# -- a local prefill's chunks sized to its step budget (decode role) --------------------------------
def trained(steps: int = 40) -> Scheduler:
    """A decode scheduler whose step model knows steps cost 10 ms + 1 ms a prompt token + 10 ms a
    stream (exactly: its under-prediction margin stays 1), on a clock that stands still: a stream
    has waited exactly what a test says, however slow the machine (a request made later keeps its
    real, later time: it has waited nothing)."""
    now = time.monotonic()
    s = make(role=Role.DECODE, blocks=256, chunk_size=512, max_num_batched_tokens=2048, clock=lambda: now)
    for i in range(steps):
        tokens, streams, context = (i % 4) * 20, i % 3, (i % 5) * 40
        s.observe_step(
            Step(tokens, chunk_attention(0, tokens), streams, context),
            0.01 + 0.001 * tokens + 0.01 * streams,
        )
    return s


def streams(s: Scheduler, n: int, max_tokens: int = 50) -> list[Request]:
    """`n` streams decoding (their prompts' KV came from a prefill worker)."""
    running = [remote(f"s{i}", 8, max_tokens=max_tokens) for i in range(n)]
    for r in running:
        s.add_request(r)
    for rid, _ in s.admit_remote_kv():
        s.remote_kv_done(rid, ok=True)
    return running


def prompt_tokens(out: SchedulerOutput) -> int:
    return sum(c.num_tokens for c in out.chunks if not c.is_decode)


def test_a_local_prefill_s_chunk_is_what_its_streams_leave_of_the_step_budget() -> None:
    s = trained()
    running = streams(s, 2)
    s.add_request(req("chat", 300, max_tokens=2, max_step_seconds=0.1005))
    out, _ = run_step(s)
    # 10 ms + 2 streams x 10 ms + n x 1 ms <= 100.5 ms: 70 tokens (no weight on attention, context)
    assert prompt_tokens(out) == 70 and len(out.chunks) == 3
    s.abort(running[0].request_id)  # one stream fewer: the next chunk takes its 10 ms
    out, _ = run_step(s)
    assert prompt_tokens(out) == 80
    for r in running[1:]:
        s.abort(r.request_id)
    out, _ = run_step(s)
    assert prompt_tokens(out) == 150  # no stream to stall: the rest, up to the chunk size
    drain(s)
    assert_no_leak(s)


def test_a_stream_that_already_waited_gets_a_step_of_decodes_alone() -> None:
    s = trained()
    [stream] = streams(s, 1)
    s.add_request(req("chat", 300, max_tokens=2, max_step_seconds=0.1005))
    run_step(s)
    stream.last_token_time -= 0.08  # as if it came from a prefill worker during a long step here
    out, _ = run_step(s)
    assert prompt_tokens(out) == 0 and [c.request for c in out.chunks] == [stream]
    out, _ = run_step(s)  # fresh again: the prompt goes on
    assert prompt_tokens(out) == 80
    stream.last_token_time -= 0.03  # waited some: a smaller chunk, not none
    out, _ = run_step(s)
    assert prompt_tokens(out) == 50
    drain(s)
    assert_no_leak(s)


def test_a_local_prefill_always_gets_on_and_without_a_model_takes_the_router_s_chunk() -> None:
    s = trained()
    streams(s, 9)  # 10 + 90 ms of decoding: no token fits a 100 ms budget
    s.add_request(req("chat", 40, max_tokens=2, max_step_seconds=0.1005))
    out, _ = run_step(s)
    assert prompt_tokens(out) == MIN_TIMED_CHUNK  # the streams are fresh: it still moves on
    cold = trained(steps=0)
    streams(cold, 2)
    cold.add_request(req("chat", 300, max_tokens=2, max_step_seconds=0.1005, max_chunk_tokens=24))
    out, _ = run_step(cold)
    assert prompt_tokens(out) == 24
    for sched in (s, cold):
        drain(sched)
        assert_no_leak(sched)


def test_the_scheduler_keeps_the_time_of_the_clock_it_is_given() -> None:
    """A simulation steps the real scheduler on a virtual clock: every time it records is that
    clock's."""
    now = [100.0]
    s = make(clock=lambda: now[0])
    r = req("a", 6, max_tokens=3)
    s.add_request(r)
    now[0] = 102.5
    run_step(s)
    assert r.first_scheduled_time == 102.5
    now[0] = 103.0
    run_step(s)
    assert r.last_token_time == 103.0
    drain(s)
    assert_no_leak(s)


# -- prefix caching -------------------------------------------------------------------------------
def test_a_prompt_whose_prefix_is_cached_computes_only_the_rest() -> None:
    s = make(block_size=4, prefix_cache=True)
    s.add_request(req("a", 10, max_tokens=2))  # tokens 1..10; its KV: 1..10 and its first output
    drain(s)
    s.add_request(req("b", 14))  # tokens 1..14: blocks [1..4] and [5..8] are cached
    out, _ = run_step(s)
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(8, 6)]
    stats = s.stats()
    assert (stats.prefix_queries, stats.prefix_hits) == (10 + 14, 8)
    drain(s)
    assert_no_leak(s)
    # A prompt all cached: its last block is computed again (a step must yield logits to sample).
    s.add_request(req("c", 8))
    out, _ = run_step(s)
    assert [(c.start, c.num_tokens, c.sample) for c in out.chunks] == [(4, 4, True)]
    drain(s)
    assert_no_leak(s)


def test_the_next_turn_of_a_conversation_finds_the_tokens_generated_in_the_last() -> None:
    s = make(block_size=4, prefix_cache=True)
    first = req("turn1", 6, max_tokens=8)
    s.add_request(first)
    drain(s)
    conversation = first.prompt_token_ids + first.output_token_ids  # 14 tokens, 13 with KV
    params = SamplingParams(max_tokens=2, temperature=0.0)
    s.add_request(Request("turn2", [*conversation, 50, 51, 52], params, (EOS,)))
    out, _ = run_step(s)
    assert out.chunks[0].start == 12  # three blocks, two of them holding generated tokens
    drain(s)
    assert_no_leak(s)


def test_kv_that_arrived_from_a_prefill_worker_is_this_decode_worker_s_cache() -> None:
    s = make(role=Role.DECODE, block_size=4, prefix_cache=True)
    s.add_request(remote("a", 10, max_tokens=3))
    s.admit_remote_kv()
    s.remote_kv_done("a", ok=True)
    drain(s)
    # Its next turn, prefilled here: 1..10 came by the pull, 42 and 7 were decoded here.
    nxt = req("b", 10)
    nxt.prompt_token_ids += [42, 7, 7, 60]
    s.add_request(nxt)
    out, _ = run_step(s)
    assert out.chunks[0].start == 12
    drain(s)
    assert_no_leak(s)


def test_under_pressure_a_shared_or_cached_block_is_never_written() -> None:
    # Conversations that share prefixes, in a cache too small for all of them: blocks are shared,
    # evicted and preempted. No step may write a block another request holds, and every request
    # still gets its tokens.
    rng = random.Random(3)
    s = make(blocks=14, block_size=4, prefix_cache=True, max_num_batched_tokens=16, chunk_size=8)
    prefixes = [[rng.randint(100, 200) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    requests = []
    for n in range(24):
        tokens = rng.choice(prefixes) + [rng.randint(1, 99) for _ in range(rng.randint(1, 10))]
        r = Request(f"r{n}", tokens, SamplingParams(max_tokens=rng.randint(1, 6), temperature=0.0), (EOS,))
        requests.append(r)
        s.add_request(r)
    for _ in range(2000):
        if not s.has_unfinished:
            break
        out = s.schedule()
        for chunk in out.chunks:
            table = s.kv.block_table(chunk.request.request_id)
            first, last = chunk.start // 4, (chunk.start + chunk.num_tokens - 1) // 4
            for block in table[first : last + 1]:
                assert s.kv._refs[block] == 1, f"{chunk.request.request_id} writes a shared block {block}"
                assert block not in s.kv._key_of, f"{chunk.request.request_id} writes a cached block {block}"
        s.update_from_output(out, {c.request.request_id: 7 for c in out.chunks if c.sample})
        s.kv.check_consistency()
    assert all(
        r.status.finished and len(r.output_token_ids) == r.sampling_params.max_tokens for r in requests
    )
    assert s.stats().prefix_hits > 0 and s.kv.evictions > 0
    assert_no_leak(s)


def test_a_remote_request_receives_only_the_blocks_it_lacks() -> None:
    s = make(role=Role.DECODE, block_size=4, prefix_cache=True)
    s.add_request(remote("a", 10, max_tokens=3))
    s.admit_remote_kv()
    s.remote_kv_done("a", ok=True)
    drain(s)  # 1..10, 42, 7 and the last 7 sampled: 12 tokens of KV, 3 full blocks
    nxt = req("b", 10, remote_kv=True)
    nxt.prompt_token_ids += [42, 7, 7, 60, 61]
    nxt.output_token_ids.append(99)  # 15 tokens of KV to receive, in 4 blocks: 3 are here already
    s.add_request(nxt)
    ((request_id, blocks),) = s.admit_remote_kv()
    assert request_id == "b" and len(blocks) == 1 and s.kv.block_table("b")[3] == blocks[0]
    s.remote_kv_done("b", ok=True)
    out, _ = run_step(s)
    assert [(c.start, c.num_tokens) for c in out.chunks] == [(15, 1)]
    assert s.stats().prefix_hits == 12
    drain(s)
    assert_no_leak(s)
