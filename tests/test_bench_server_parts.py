"""A run's TTFT parts from a pdserve server's /metrics: the difference of two scrapes, per part;
nothing from a server without the metric."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

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


def test_the_paths_of_a_run_are_counted_between_the_scrapes() -> None:
    def exposition_of(local: int, remote: int) -> str:
        registry = CollectorRegistry()
        counter = Counter(server_parts.PATHS, "paths", ("path", "reason"), registry=registry)
        counter.labels("local", "cost_model").inc(local)
        counter.labels("remote", "cost_model").inc(remote)
        counter.labels("remote", "cold").inc(2)
        return generate_latest(registry).decode()

    section = server_parts.summary_section(exposition_of(1, 10), exposition_of(4, 10))
    assert section == {"paths": {"local": 3}}  # every reason summed; remote: none in this run
    assert server_parts.summary_section(None, exposition_of(1, 1)) == {}


def test_the_prefix_caches_hit_rate_of_a_run_sums_the_pools() -> None:
    def exposition_of(queries: dict[str, int], hits: dict[str, int]) -> str:
        registry = CollectorRegistry()
        q = Counter(server_parts.PREFIX_QUERIES, "queries", ("pool",), registry=registry)
        h = Counter(server_parts.PREFIX_HITS, "hits", ("pool",), registry=registry)
        for pool, n in queries.items():
            q.labels(pool).inc(n)
        for pool, n in hits.items():
            h.labels(pool).inc(n)
        return generate_latest(registry).decode()

    before = exposition_of({"prefill": 100, "decode": 0}, {"prefill": 0, "decode": 0})
    after = exposition_of({"prefill": 600, "decode": 500}, {"prefill": 256, "decode": 384})
    section = server_parts.summary_section(before, after)
    assert section["prefix_cache"] == {"queries": 1000, "hits": 640, "hit_rate": 0.64}
    assert "prefix_cache" not in server_parts.summary_section(before, before)  # nothing looked up
    # vLLM's counters, exactly as its /metrics writes them, read the same way.
    vllm = (
        "# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.\n"
        "# TYPE vllm:prefix_cache_queries_total counter\n"
        'vllm:prefix_cache_queries_total{engine="0",model_name="m"} 2016.0\n'
        "# HELP vllm:prefix_cache_hits_total Prefix cache hits, in terms of number of cached tokens.\n"
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 1024.0\n'
    )
    assert server_parts.prefix_totals(vllm) == {
        server_parts.PREFIX_QUERIES: 2016.0,
        server_parts.PREFIX_HITS: 1024.0,
    }


def test_an_answer_without_the_metric_gives_no_parts() -> None:
    assert server_parts.totals("# nothing here\n") == {}
    assert server_parts.parts({}, {}) == {}
    assert server_parts.summary_section(None, "") == {}  # a server that had no /metrics to read
    assert server_parts.summary_section("", "not the exposition format {") == {}
