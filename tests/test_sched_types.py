"""The scheduler's vocabulary: settings that cannot work are refused with their name, a chunk
knows whether it is a decode token, and a step's output counts what it batches."""

from __future__ import annotations

import pytest

from pdserve.config import Role
from pdserve.engine.request import Request
from pdserve.engine.sched_types import (
    Handover,
    ScheduledChunk,
    SchedulerConfig,
    SchedulerOutput,
    SchedulerStats,
)
from pdserve.sampling_params import SamplingParams


def request(prompt_len: int = 10) -> Request:
    return Request("r", list(range(1, prompt_len + 1)), SamplingParams(max_tokens=4))


@pytest.mark.parametrize(
    "name", ["max_model_len", "max_num_seqs", "max_num_batched_tokens", "chunk_size", "step_cost_window"]
)
@pytest.mark.parametrize("value", [0, -3])
def test_a_setting_below_one_is_refused_by_name(name: str, value: int) -> None:
    with pytest.raises(ValueError, match=f"{name} must be >= 1, got {value}"):
        SchedulerConfig(**{"max_model_len": 128, name: value})  # type: ignore[arg-type]


def test_the_defaults_are_a_mixed_role_that_chunks_long_prompts() -> None:
    config = SchedulerConfig(max_model_len=4096)
    assert config.role is Role.MIXED
    assert config.chunk_size < config.max_num_batched_tokens <= config.max_model_len


def test_a_chunk_is_a_decode_token_only_past_the_first_position() -> None:
    r = request()
    assert ScheduledChunk(r, start=10, num_tokens=1, sample=True).is_decode
    # The first token of a one-token prompt, or a prompt's chunk: prompt work.
    assert not ScheduledChunk(r, start=0, num_tokens=1, sample=True).is_decode
    assert not ScheduledChunk(r, start=4, num_tokens=6, sample=True).is_decode


def test_an_output_counts_the_tokens_it_batches() -> None:
    empty = SchedulerOutput()
    assert empty.is_empty and empty.num_batched_tokens == 0
    r = request(100)
    out = SchedulerOutput([ScheduledChunk(r, 50, 1, True), ScheduledChunk(r, 0, 64, False)], preempted=["p"])
    assert not out.is_empty and out.num_batched_tokens == 65
    # Its lists are its own: two outputs never share one.
    assert SchedulerOutput().kv_to_receive is not SchedulerOutput().kv_to_receive


def test_a_handover_and_the_stats_say_what_they_are() -> None:
    assert {h.value for h in Handover} == {"held", "no_kv", "not_yet", "unknown"}
    stats = SchedulerStats(1, 2, 0, 0, 30, 5, 95, 0)
    assert (stats.prefix_queries, stats.prefix_hits, stats.cached_blocks) == (0, 0, 0)
    with pytest.raises(AttributeError):
        stats.num_running = 3  # type: ignore[misc]
