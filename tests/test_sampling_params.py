"""SamplingParams: every bad value is refused up front with an error that names the field; good
values are normalized the way vLLM users expect. Pure Python."""

from __future__ import annotations

import pytest

from pdserve.errors import InvalidRequestError
from pdserve.sampling_params import SamplingParams

NAN = float("nan")


@pytest.mark.parametrize(
    "field,value",
    [
        ("max_tokens", 0),
        ("max_tokens", -3),
        ("max_tokens", 2.0),
        ("max_tokens", "16"),
        ("max_tokens", True),
        ("temperature", -0.1),
        ("temperature", NAN),
        ("temperature", "1"),
        ("temperature", True),
        ("top_p", 0.0),
        ("top_p", -0.5),
        ("top_p", 1.01),
        ("top_p", NAN),
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_k", True),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("min_p", NAN),
        ("seed", 1.0),
        ("seed", "7"),
        ("seed", False),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", NAN),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("presence_penalty", NAN),
        ("frequency_penalty", 3),
        ("frequency_penalty", -2.5),
        ("stop", [""]),
        ("stop", ""),
        ("stop", ["ok", 3]),
        ("stop", 5),
        ("stop", ("a", "b")),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", [1.0]),
        ("stop_token_ids", [True]),
        ("stop_token_ids", 7),
        ("stop_token_ids", "7"),
        ("logprobs", -1),
        ("logprobs", 21),
        ("logprobs", 1.0),
        ("logprobs", True),
        ("min_tokens", -1),
        ("min_tokens", 17),  # past the default max_tokens of 16
        ("min_tokens", 1.0),
        ("min_tokens", True),
    ],
)
def test_bad_values_are_refused_with_an_error_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError, match=field):
        SamplingParams(**{field: value})  # type: ignore[arg-type]


def test_invalid_request_error_is_a_value_error() -> None:
    # Callers that only know the standard library can still catch it.
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_tokens": 1},
        {"temperature": 0},
        {"temperature": 0.0, "top_p": 1.0},
        {"temperature": 2.5, "top_p": 1e-9},
        {"top_k": -1},
        {"top_k": 0},
        {"top_k": 1},
        {"min_p": 0.0},
        {"min_p": 1.0},
        {"seed": 0},
        {"seed": -5},
        {"repetition_penalty": 1e-3},
        {"presence_penalty": -2.0, "frequency_penalty": 2.0},
        {"stop": ["a", "bc"], "stop_token_ids": [0, 5]},
        {"logprobs": 0},
        {"logprobs": 20},
        {"min_tokens": 16},
        {"min_tokens": 0, "max_tokens": 1},
    ],
)
def test_edge_values_that_are_allowed(kwargs: dict[str, object]) -> None:
    params = SamplingParams(**kwargs)  # type: ignore[arg-type]
    for name, value in kwargs.items():
        assert getattr(params, name) == value


def test_a_single_stop_string_becomes_a_list() -> None:
    assert SamplingParams(stop="x").stop == ["x"]  # type: ignore[arg-type]
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]  # type: ignore[arg-type]
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []


def test_defaults_do_not_share_their_lists() -> None:
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []


def test_greedy_is_temperature_zero_or_about_it() -> None:
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-7).greedy
    assert not SamplingParams(temperature=0.01).greedy
    assert not SamplingParams().greedy  # the default samples, as in vLLM


def test_top_k_minus_one_and_zero_both_disable() -> None:
    assert SamplingParams(top_k=-1).effective_top_k == 0
    assert SamplingParams(top_k=0).effective_top_k == 0
    assert SamplingParams(top_k=40).effective_top_k == 40


def test_needs_penalties_only_when_one_is_set() -> None:
    assert not SamplingParams().needs_penalties
    assert SamplingParams(repetition_penalty=1.1).needs_penalties
    assert SamplingParams(presence_penalty=0.5).needs_penalties
    assert SamplingParams(frequency_penalty=-0.5).needs_penalties


def test_validate_catches_values_changed_after_construction() -> None:
    # The engine calls validate() again before queueing: a mutated object is caught there too.
    params = SamplingParams()
    params.top_p = 0.0
    with pytest.raises(InvalidRequestError, match="top_p"):
        params.validate()


def test_none_stop_and_stop_token_ids_mean_none() -> None:
    # API layers pass optional fields straight through, as vLLM accepts.
    params = SamplingParams(stop=None, stop_token_ids=None)  # type: ignore[arg-type]
    assert params.stop == [] and params.stop_token_ids == []
