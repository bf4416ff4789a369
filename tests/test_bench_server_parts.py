"""A run's TTFT parts from a pdserve server's /metrics: the difference of two scrapes, per part;
nothing from a server without the metric."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest

from pdserve.bench import server_parts


def exposition(observations: dict[str, list[float]]) -> str:
    registry = CollectorRegistry()
    histogram = Histogram(
        server_parts.METRIC.removesuffix("_seconds") + "_seconds", "parts", ("part",), registry=registry
    )
    for part, values in observations.items():
        for value in values:
            histogram.labels(part).observe(value)
    return generate_latest(registry).decode()


def test_the_parts_of_a_run_are_what_happened_between_the_scrapes() -> None:
    before = server_parts.totals(exposition({"prefill_queue": [1.0], "kv_transfer": [0.5]}))
    after = server_parts.totals(
        exposition({"prefill_queue": [1.0, 0.1, 0.3], "kv_transfer": [0.5], "first_decode": [0.02]})
    )
    assert server_parts.parts(before, after) == {
        "prefill_queue": {"mean_ms": 200.0, "count": 2},
        "first_decode": {"mean_ms": 20.0, "count": 1},
    }  # kv_transfer: nothing new in this run


def test_an_answer_without_the_metric_gives_no_parts() -> None:
    assert server_parts.totals("# nothing here\n") == {}
    assert server_parts.parts({}, {}) == {}
    assert server_parts.summary_section(None, {}) is None  # a server that had no /metrics to read
