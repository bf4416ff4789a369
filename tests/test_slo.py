"""SLO definitions: what --slo and --slo-percentile accept, and the one percentile (numpy's) that
the server, the planner and the bench share."""

from __future__ import annotations

import math

import numpy
import pytest

from pdserve.bench.summary import parse_slos, percentile
from pdserve.errors import PdserveError
from pdserve.slo import SLO, ms_text, parse_limits, parse_slo, quantile, request_meets


def test_slo_in_milliseconds_either_or_both() -> None:
    assert parse_slo("ttft=500,itl=50") == SLO(0.5, 0.05, 0.9)
    assert parse_slo(" itl = 40ms ", 0.99) == SLO(None, 0.04, 0.99)
    assert parse_slo(None) == SLO() and not SLO().given
    assert parse_slo("ttft=2000").given


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        ("ttft", "ttft=MS"),
        ("tpot=5", "ttft=MS"),
        ("ttft=soon", "number of milliseconds"),
        ("ttft=1,ttft=2", "given twice"),
        ("itl=0", "must be > 0"),
        ("itl=-5", "must be > 0"),
    ],
)
def test_bad_slos_are_clear_errors(text: str, fragment: str) -> None:
    with pytest.raises(PdserveError, match=fragment):
        parse_slo(text)


def test_percentile_bounds_and_pool_overrides() -> None:
    with pytest.raises(PdserveError, match="percentile"):
        parse_slo("ttft=1", 1.0)
    with pytest.raises(PdserveError, match="percentile"):
        SLO(percentile=0.2)
    base = parse_slo("ttft=1000,itl=100")
    assert base.override(itl_ms=50) == SLO(1.0, 0.05, 0.9)
    assert base.override() == base
    assert base.describe() == {"ttft_s": 1.0, "itl_s": 0.1, "percentile": 0.9}


def test_a_latency_reads_in_milliseconds_in_log_lines() -> None:
    assert (ms_text(0.2504), ms_text(None)) == ("250 ms", "-")


@pytest.mark.parametrize(
    "values", [list(range(1, 101)), [5.0], [3.0, 1.0], [0.2, 9.5, 1.1, 4.4, 4.4, 7.0, 0.01]]
)
@pytest.mark.parametrize("p", [0.0, 0.5, 0.9, 0.99, 1.0])
def test_one_percentile_for_server_planner_and_bench_as_numpy_computes_it(
    values: list[float], p: float
) -> None:
    assert quantile(values, p) == pytest.approx(float(numpy.percentile(values, p * 100)))
    assert percentile(values, p * 100) == pytest.approx(float(numpy.percentile(values, p * 100)))


def test_no_values_have_no_percentile() -> None:
    assert quantile([], 0.5) is None
    assert math.isnan(percentile([], 50))


def test_the_bench_parses_slos_as_the_server_does_with_its_own_names_besides() -> None:
    assert parse_limits("ttft=500, itl=50ms") == {"ttft": 0.5, "itl": 0.05}
    assert parse_slos("tpot=20,e2e=3000,ttft=250") == {"tpot": 0.02, "e2e": 3.0, "ttft": 0.25}
    for text, fragment in (("tpot=20", "expected ttft=MS and/or itl=MS"), ("ttft=1,ttft=2", "given twice"),
                           ("itl=fast", "a number of milliseconds"), ("ttft=0", "must be > 0 ms")):  # fmt: skip
        with pytest.raises(PdserveError, match=fragment):
            parse_limits(text)
    with pytest.raises(PdserveError, match="given twice"):
        parse_slos("e2e=1,e2e=2")


def test_a_requests_verdict_holds_each_value_to_its_limit_and_its_itl_at_its_own_p99() -> None:
    limits = {"ttft": 0.5, "itl": 0.05, "e2e": 5.0}
    gaps = [0.01] * 98 + [0.2, 0.2]  # two long gaps in 100: its p99 (interpolated) is past 50 ms
    assert request_meets(limits, ttft=0.4, itls=[0.01] * 100, e2e=2.0)
    assert not request_meets(limits, ttft=0.6, itls=[0.01] * 100, e2e=2.0)
    assert not request_meets(limits, ttft=0.4, itls=gaps, e2e=2.0)
    assert not request_meets({"e2e": 1.0}, ttft=0.1, e2e=1.5)
    # A one-token answer has no TPOT and no gaps: nothing to hold against those limits.
    assert request_meets({"tpot": 0.01, "itl": 0.01}, ttft=0.1, tpot=None)
