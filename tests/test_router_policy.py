"""Routing decisions: pure functions, no sockets."""

import pytest

from pdserve.costmodel import Step, StepCostModel
from pdserve.router import policy
from pdserve.router.policy import DecodeView, PrefillView, choose_decode, choose_path, choose_prefill


def test_short_prompts_or_an_empty_prefill_pool_take_the_local_path() -> None:
    assert choose_path(16, 16, prefill_available=True) == "local"
    assert choose_path(17, 16, prefill_available=True) == "remote"
    assert choose_path(5000, 16, prefill_available=False) == "local"


def test_prefill_goes_where_the_fewest_prompt_tokens_wait() -> None:
    workers = [PrefillView("p0", 900, 0), PrefillView("p1", 100, 0), PrefillView("p2", 0, 800)]
    chosen = choose_prefill(workers)
    assert chosen is not None and chosen.worker_id == "p1"
    assert choose_prefill([]) is None


def test_decode_goes_to_the_least_loaded_worker_with_room() -> None:
    workers = [
        DecodeView("d0", active_requests=3, kv_blocks_free=500, kv_blocks_total=1000),
        DecodeView("d1", active_requests=1, kv_blocks_free=2, kv_blocks_total=1000),
        DecodeView("d2", active_requests=1, kv_blocks_free=400, kv_blocks_total=1000),
    ]
    assert choose_decode(workers).worker_id == "d2"  # type: ignore[union-attr]
    # d2 lacks room for a 450-block prompt: d0 has it even though it is busier.
    assert choose_decode(workers, blocks_needed=450).worker_id == "d0"  # type: ignore[union-attr]
    # Nobody has room: still the least loaded rather than nothing (its scheduler will queue it).
    assert choose_decode(workers, blocks_needed=5000).worker_id == "d2"  # type: ignore[union-attr]
    assert choose_decode([]) is None


def test_a_prompt_goes_where_it_is_cached_unless_that_worker_is_much_busier() -> None:
    # Prefill: queued tokens and the prompt's own uncached tokens weigh alike.
    prefill = [PrefillView("p0", 300, 0, cached=512), PrefillView("p1", 0, 0, cached=0)]
    assert choose_prefill(prefill).worker_id == "p0"  # type: ignore[union-attr]  # 300 - 512 < 0
    prefill = [PrefillView("p0", 900, 0, cached=512), PrefillView("p1", 0, 0, cached=0)]
    assert choose_prefill(prefill).worker_id == "p1"  # type: ignore[union-attr]
    # Decode: the worker holding the conversation, within a few streams of the least loaded.
    holder = DecodeView("d0", active_requests=4, kv_blocks_free=500, kv_blocks_total=1000, cached=1024)
    idle = DecodeView("d1", active_requests=2, kv_blocks_free=500, kv_blocks_total=1000)
    assert choose_decode([holder, idle]).worker_id == "d0"  # type: ignore[union-attr]
    busy_holder = DecodeView("d0", active_requests=9, kv_blocks_free=500, kv_blocks_total=1000, cached=1024)
    assert choose_decode([busy_holder, idle]).worker_id == "d1"  # type: ignore[union-attr]
    assert policy.cache_stream_slack(2) == 2 and policy.cache_stream_slack(40) == 10
    # Of two holders, the one with more of it.
    other = DecodeView("d2", active_requests=2, kv_blocks_free=500, kv_blocks_total=1000, cached=256)
    assert choose_decode([holder, idle, other]).worker_id == "d0"  # type: ignore[union-attr]


def test_rebalance_moves_from_the_busiest_until_counts_differ_by_at_most_one() -> None:
    assert policy.plan_rebalance({"a": 16, "b": 0}) == {"a": 8}
    assert policy.plan_rebalance({"a": 9, "b": 0}) == {"a": 4}  # 5 and 4
    assert policy.plan_rebalance({"a": 10, "b": 6, "c": 2}) == {"a": 4}  # 6, 6, 6
    assert policy.plan_rebalance({"a": 7, "b": 7, "c": 0}) == {"a": 2, "b": 2}  # 5, 5, 4
    assert policy.plan_rebalance({"a": 3, "b": 2}) == {}  # balanced enough: a move costs a gap
    assert policy.plan_rebalance({"a": 5}) == {}
    assert policy.plan_rebalance({}) == {}


# -- the path, by the cost model -------------------------------------------------------------------
def _machine() -> StepCostModel:
    """A cost model fitted to a made-up worker: 20 ms a step, 2 ms a prompt token, 3 ms a stream."""
    model = StepCostModel(min_samples=10)
    for tokens in (32, 64, 128, 256, 512):
        model.add(Step(tokens, 0), 0.02 + 0.002 * tokens)
    for streams in (1, 4, 8, 16, 32):
        model.add(Step(0, 0, streams, 0), 0.02 + 0.003 * streams)
    return model


IDLE_DECODE = policy.DecodeCandidate("d0", streams=0, context_per_stream=0, ahead=(), chunk=512, budget=2048)
# A prefill worker with two 2000-token prompts queued, one 256-token chunk a step: ~8.5 s of queue.
BUSY_PREFILL = policy.PrefillCandidate("p0", (2000, 2000), chunk=256, budget=256)


def _decode(streams: int, ahead: tuple[int, ...] = ()) -> policy.DecodeCandidate:
    """A decode worker with `streams` streams of 300 tokens each and `ahead` prompts prefilling."""
    return policy.DecodeCandidate(
        "d0", streams=streams, context_per_stream=300, ahead=ahead, chunk=512, budget=2048
    )


def test_before_the_model_is_ready_the_fixed_threshold_decides() -> None:
    cold = StepCostModel()
    prefill = policy.PrefillCandidate("p0", (), 256, 2048)
    assert policy.choose_path_by_cost(cold, 10, prefill, IDLE_DECODE, None, 16).path == "local"
    choice = policy.choose_path_by_cost(cold, 100, prefill, IDLE_DECODE, None, 16)
    assert (choice.path, choice.reason, choice.predicted_ttft) == ("remote", "cold", None)
    no_prefill = policy.choose_path_by_cost(_machine(), 5000, None, IDLE_DECODE, None, 16)
    assert (no_prefill.path, no_prefill.reason) == ("local", "no_prefill_worker")


def test_a_chat_goes_local_when_the_prefill_worker_is_busy_and_the_stall_fits() -> None:
    model = _machine()
    decode = _decode(4)
    choice = policy.choose_path_by_cost(
        model, 120, BUSY_PREFILL, decode, itl_budget_s=1.0, local_prefill_threshold=16
    )
    assert (choice.path, choice.reason) == ("local", "cost_model")
    assert choice.local_ttft is not None and choice.remote_ttft is not None
    assert choice.local_ttft < choice.remote_ttft
    assert choice.predicted_ttft == choice.local_ttft and choice.alone_s is not None


def test_a_next_turn_goes_local_where_its_conversation_is_cached() -> None:
    # A 1200-token conversation whose first 1152 tokens the decode worker holds (it decoded the
    # last answer there): computing the rest there beats prefilling all of it on an idle prefill
    # worker, and only the rest's steps count against the ITL budget.
    model = _machine()
    idle_prefill = policy.PrefillCandidate("p0", (), chunk=256, budget=2048)
    holder = policy.DecodeCandidate("d0", 4, 300, (), chunk=512, budget=2048, cached=1152)
    choice = policy.choose_path_by_cost(
        model, 1200, idle_prefill, holder, itl_budget_s=1.0, local_prefill_threshold=16
    )
    assert (choice.path, choice.reason) == ("local", "cost_model")
    cold = policy.choose_path_by_cost(
        model, 1200, idle_prefill, _decode(4), itl_budget_s=1.0, local_prefill_threshold=16
    )
    assert cold.path == "remote"  # nothing cached there: all 1200 tokens beside its streams
    assert (
        choice.local_ttft is not None
        and cold.remote_ttft is not None
        and choice.local_ttft < cold.remote_ttft / 3
    )
    # The prefill worker's own cache counts for the remote path the same way.
    warm_prefill = policy.PrefillCandidate("p0", (), chunk=256, budget=2048, cached=1152)
    remote = policy.choose_path_by_cost(model, 1200, warm_prefill, _decode(4), None, 16)
    assert remote.remote_ttft is not None and remote.remote_ttft < cold.remote_ttft / 3


def test_a_chat_goes_remote_to_a_busy_prefill_worker_that_interrupts_its_steps_for_it() -> None:
    # The same busy prefill worker, but one that runs a short prompt between two layers of its
    # long chunk (wire.Ready.prefill_interrupts): the chat waits for no chunk there, so it spares
    # the decode worker's streams.
    model = _machine()
    interrupting = policy.PrefillCandidate("p0", (2000, 2000), chunk=256, budget=256, interrupts=True)
    choice = policy.choose_path_by_cost(
        model, 120, interrupting, _decode(4), itl_budget_s=1.0, local_prefill_threshold=16
    )
    assert (choice.path, choice.reason) == ("remote", "cost_model")
    assert choice.remote_ttft is not None and choice.alone_s is not None
    assert choice.remote_ttft == pytest.approx(choice.alone_s)


def test_a_local_prefill_goes_in_chunks_whose_steps_fit_the_itl_budget() -> None:
    model = _machine()
    decode = _decode(16)
    choice = policy.choose_path_by_cost(
        model, 400, BUSY_PREFILL, decode, itl_budget_s=0.1, local_prefill_threshold=16
    )
    # A step of 17 streams is 71 ms: 29 ms, or 14 prompt tokens, are left in a 100 ms budget.
    assert (choice.path, choice.reason, choice.chunk) == ("local", "cost_model", 14)
    assert choice.stall_s is not None and choice.stall_s <= 0.1
    assert choice.step_budget_s == 0.1  # for the decode worker to size each chunk as streams change
    assert choice.local_ttft is not None and choice.remote_ttft is not None
    assert choice.local_ttft < choice.remote_ttft
    # Without an ITL SLO the budget is 1.5x the worker's own step: chunks of that size.
    default = policy.choose_path_by_cost(model, 400, BUSY_PREFILL, decode, None, 16)
    assert default.path == "local" and 0 < default.chunk < 400
    assert default.stall_s is not None and default.stall_s <= 1.5 * model.decode_step_seconds(16, 300) + 1e-9


def test_steps_that_ran_longer_than_predicted_shrink_a_local_prefill_s_chunks() -> None:
    model = _machine()
    decode = _decode(16)
    before = policy.choose_path_by_cost(
        model, 400, BUSY_PREFILL, decode, itl_budget_s=0.1, local_prefill_threshold=16
    )
    assert (before.path, before.chunk, before.stall_margin) == ("local", 14, 1.0)
    # Prompt chunks beside streams come out 25% slower than the fit says (interference the linear
    # model cannot see): 20 of them, and the budget the chunks must fit shrinks by that much.
    for tokens in range(4, 24):
        step = Step(tokens, 0, 16, 4800)
        model.add(step, 1.25 * model.step_seconds(step))
    after = policy.choose_path_by_cost(
        model, 400, BUSY_PREFILL, decode, itl_budget_s=0.1, local_prefill_threshold=16
    )
    assert after.stall_margin == pytest.approx(1.25, rel=0.05)
    assert after.path == "local" and after.chunk < before.chunk
    assert after.step_budget_s == 0.1  # the worker applies its own model's margin to the budget
    assert after.stall_s is not None and 1.25 * after.stall_s <= 0.1 * 1.05  # what the steps will take


def test_local_is_refused_when_not_even_one_token_fits_beside_the_streams() -> None:
    model = _machine()
    crowded = _decode(32)
    choice = policy.choose_path_by_cost(
        model, 400, BUSY_PREFILL, crowded, itl_budget_s=0.1, local_prefill_threshold=16
    )
    assert (choice.path, choice.reason, choice.chunk) == ("remote", "stall", 0)  # its step is 116 ms


def test_prompts_already_prefilling_on_the_decode_worker_count_in_its_step() -> None:
    model = _machine()
    prefilling = _decode(4, ahead=(1000,))
    choice = policy.choose_path_by_cost(
        model, 400, BUSY_PREFILL, prefilling, itl_budget_s=0.25, local_prefill_threshold=16
    )
    # The prompt ahead takes full 512-token chunks: every step with both breaks 250 ms.
    assert (choice.path, choice.reason) == ("remote", "stall")


def test_an_idle_prefill_worker_takes_long_prompts() -> None:
    model = _machine()
    idle = policy.PrefillCandidate("p0", (), chunk=256, budget=2048)
    decode = _decode(8)
    choice = policy.choose_path_by_cost(
        model, 1500, idle, decode, itl_budget_s=0.5, local_prefill_threshold=16
    )
    assert (choice.path, choice.reason) == ("remote", "cost_model")


def test_a_few_tokens_on_an_idle_decode_worker_go_local_as_the_threshold_did() -> None:
    model = _machine()
    idle = policy.PrefillCandidate("p0", (), chunk=256, budget=2048)
    assert policy.choose_path_by_cost(model, 8, idle, IDLE_DECODE, None, 16).path == "local"


def test_a_long_prompt_on_an_idle_decode_worker_keeps_its_steps_within_the_itl_budget() -> None:
    # Nothing streams there now, but whatever arrives during a 2000-token prefill shares its steps.
    model = _machine()
    busy = policy.PrefillCandidate("p0", (2000, 2000, 2000), chunk=256, budget=256)
    choice = policy.choose_path_by_cost(
        model, 2000, busy, IDLE_DECODE, itl_budget_s=0.25, local_prefill_threshold=16
    )
    assert choice.path == "local" and choice.chunk == 113  # (250 - 20 - 3 ms) / 2 ms a token
    assert choice.stall_s is not None and choice.stall_s <= 0.25
    tight = policy.choose_path_by_cost(
        model, 2000, busy, IDLE_DECODE, itl_budget_s=0.02, local_prefill_threshold=16
    )
    assert (tight.path, tight.reason) == ("remote", "stall")  # a step is 20 ms before any token


def test_without_a_prefill_worker_the_local_path_still_carries_its_prediction() -> None:
    # Colocated, or a prefill pool at 0: the planner's demand and --reject-on-slo-miss need it.
    choice = policy.choose_path_by_cost(_machine(), 300, None, IDLE_DECODE, None, 16)
    assert (choice.path, choice.reason) == ("local", "no_prefill_worker")
    assert choice.predicted_ttft is not None and choice.alone_s is not None
    assert choice.predicted_ttft == pytest.approx(choice.alone_s)  # idle worker: its own time
    cold = policy.choose_path_by_cost(StepCostModel(), 300, None, IDLE_DECODE, None, 16)
    assert (cold.path, cold.reason, cold.predicted_ttft) == ("local", "no_prefill_worker", None)
