"""An answer being built: where its latency is recorded (TTFT per pool, ITL, the planner's ITL
signal that leaves out the prefill -> decode hand-off) and a worker that drops logprobs."""

from __future__ import annotations

import pytest

from pdserve import wire
from pdserve.router import openai_types as oa
from pdserve.router.answer import Answer, checked_logprobs
from pdserve.router.logprobs import LogprobsFormatter
from pdserve.router.metrics import RouterMetrics
from pdserve.router.request_state import RequestFailed, RequestState, TokenEvent
from pdserve.signals import Signals
from pdserve.text.detok import IncrementalDetokenizer


class Pieces:
    def token_piece(self, token_id: int) -> tuple[str, bytes]:
        return str(token_id), str(token_id).encode()

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(map(str, token_ids))


def answer(logprobs: bool) -> Answer:
    return Answer(
        state=RequestState("cmpl-1"),
        prompt_ids=[1, 2],
        params=wire.WireSamplingParams(max_tokens=4),
        detok=IncrementalDetokenizer(Pieces(), [1, 2]),
        builder=oa.ResponseBuilder("cmpl-1", "m", chat=False),
        stream=False,
        include_usage=False,
        ignore_eos=False,
        arrived=100.0,
        logprobs=LogprobsFormatter(Pieces(), chat=False) if logprobs else None,
    )


def test_latency_is_recorded_per_pool_and_the_hand_off_gap_is_not_an_itl_signal() -> None:
    metrics, signals = RouterMetrics(), Signals()
    run = answer(logprobs=False)
    run.token_arrived(100.5, TokenEvent([7], pool="prefill"), metrics, signals)
    run.token_arrived(101.5, TokenEvent([8], pool="decode"), metrics, signals)  # the hand-off
    run.token_arrived(101.6, TokenEvent([9, 10], pool="decode"), metrics, signals)
    assert (
        metrics.registry.get_sample_value("pdserve_time_to_first_token_seconds_sum", {"pool": "prefill"})
        == 0.5
    )
    itl_count = metrics.registry.get_sample_value(
        "pdserve_inter_token_latency_seconds_count", {"pool": "decode"}
    )
    assert itl_count == 2  # both gaps are ITLs a client saw ...
    assert signals.pool("decode").itl.values(101.6) == pytest.approx([0.1])  # ... one is the pool's
    assert metrics.registry.get_sample_value("pdserve_generation_tokens_total") == 4


def test_a_worker_that_drops_logprobs_fails_the_request() -> None:
    asked = answer(logprobs=True)
    entry = (7, -0.5, {})
    assert checked_logprobs(asked, TokenEvent([7], logprobs=[entry])) == [entry]
    assert checked_logprobs(asked, TokenEvent([], "length")) is None  # nothing to carry
    with pytest.raises(RequestFailed, match="without their logprobs"):
        checked_logprobs(asked, TokenEvent([7, 8], logprobs=[entry]))
    with pytest.raises(RequestFailed):
        checked_logprobs(asked, TokenEvent([7]))
    assert checked_logprobs(answer(logprobs=False), TokenEvent([7])) is None
