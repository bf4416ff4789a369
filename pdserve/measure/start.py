"""`pdserve profile --served`: a worker's start beside a busy one, as the planner's scale-up starts
it (no torch here). A real `pdserve serve --prefill 1 --decode 1` serves the top of the profile's
load (its rate x3.5, past the knee of SmolLM2 on two cores) and is asked for a second prefill
worker (PUT /pools/prefill), which `--cluster local` pins to the CPU of the busy one; the time from
asking to its being up is the profile's `start_busy_s`.

Why it is measured rather than derived from the quiet start and the share of the CPU: a start
faults in its weights and a gigabyte of KV cache, and on a virtual machine each fault of fresh
memory waits on the host. Measured on this project's 2-vCPU VM: populating the KV segment took
0.3 s quiet and 19 s beside a served load, the whole start 30-42 s where the quiet one took 10 s
and half the CPU would say 20.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import statistics
import time
from collections.abc import Callable, Sequence

import httpx

from pdserve.bench.client import PreparedRequest, Target, run_load
from pdserve.bench.compare import prompt_seed
from pdserve.bench.run import conversation_encoder, prepare
from pdserve.bench.timeline import pool_counts
from pdserve.bench.workload import Workload, parse_workload
from pdserve.errors import PdserveError
from pdserve.measure.served import CLASSES, STAIRCASE
from pdserve.measure.server import running

logger = logging.getLogger("pdserve.measure")

WARM_S = 10.0  # the load runs this long (the prefill worker's queue filled) before the start is asked for
LOAD_S = 300.0  # the load's length: longer than any start; it is stopped once the worker is up
START_TIMEOUT_S = 240.0  # a start not up by then fails the probe
POLL_S = 0.2  # GET /pools this often while the worker starts
PROBES = 2  # starts timed (a server each); the median is the profile's


def top_load(workload: str | None, rate_scale: float, seed: int) -> Workload:
    """The load the start is timed under: the top of the profile's staircase (the built-in chat and
    documents, or `workload`, at STAIRCASE[-1] times `rate_scale`)."""
    spec = workload if workload is not None else "; ".join(CLASSES)
    return parse_workload(spec, seed, None, LOAD_S, rate_scale * STAIRCASE[-1])


def start_beside_busy(
    model: str,
    *,
    threads: int | None,
    rate_scale: float = 1.0,
    seed: int = 7,
    workload: str | None = None,
    probes: int = PROBES,
    warm_s: float = WARM_S,
) -> float:
    """Seconds from asking a DPD server serving `top_load` for a second prefill worker to its being
    up: the median of `probes` starts, each on a server of its own."""
    load = top_load(workload, rate_scale, seed)
    requests = prepare(load, model, "completions", "ids", prompt_seed(seed, 0))
    encode = conversation_encoder(load, model, "completions", "ids")
    times = []
    for probe in range(probes):
        logger.info("a worker's start beside a busy one: probe %d of %d", probe + 1, probes)
        with running(model, ["--prefill", "1", "--decode", "1", "--prefill-max", "2"], threads) as server:
            times.append(asyncio.run(_timed_start(server.url, model, requests, encode, warm_s)))
    return statistics.median(times)


async def _timed_start(
    url: str,
    model: str,
    requests: Sequence[PreparedRequest],
    encode: Callable[[str], list[int]] | None,
    warm_s: float,
) -> float:
    target = Target(url, model, request_timeout_s=LOAD_S)
    load = asyncio.create_task(
        run_load(target, requests, duration_s=LOAD_S, drain_timeout_s=5.0, encode=encode)
    )
    try:
        async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
            await asyncio.sleep(warm_s)  # the load's work, not a test's wait: the queue fills meanwhile
            if load.done():
                load.result()  # its error, if it failed
                raise PdserveError("the load ended before the start was asked for")
            asked = time.perf_counter()
            await _admin(client, "PUT", "/pools/prefill", {"replicas": 2})
            prefill: dict[str, object] = {}
            while time.perf_counter() - asked < START_TIMEOUT_S:
                try:
                    prefill = pool_counts(await _admin(client, "GET", "/pools")).get("prefill", {})
                except ValueError as exc:  # JSON, but not the shape of pdserve's pools
                    raise PdserveError(f"GET /pools answered something else: {exc}") from None
                workers = prefill.get("workers")
                if isinstance(workers, dict) and workers.get("up", 0) >= 2:
                    return time.perf_counter() - asked
                await asyncio.sleep(POLL_S)
            raise PdserveError(
                f"the second prefill worker was not up {START_TIMEOUT_S:g} s after it was asked for: {prefill}"
            )
    finally:
        load.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await load


async def _admin(client: httpx.AsyncClient, method: str, path: str, body: object = None) -> object:
    """The admin route's JSON answer; a failed call, an error status or an answer that is not
    pdserve's raise PdserveError saying which."""
    try:
        answer = await client.request(method, path, json=body)
        if answer.status_code != 200:
            raise PdserveError(f"{method} {path} answered HTTP {answer.status_code}: {answer.text[:300]}")
        return answer.json()
    except httpx.HTTPError as exc:
        raise PdserveError(f"{method} {path} failed: {type(exc).__name__}: {exc}") from None
    except ValueError as exc:  # not JSON
        raise PdserveError(f"{method} {path} answered something other than JSON: {exc}") from None
