"""Measures what serving adds to the engine's steps (no torch here): a real `pdserve serve
--colocated 1` on this machine, sent one request at a time by the bench's own client, its TTFT
and ITL set against the step time the profile predicts for the same steps.

    per-step overhead    = median(ITL - predicted decode step)
    per-request overhead = median(TTFT - predicted prompt step) - per-step overhead

The first is the worker loop's work around a step (sending tokens, load reports) and the router's
per-token path (split into a part per step and a part per stream of the step, from a second
probe of 8 streams at once); the second is HTTP, tokenization, admission and dispatch. Also measured: the time
from `pdserve serve` to a ready worker (the profile's start time; a scale-up takes about this),
and the CPU the router process and this client spend per request and per token (two probes, long
and short outputs; the router's idle rate measured apart): on a host where they share the workers'
cores, that is CPU the workers' steps wait for (pdserve/sim/host.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import statistics
import time
from dataclasses import dataclass, replace
from pathlib import Path

from pdserve.bench.client import PreparedRequest, Target, run_load
from pdserve.bench.summary import RequestRecord
from pdserve.costmodel import Step, chunk_attention
from pdserve.errors import PdserveError
from pdserve.measure.server import running
from pdserve.sim.profile import HostCpu, Overhead
from pdserve.sim.step_time import StepTime

logger = logging.getLogger("pdserve.measure")


@dataclass(frozen=True)
class OverheadResult:
    overhead: Overhead
    start_s: float
    requests: int
    host: HostCpu | None = None


def _cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user + system), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class _Probe:
    records: list[RequestRecord]
    router_cpu_s: float
    client_cpu_s: float
    seconds: float


def measure(
    model: str,
    step_time: StepTime,
    *,
    threads: int | None,
    requests: int = 12,
    prompt_tokens: int = 64,
    output_tokens: int = 32,
    vocab_size: int = 32000,
) -> OverheadResult:
    with running(model, ["--colocated", "1"], threads) as server:
        url = server.url
        start_s = server.start_s
        pid = server.process.pid

        def probe(count: int, outputs: int, concurrency: int = 1) -> _Probe:
            prompts = [
                PreparedRequest(i, "probe", None, [(i * 31 + k) % (vocab_size - 2) + 1 for k in range(prompt_tokens)],
                                prompt_tokens, outputs)
                for i in range(count)
            ]  # fmt: skip
            router, client, wall = _cpu_seconds(pid), time.process_time(), time.perf_counter()
            records, _ = asyncio.run(
                run_load(
                    Target(url, model, request_timeout_s=120.0),
                    prompts,
                    concurrency=concurrency,
                    drain_timeout_s=300.0,
                )
            )
            return _Probe(
                records,
                _cpu_seconds(pid) - router,
                time.process_time() - client,
                time.perf_counter() - wall,
            )

        probe(2, output_tokens)  # warm-up: the first requests' paths are cold
        router_idle = _cpu_seconds(pid)
        time.sleep(IDLE_PROBE_S)  # the router's own background work (load reports, keepers)
        idle_rate = (_cpu_seconds(pid) - router_idle) / IDLE_PROBE_S
        long = probe(requests, output_tokens)
        short = probe(requests, SHORT_OUTPUT)
        # STREAMS requests at once, twice: steps of STREAMS streams, each sending its token.
        batched = [r for _ in range(2) for r in probe(STREAMS, output_tokens, STREAMS).records]
    host = _host_cpu(long, short, requests, output_tokens, idle_rate)
    overhead = _overhead(long.records, step_time, prompt_tokens)
    overhead = _per_stream(overhead, batched, step_time, prompt_tokens)
    return OverheadResult(overhead, start_s, requests, host)


IDLE_PROBE_S = 2.0
SHORT_OUTPUT = 2
STREAMS = 8  # the batched probe's streams


def _per_stream(
    overhead: Overhead, records: list[RequestRecord], step_time: StepTime, prompt_tokens: int
) -> Overhead:
    """The worker loop's cost per stream of a step (each stream's token sent), from ITLs at
    STREAMS streams beyond the predicted step, against the one-stream overhead: a + b x streams."""
    excess = []
    for r in records:
        if r.error:
            raise PdserveError(f"the overhead probe's requests failed: {r.error}")
        gaps = list(itertools.pairwise(r.chunk_times_s))
        for k, (before, after) in enumerate(gaps[2:], start=2):  # the batch's prompts are in by then
            context = STREAMS * (prompt_tokens + k + 1)
            excess.append((after - before) - step_time.seconds(Step(0, 0, STREAMS, context)))
    if not excess:
        return overhead
    per_stream = max(0.0, (statistics.median(excess) - overhead.step_s) / (STREAMS - 1))
    base = max(0.0, overhead.step_s - per_stream)
    return replace(overhead, step_s=round(base, 6), stream_s=round(per_stream, 7))


def _host_cpu(long: _Probe, short: _Probe, requests: int, outputs: int, idle_rate: float) -> HostCpu:
    """Per request and per token, the router's CPU (less its idle rate) and the client's: two
    probes with the same prompts and different outputs separate the two."""

    def split(long_s: float, short_s: float) -> tuple[float, float]:
        per_token = max(0.0, (long_s - short_s) / (requests * (outputs - SHORT_OUTPUT)))
        per_request = max(0.0, short_s / requests - per_token * SHORT_OUTPUT)
        return round(per_request, 6), round(per_token, 7)

    router = split(
        long.router_cpu_s - idle_rate * long.seconds, short.router_cpu_s - idle_rate * short.seconds
    )
    client = split(long.client_cpu_s, short.client_cpu_s)
    return HostCpu(os.cpu_count() or 1, *router, *client, router_idle=round(idle_rate, 5))


def _overhead(records: list[RequestRecord], step_time: StepTime, prompt_tokens: int) -> Overhead:
    failed = [r.error for r in records if r.error]
    if failed or not records:
        raise PdserveError(f"the overhead probe's requests failed: {failed[:1] or 'none came back'}")
    prompt_step = step_time.seconds(Step(prompt_tokens, chunk_attention(0, prompt_tokens), 0, 0))
    itl_excess = []
    ttft_excess = []
    for r in records:
        assert r.ttft is not None
        ttft_excess.append(r.ttft - prompt_step)
        for k, (before, after) in enumerate(itertools.pairwise(r.chunk_times_s)):
            context = prompt_tokens + k + 1
            itl_excess.append((after - before) - step_time.seconds(Step(0, 0, 1, context)))
    step_s = max(0.0, statistics.median(itl_excess))
    request_s = max(0.0, statistics.median(ttft_excess) - step_s)
    return Overhead(request_s=round(request_s, 6), step_s=round(step_s, 6))
