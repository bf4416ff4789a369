"""SLO definitions: what --slo and --slo-percentile accept."""

from __future__ import annotations

import pytest

from pdserve.errors import PdserveError
from pdserve.slo import SLO, ms_text, parse_slo


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
