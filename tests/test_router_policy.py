"""Routing decisions: pure functions, no sockets."""

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


def test_rebalance_moves_from_the_busiest_until_counts_differ_by_at_most_one() -> None:
    assert policy.plan_rebalance({"a": 16, "b": 0}) == {"a": 8}
    assert policy.plan_rebalance({"a": 9, "b": 0}) == {"a": 4}  # 5 and 4
    assert policy.plan_rebalance({"a": 10, "b": 6, "c": 2}) == {"a": 4}  # 6, 6, 6
    assert policy.plan_rebalance({"a": 7, "b": 7, "c": 0}) == {"a": 2, "b": 2}  # 5, 5, 4
    assert policy.plan_rebalance({"a": 3, "b": 2}) == {}  # balanced enough: a move costs a gap
    assert policy.plan_rebalance({"a": 5}) == {}
    assert policy.plan_rebalance({}) == {}
