"""The router's Prometheus metrics (prometheus_client). Names and meanings: docs/metrics.md.

One registry per router (not the process-global one), so two routers in one process, as in
tests, do not share counts.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

# Latency buckets from 1 ms to 2 min: TTFT of a queued long prompt on CPU runs to tens of seconds.
_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 30.0, 60.0, 120.0,
)  # fmt: skip
_BYTES_BUCKETS = tuple(float(2**i) for i in range(10, 34, 2))  # 1 KiB .. 8 GiB

CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry

        def histogram(
            name: str, doc: str, labels: tuple[str, ...] = (), buckets: tuple[float, ...] = _LATENCY_BUCKETS
        ) -> Histogram:
            return Histogram(name, doc, labels, registry=r, buckets=buckets)

        self.ttft = histogram(
            "pdserve_time_to_first_token_seconds",
            "Request arrival to its first token, by the pool that produced it",
            ("pool",),
        )
        self.itl = histogram(
            "pdserve_inter_token_latency_seconds",
            "Gap between consecutive tokens of a stream, by the pool that streamed it",
            ("pool",),
        )
        self.tpot = histogram(
            "pdserve_time_per_output_token_seconds", "(E2E - TTFT) / (output tokens - 1), per request"
        )
        self.e2e = histogram("pdserve_e2e_request_latency_seconds", "Request arrival to its last token")
        self.queue_time = histogram(
            "pdserve_queue_time_seconds",
            "Time a request waited on a worker before it was scheduled",
            ("pool",),
        )
        self.prefill_time = histogram(
            "pdserve_prefill_time_seconds",
            "Prefill on the prefill pool: scheduled to first token, RPC included",
        )
        self.kv_transfer_time = histogram(
            "pdserve_kv_transfer_seconds",
            "One KV pull by a decode worker: a prefilled prompt's (kind=prompt) or a moving stream's (kind=stream)",
            ("transport", "kind"),
        )
        self.kv_transfer_bytes = histogram(
            "pdserve_kv_transfer_bytes", "Bytes of one KV pull", ("transport", "kind"), _BYTES_BUCKETS
        )
        self.requests = Counter(
            "pdserve_requests",
            "Finished requests by path (remote_prefill, local_prefill, colocated) and outcome "
            "(ok, error, rejected, aborted)",
            ("path", "outcome"),
            registry=r,
        )
        self.queue_rejections = Counter(
            "pdserve_queue_rejections",
            "Requests answered 429 because their pool's queued prompt tokens were at the limit",
            ("pool",),
            registry=r,
        )
        self.auth_failures = Counter(
            "pdserve_auth_failures",
            "Requests refused with 401 for a missing or wrong key, by route kind (api, admin, metrics)",
            ("route",),
            registry=r,
        )
        self.retries = Counter(
            "pdserve_request_retries", "Re-prefills of a request, by reason", ("reason",), registry=r
        )
        self.kv_transfer_failures = Counter(
            "pdserve_kv_transfer_failures",
            "KV pulls that failed or timed out",
            ("transport", "kind"),
            registry=r,
        )
        self.kv_checksum_failures = Counter(
            "pdserve_kv_checksum_failures",
            "KV pulls whose blocks arrived changed (they did not match the holder's digest); "
            "also counted in pdserve_kv_transfer_failures",
            ("transport", "kind"),
            registry=r,
        )
        self.prompt_tokens = Counter(
            "pdserve_prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.generation_tokens = Counter(
            "pdserve_generation_tokens", "Tokens streamed to clients", registry=r
        )
        self.in_flight = Gauge("pdserve_requests_in_flight", "Requests admitted and not finished", registry=r)

        self.pool_workers = Gauge(
            "pdserve_pool_workers",
            "Workers of the pool by state (starting, up, draining, down)",
            ("pool", "state"),
            registry=r,
        )
        self.pool_target = Gauge(
            "pdserve_pool_target_replicas", "The number of workers the pool is kept at", ("pool",), registry=r
        )
        self.worker_drains = Counter(
            "pdserve_worker_drains",
            "Drains that ended, by outcome (ok: nothing lost; timeout: --drain-timeout passed; "
            "lost: the worker went down while draining; cancelled)",
            ("pool", "outcome"),
            registry=r,
        )
        self.migrations = Counter(
            "pdserve_request_migrations",
            "Streams moved between workers, by reason (drain, rebalance) and outcome (ok: KV moved; "
            "reprefilled: prefilled again from prompt + tokens so far; failed)",
            ("reason", "outcome"),
            registry=r,
        )
        self.migration_gap = histogram(
            "pdserve_migration_stream_gap_seconds",
            "The gap a migration puts in a stream: its last token on the old worker to its first on the new",
        )

        # -- the planner and the cost model (pdserve.planner, pdserve.costmodel) ----------------------
        self.ttft_breakdown = histogram(
            "pdserve_ttft_breakdown_seconds",
            "Where a remotely prefilled request's time goes, by part: prefill_queue (waiting on the "
            "prefill worker), prefill_compute (its prompt, RPC included: the first token is out), "
            "kv_transfer (the decode worker's pull), first_decode (KV in to the second token)",
            ("part",),
        )
        self.path_choices = Counter(
            "pdserve_path_choices",
            "Each request's path (remote: prefill pool; local: prefilled by its decode worker) and why "
            "(cost_model, stall: local was faster but would break the ITL budget, cold: the cost model "
            "has too few samples so the fixed threshold decided, no_prefill_worker)",
            ("path", "reason"),
            registry=r,
        )
        self.ttft_prediction_ratio = histogram(
            "pdserve_ttft_prediction_ratio",
            "Observed TTFT / the TTFT the cost model predicted for the path it chose",
            ("path",),
            buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 3.0, 5.0, 10.0),
        )
        self.stall_margin = Gauge(
            "pdserve_cost_model_stall_margin",
            "What the path choice last divided the ITL budget by: the cost model's recent under-prediction "
            "(the SLO percentile of observed / predicted) of steps with prompt tokens beside decode streams; 1 before it has 20",
            registry=r,
        )
        self.slo_seconds = Gauge(
            "pdserve_slo_seconds",
            "The SLO the server is run against (--slo), by metric (ttft, itl)",
            ("metric",),
            registry=r,
        )
        self.slo_percentile = Gauge(
            "pdserve_slo_percentile", "The percentile the SLOs are stated at (--slo-percentile)", registry=r
        )
        self.slo_rejections = Counter(
            "pdserve_slo_rejections",
            "Requests answered 429 at once because their predicted TTFT missed the SLO (--reject-on-slo-miss); "
            "reason: predicted (the cost model, scaled by its recent error) or cold (before it is ready)",
            ["reason"],
            registry=r,
        )
        self.planner_decisions = Counter(
            "pdserve_planner_decisions",
            "Planner changes to a pool's target, by direction (up, down) and reason (predictive, "
            "reactive, move, idle)",
            ("pool", "direction", "reason"),
            registry=r,
        )
        self.planner_target = Gauge(
            "pdserve_planner_target_replicas",
            "The workers the planner wants in the pool (within its bounds and the budget)",
            ("pool",),
            registry=r,
        )
        self.planner_predicted = Gauge(
            "pdserve_planner_predicted_seconds",
            "The SLO percentile the cost model predicts for the pool at its current size (metric: ttft, itl)",
            ("pool", "metric"),
            registry=r,
        )
        self.planner_observed = Gauge(
            "pdserve_planner_observed_seconds",
            "The SLO percentile observed over the planner's window (metric: ttft, itl)",
            ("pool", "metric"),
            registry=r,
        )

        worker_labels = ("pool", "worker")
        self.worker_up = Gauge(
            "pdserve_worker_up", "1 while the worker is connected and ready", worker_labels, registry=r
        )
        self.worker_running = Gauge(
            "pdserve_worker_running_requests", "Requests running on the worker", worker_labels, registry=r
        )
        self.worker_waiting = Gauge(
            "pdserve_worker_waiting_requests", "Requests queued on the worker", worker_labels, registry=r
        )
        self.worker_kv_used = Gauge(
            "pdserve_worker_kv_blocks_used", "KV cache blocks in use", worker_labels, registry=r
        )
        self.worker_kv_free = Gauge(
            "pdserve_worker_kv_blocks_free", "KV cache blocks free", worker_labels, registry=r
        )
        self.worker_queued_prompt = Gauge(
            "pdserve_worker_queued_prompt_tokens",
            "Prompt tokens waiting to be prefilled",
            worker_labels,
            registry=r,
        )
        self.worker_step = Gauge(
            "pdserve_worker_last_step_seconds",
            "Duration of the worker's last step",
            worker_labels,
            registry=r,
        )
        self.worker_rpc_refused = Gauge(
            "pdserve_worker_rpc_refused",
            "Connections the worker refused at the RPC handshake since it started (no or a wrong key)",
            worker_labels,
            registry=r,
        )
        self.worker_rpc_dropped = Gauge(
            "pdserve_worker_rpc_dropped_frames",
            "Frames from an authenticated peer the worker dropped since it started (not our protocol)",
            worker_labels,
            registry=r,
        )
        self.worker_steps_between_layers = Gauge(
            "pdserve_worker_steps_between_layers",
            "Steps of short prompts a prefill worker ran between two layers of a longer prompt's "
            "step since it started (--prefill-interrupts)",
            worker_labels,
            registry=r,
        )
        self.worker_prefix_cached = Gauge(
            "pdserve_worker_prefix_cache_blocks",
            "KV blocks in the worker's prefix cache (held by requests or not): what a new prompt can find",
            worker_labels,
            registry=r,
        )
        self.kv_routing = Counter(
            "pdserve_kv_routing",
            "Workers chosen with the prompt's cached blocks weighed: cache (it has the most of the "
            "prompt cached), no_cache (no worker of the pool has any of it), load_over_cache (the "
            "fallback to load: another had more of it cached but too many streams)",
            ("pool", "decision"),
            registry=r,
        )
        self.prefix_queries = Counter(
            "pdserve_prefix_cache_queries",
            "Tokens the pool's workers looked up in their prefix caches as they admitted requests",
            ("pool",),
            registry=r,
        )
        self.prefix_hits = Counter(
            "pdserve_prefix_cache_hits",
            "Of those tokens, the ones found cached (their KV reused, not computed again)",
            ("pool",),
            registry=r,
        )

        self._worker_gauges = (
            self.worker_up,
            self.worker_running,
            self.worker_waiting,
            self.worker_kv_used,
            self.worker_kv_free,
            self.worker_queued_prompt,
            self.worker_step,
            self.worker_rpc_refused,
            self.worker_rpc_dropped,
            self.worker_steps_between_layers,
            self.worker_prefix_cached,
        )

        # Labelled children looked up once: `labels()` costs microseconds (a lock, validation),
        # and these are set for every token and every load report.
        self._pool_latency: dict[str, tuple[Histogram, Histogram]] = {}
        self._worker_load: dict[tuple[str, str], tuple[Gauge, ...]] = {}

    def load_gauges(self) -> tuple[Gauge, ...]:
        """The gauges fed by a worker's load reports."""
        return self._worker_gauges[1:]

    def worker_load(self, pool: str, worker_id: str) -> tuple[Gauge, ...]:
        """`load_gauges`' series of this worker, in that order (kept until `remove_worker`)."""
        children = self._worker_load.get((pool, worker_id))
        if children is None:
            children = tuple(gauge.labels(pool, worker_id) for gauge in self.load_gauges())
            self._worker_load[(pool, worker_id)] = children
        return children

    def pool_latency(self, pool: str) -> tuple[Histogram, Histogram]:
        """The TTFT and ITL histograms' series of this pool."""
        children = self._pool_latency.get(pool)
        if children is None:
            children = self._pool_latency[pool] = (self.ttft.labels(pool), self.itl.labels(pool))
        return children

    def remove_worker(self, pool: str, worker_id: str, *, keep_up: bool = False) -> None:
        """Drop a worker's series (all of them, or all but `pdserve_worker_up`)."""
        self._worker_load.pop((pool, worker_id), None)  # a later report labels them anew
        for gauge in self._worker_gauges[1:] if keep_up else self._worker_gauges:
            with contextlib.suppress(KeyError):
                gauge.remove(pool, worker_id)

    def render(self) -> bytes:
        return generate_latest(self.registry)
