"""Measures what serving adds to the engine's steps (no torch here): a real `pdserve serve
--colocated 1 --step-trace` on this machine, sent one request at a time by the bench's own
client, its TTFT and ITL set against the steps its worker ran for them (traced):

    per-step overhead    = median over requests of (ITL - its decode steps), a step
    per-request overhead = median(TTFT - its prompt step) - per-step overhead
    per-stream overhead  = (median ITL of 8 streams at once - their traced step
                            - per-step overhead) / 7

Against the steps as they ran, not as the profile's fit predicts them: the host's pace drifts by
5-10% from one minute to the next, which on a 60 ms prompt step is several ms of a 10 ms overhead
(three probes of one AMX Xeon against the fit: 4.1, 11.8 and 17.5 ms a request). Where the trace
does not show the probe's requests one by one, the fit's prediction instead, said.

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
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pdserve.bench.client import PreparedRequest, Target, run_load
from pdserve.bench.summary import RequestRecord
from pdserve.costmodel import Step, chunk_attention
from pdserve.errors import PdserveError
from pdserve.measure.server import RunningServer, running
from pdserve.sim.calibrate import read_trace
from pdserve.sim.profile import HostCpu, Overhead
from pdserve.sim.step_time import StepTime

logger = logging.getLogger("pdserve.measure")


@dataclass(frozen=True)
class OverheadResult:
    overhead: Overhead
    start_s: float
    requests: int
    host: HostCpu | None = None
    note: str = ""  # what the overhead was set against (the profile's assumptions)


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
    with tempfile.TemporaryDirectory(prefix="pdserve-overhead-") as folder:
        # The trace costs the router a line of JSON a step, within the CPU `_host_cpu` reads.
        trace = Path(folder) / "steps.jsonl"
        with running(model, ["--colocated", "1", "--step-trace", str(trace)], threads) as server:
            probed = _probes(server, model, requests, prompt_tokens, output_tokens, vocab_size)
        long, short, batched, idle_rate, start_s = probed
        rows = _trace_rows(trace)
    host = _host_cpu(long, short, requests, output_tokens, idle_rate)
    overhead, note = _settled(rows, long.records, short.records, step_time, prompt_tokens)
    overhead, stream_note = _per_stream(overhead, batched, rows, step_time, prompt_tokens)
    return OverheadResult(overhead, start_s, requests, host, note + stream_note)


def _trace_rows(trace: Path) -> list[dict[str, Any]]:
    """The probe worker's steps as its server traced them, in order (none if it wrote no trace)."""
    return [row for rows in read_trace([trace]).values() for row in rows] if trace.exists() else []


def _settled(
    rows: list[dict[str, Any]],
    long: list[RequestRecord],
    short: list[RequestRecord],
    step_time: StepTime,
    prompt_tokens: int,
) -> tuple[Overhead, str]:
    """The overhead against the long probe's requests' own traced steps (`_overhead_traced`), with
    the note to keep in the profile; the fit's (`_overhead`) where the trace does not show each of
    the probes' requests (the warm-up's two, the long probe's, the short probe's) one at a time,
    its prompt step whole and a decode step for each token after the first, said."""
    served = _sequential_steps(rows)
    records = [None, None, *long, *short]  # the warm-up's two are not checked
    why = ""
    if len(served) < len(records):
        why = f"its trace showed {len(served)} requests one at a time, not the {len(records)} sent"
    else:
        for index, (record, (prompt, decode)) in enumerate(zip(records, served, strict=False)):
            if record is None:
                continue
            if prompt.prefill_tokens != prompt_tokens:
                why = f"request {index}'s prompt step ran {prompt.prefill_tokens} tokens, not {prompt_tokens}"
            elif len(decode) != record.output_tokens - 1:
                why = (
                    f"request {index}'s trace held {len(decode)} decode steps for its {record.output_tokens} "
                    "tokens (steps dropped from a load report?)"
                )
            if why:
                break
    if why:
        note = f"serving overhead: against the fit's step time, the host's drift in it ({why})"
        logger.warning(note)
        return _overhead(long, step_time, prompt_tokens), note
    mine = served[2 : 2 + len(long)]
    overhead = _overhead_traced(long, [(p.seconds, [d.seconds for d in ds]) for p, ds in mine])
    note = (
        f"serving overhead: {len(long)} requests one at a time to a real colocated worker, their TTFT "
        "and ITL beyond the steps it traced for them (pdserve/measure/overhead.py)"
    )
    return overhead, note


@dataclass(frozen=True)
class _TracedStep:
    seconds: float
    prefill_tokens: int


def _sequential_steps(rows: list[dict[str, Any]]) -> list[tuple[_TracedStep, list[_TracedStep]]]:
    """The probe server's steps, one request at a time: each prompt step alone (prompt tokens, no
    stream) with the one-stream decode steps after it, up to the first step of another kind (the
    batched probe's)."""
    served: list[tuple[_TracedStep, list[_TracedStep]]] = []
    for row in rows:
        step = _TracedStep(float(row["seconds"]), int(row["prefill_tokens"]))
        streams = int(row["decode_streams"])
        if step.prefill_tokens > 0 and streams == 0:
            served.append((step, []))
        elif step.prefill_tokens == 0 and streams == 1 and served:
            served[-1][1].append(step)
        else:
            break
    return served


def _probes(
    server: RunningServer, model: str, requests: int, prompt_tokens: int, output_tokens: int, vocab_size: int
) -> tuple[_Probe, _Probe, list[RequestRecord], float, float]:
    """(long, short, the batched probe's records, the router's idle CPU rate, the start time)."""
    url = server.url
    start_s = server.start_s
    pid = server.process.pid

    sent = itertools.count()  # each prompt its own first token: no prompt a cached prefix of another

    def probe(count: int, outputs: int, concurrency: int = 1) -> _Probe:
        prompts = []
        for i in range(count):
            first = next(sent) % (vocab_size - 2) + 1
            tokens = [first] + [(i * 31 + k) % (vocab_size - 2) + 1 for k in range(1, prompt_tokens)]
            prompts.append(PreparedRequest(i, "probe", None, tokens, prompt_tokens, outputs))
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
    return long, short, batched, idle_rate, start_s


IDLE_PROBE_S = 2.0
SHORT_OUTPUT = 2
STREAMS = 8  # the batched probe's streams


def _per_stream(
    overhead: Overhead,
    records: list[RequestRecord],
    rows: list[dict[str, Any]],
    step_time: StepTime,
    prompt_tokens: int,
) -> tuple[Overhead, str]:
    """The worker loop's cost per stream of a step (each stream's token sent), from ITLs at
    STREAMS streams beyond the step, against the one-stream overhead: a + b x streams. The step:
    the median of the STREAMS-stream decode steps the server traced (MIN_TRACED or more), else the
    fit's at each gap's context (said, in the note's words returned)."""
    traced = [
        float(r["seconds"]) for r in rows if r["decode_streams"] == STREAMS and r["prefill_tokens"] == 0
    ]
    step_s = statistics.median(traced) if len(traced) >= MIN_TRACED else None
    excess = []
    for r in records:
        if r.error:
            raise PdserveError(f"the overhead probe's requests failed: {r.error}")
        gaps = list(itertools.pairwise(r.chunk_times_s))
        for k, (before, after) in enumerate(gaps[2:], start=2):  # the batch's prompts are in by then
            context = STREAMS * (prompt_tokens + k + 1)
            step = step_s if step_s is not None else step_time.seconds(Step(0, 0, STREAMS, context))
            excess.append((after - before) - step)
    if not excess:
        return overhead, ""
    per_stream = max(0.0, (statistics.median(excess) - overhead.step_s) / (STREAMS - 1))
    base = max(0.0, overhead.step_s - per_stream)
    note = ""
    if step_s is None:
        note = f"; its part a stream against the fit's {STREAMS}-stream step ({len(traced)} traced)"
        logger.warning("serving overhead%s", note.removeprefix(";"))
    return replace(overhead, step_s=round(base, 6), stream_s=round(per_stream, 7)), note


MIN_TRACED = 5  # STREAMS-stream steps in the trace to take their median as the batched probe's step


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


def _overhead_traced(records: list[RequestRecord], steps: list[tuple[float, list[float]]]) -> Overhead:
    """Each request against its own steps (its prompt step's seconds, its decode steps'): the
    per-step overhead from its first token to its last beyond its decode steps, a step (tokens
    sent together in one chunk count alike); the per-request overhead its TTFT beyond its prompt
    step, less the per-step part its first token carries too."""
    failed = [r.error for r in records if r.error]
    if failed or not records:
        raise PdserveError(f"the overhead probe's requests failed: {failed[:1] or 'none came back'}")
    itl_excess, ttft_excess = [], []
    for record, (prompt_s, decode_s) in zip(records, steps, strict=True):
        assert record.ttft is not None
        ttft_excess.append(record.ttft - prompt_s)
        if decode_s and len(record.chunk_times_s) > 1:
            streamed = record.chunk_times_s[-1] - record.chunk_times_s[0]
            itl_excess.append((streamed - sum(decode_s)) / len(decode_s))
    step_s = max(0.0, statistics.median(itl_excess)) if itl_excess else 0.0
    request_s = max(0.0, statistics.median(ttft_excess) - step_s)
    return Overhead(request_s=round(request_s, 6), step_s=round(step_s, 6))


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
