"""The router's metrics as /metrics shows them: a worker's series come and go with it, the cached
labelled series included."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from pdserve.router.metrics import RouterMetrics


def samples(metrics: RouterMetrics, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
        if sample.name == name
    }


def test_a_workers_load_series_go_with_it_and_come_back_with_its_next_report() -> None:
    metrics = RouterMetrics()
    running = metrics.worker_load("decode", "d0")[0]  # pdserve_worker_running_requests
    running.set(3)
    metrics.worker_load("decode", "d1")[0].set(1)
    assert samples(metrics, "pdserve_worker_running_requests") == {
        (("pool", "decode"), ("worker", "d0")): 3.0,
        (("pool", "decode"), ("worker", "d1")): 1.0,
    }

    metrics.remove_worker("decode", "d0", keep_up=True)  # down: its load is not known
    assert samples(metrics, "pdserve_worker_running_requests") == {
        (("pool", "decode"), ("worker", "d1")): 1.0
    }

    metrics.worker_load("decode", "d0")[0].set(2)  # up again: its next report shows
    assert samples(metrics, "pdserve_worker_running_requests")[(("pool", "decode"), ("worker", "d0"))] == 2.0


def test_each_pools_latency_is_counted_in_its_own_series() -> None:
    metrics = RouterMetrics()
    metrics.pool_latency("prefill")[0].observe(0.2)
    metrics.pool_latency("decode")[1].observe(0.05)
    metrics.pool_latency("decode")[1].observe(0.07)
    assert samples(metrics, "pdserve_time_to_first_token_seconds_count") == {
        (("pool", "prefill"),): 1.0,
        (("pool", "decode"),): 0.0,
    }
    assert samples(metrics, "pdserve_inter_token_latency_seconds_count") == {
        (("pool", "prefill"),): 0.0,
        (("pool", "decode"),): 2.0,
    }
