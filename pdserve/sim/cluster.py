"""The simulation's cluster backend: "starts" a simulated worker (pdserve.sim.worker) after the
profile's start time, so the real pool manager and planner scale simulated pools as they scale
real ones. No torch, no process.

A worker's step time is the profile's for its pool role (the worker loop's own time follows each
step: the profile's per-step and per-stream time for that role, a free-CPU run's own while the
host has a CPU no worker is on), spread as the profile's
measured steps spread around their fit (their quantiles, else `median_error`), and stretched by
the CPU the router takes from the workers on a shared host and by the other workers pinned to its
CPU, a starting one included (pdserve/sim/host.py);
a pull takes the profile's time for the deployment's transport (or, in a profile fitted to
served steps over that transport, the served pulls' wait, as busy as the other workers are); its
KV cache has the profile's
blocks for its role. The engine settings (chunk size, step budget, batch limits) are the worker
configuration's, as `pdserve serve` builds it from the same flags.
"""

from __future__ import annotations

import asyncio
import math
import random
import zlib

from pdserve import clock
from pdserve.cluster.base import ExitCallback, WorkerExit, WorkerHandle, WorkerStartError
from pdserve.config import WorkerConfig
from pdserve.engine.core import step_features
from pdserve.engine.sched_types import SchedulerOutput
from pdserve.router.channel import ChannelEvents
from pdserve.sim.host import HostLoad
from pdserve.sim.profile import Profile
from pdserve.sim.step_time import LinearStep, ProfileError
from pdserve.sim.trace_speed import SpeedCourse
from pdserve.sim.worker import SimConnector, SimWorker, WorkerFactory

MEDIAN_ABS_NORMAL = 0.6745  # the median of |z| for a standard normal z
START_TICK_S = 0.25  # a starting worker's progress is reckoned this often (seconds of its work)


def drawn(quantiles: tuple[float, ...], u: float) -> float:
    """The value at probability `u` (0 to 1) of a distribution known by its quantiles at
    (i + 0.5) / n: linear between them, the end ones beyond."""
    position = u * len(quantiles) - 0.5
    if position <= 0:
        return quantiles[0]
    below = int(position)
    if below >= len(quantiles) - 1:
        return quantiles[-1]
    fraction = position - below
    return quantiles[below] + (quantiles[below + 1] - quantiles[below]) * fraction


class SimCluster:
    """A cluster backend whose workers are simulated (implements `ClusterBackend`)."""

    name = "sim"

    def __init__(
        self,
        profile: Profile,
        connector: SimConnector,
        host: HostLoad | None = None,
        noise_seed: int = 0,
        speed_course: SpeedCourse | None = None,
    ) -> None:
        """`host`: the CPUs the workers share with the router, whose load stretches their steps.
        `noise_seed`: which draw of the steps' deviations from their fit (0: each worker's own).
        `speed_course`: a served run's speed over its time, replayed from `course_from` on (the
        workload's start; set by the simulation when it starts the workload)."""
        self.profile = profile
        self.speed_course = speed_course
        self.course_from: float | None = None
        self.noise_seed = noise_seed
        self.connector = connector
        self.host = host
        self.device_type = str(profile.meta.get("device", "cpu"))
        self._alive: dict[str, WorkerHandle] = {}
        self._on_exit: ExitCallback | None = None
        self.started = 0  # workers started over the run (the planner's scale-ups count here)
        # A start beside a busy CPU-mate over a quiet one, as measured (0: not measured).
        self._beside_busy = (
            profile.start_busy_s / profile.start_s if profile.start_busy_s and profile.start_s else 0.0
        )

    def set_exit_callback(self, callback: ExitCallback) -> None:
        self._on_exit = callback

    def factory(self, config: WorkerConfig) -> WorkerFactory:
        pool = config.pool
        step_time = self.profile.step_time(pool)
        loop_time = self.profile.loop_time(pool)
        free_loop_time = self.profile.loop_time(pool, free_cpu=True)
        transfer = self.profile.transfer(config.transport) if pool != "prefill" else None
        served_pull = self.profile.served_pull(pool, config.transport)

        host = self.host
        busy_time = self.profile.busy_step_time(pool)
        worker_id = config.worker_id

        # A real step is not its fitted time: steps of the same work spread around it as the
        # profile's measured steps spread around their fit: drawn from the measured / fitted
        # quantiles of steps of its length where the profile has them (served steps: their right
        # tail adds up to more work than the fit's median), else lognormal with the fit's median
        # error (median-preserving). The router's cost model sees that spread in the simulation as
        # it does in serving (its stall margin and its fit). Seeded by the worker's id (and the
        # run's noise seed: `sim --noise-seed`, `plan --repeats`): a run is reproducible.
        spread_at = (
            step_time.spread_at
            if isinstance(step_time, LinearStep)
            and (step_time.spread or step_time.mixed_spread or step_time.free_spread)
            else None
        )
        fit_error = step_time.median_error if isinstance(step_time, LinearStep) else None
        sigma = (fit_error or 0.0) / MEDIAN_ABS_NORMAL
        noise = worker_id if self.noise_seed == 0 else f"{self.noise_seed}:{worker_id}"
        spread = random.Random(zlib.crc32(noise.encode()))

        def step_seconds(out: SchedulerOutput) -> float:
            features = step_features(out)
            seconds = step_time.seconds(features)
            if host is not None and busy_time is not None:
                # Moved by its neighbours' work, as far as they were busy: slowed, as a rule (the
                # caches and memory shared), but a served fit may say a step beside idle CPUs ran
                # slower (calibrate.fit_alone_and_busy).
                beside = host.others_busy(worker_id, seconds)
                seconds += (busy_time.seconds(features) - seconds) * beside
            quantiles: tuple[float, ...] = ()
            if spread_at is not None:  # a mixed step (prompt beside streams) by its own where known
                mixed = features.prefill_tokens > 0 and features.decode_streams > 0
                quantiles = spread_at(seconds, mixed, host is not None and host.free_cpu())
            if quantiles:
                seconds *= drawn(quantiles, spread.random())
            elif sigma > 0:
                seconds *= math.exp(spread.gauss(0.0, sigma))
            seconds *= self._course(pool)
            if host is None:
                return seconds
            seconds *= host.stretch()
            seconds *= host.sharing(worker_id, seconds)  # other workers on its CPU
            host.worked(worker_id, seconds)
            host.occupy(worker_id, seconds)
            return seconds

        def loop_seconds(out: SchedulerOutput) -> float:
            # A worker's loop with a CPU free of workers beside it, as traced so (the free CPU's
            # router and client did not run on its own).
            free = host is not None and host.free_cpu()
            loop = (free_loop_time if free else loop_time).seconds(sum(1 for c in out.chunks if c.sample))
            loop *= self._course(pool)
            if host is None:
                return loop
            loop *= host.stretch()
            loop *= host.sharing(worker_id, loop)
            host.occupy(worker_id, loop)
            return loop

        # The profile counts blocks of its own size: a deployment's other block size is converted.
        scale = config.engine.block_size / self.profile.block_size
        num_blocks = config.engine.num_kv_blocks or int(self.profile.blocks(pool) / scale)

        def pull_seconds(blocks: int) -> tuple[float, float]:
            assert transfer is not None  # only workers that take KV pull
            if served_pull is not None:  # as the served pulls waited, beside neighbours as busy
                busy = host.others_busy(worker_id, served_pull.seconds(blocks * scale, 0.0)) if host else 0.0
                return served_pull.seconds(blocks * scale, busy), served_pull.copy_seconds(
                    blocks * scale, busy
                )
            seconds = transfer.seconds(blocks * scale)
            if host is not None:
                # The profile times a pull between idle caches; served, the pull's thread shares the
                # worker's CPU with its engine's steps (and its CPU-mates): slower as they are busy.
                seconds *= host.sharing(worker_id, seconds, beside_itself=True)
            return seconds, seconds

        def make(events: ChannelEvents) -> SimWorker:
            return SimWorker(
                config,
                self.profile.model_config(),
                num_blocks,
                events,
                step_seconds=step_seconds,
                pull_seconds=pull_seconds,
                loop_seconds=loop_seconds,
                device_type=self.device_type,
            )

        return make

    def _course(self, pool: str) -> float:
        """How much slower than its own pace the replayed run's host ran `pool`'s steps now (1: no
        replay, or before the workload started)."""
        if self.speed_course is None or self.course_from is None:
            return 1.0
        return self.speed_course.at(pool, clock.monotonic() - self.course_from)

    async def start_worker(self, config: WorkerConfig, timeout: float) -> WorkerHandle:
        worker_id = config.worker_id
        try:
            self.connector.factories[worker_id] = self.factory(config)
        except ProfileError as exc:
            raise WorkerStartError(f"worker {worker_id}: {exc}") from None
        if not await self._load(worker_id, timeout):
            raise WorkerStartError(
                f"worker {worker_id} would take longer to start than --ready-timeout {timeout:g} s "
                f"(the profile's start time: {self.profile.start_s:g} s"
                + (", on a CPU it shares)" if self.host is not None else ")")
            )
        handle = WorkerHandle(
            worker_id, config.pool, f"sim://{worker_id}", f"sim://{worker_id}/kv", "sim", rpc_public_key="sim"
        )
        self._alive[worker_id] = handle
        self.started += 1
        return handle

    async def _load(self, worker_id: str, timeout: float) -> bool:
        """Waits out the worker's start (False: it would pass `timeout`). On a shared host loading
        the model is the profile's start time of work on its CPU (a CPU-second a second, measured:
        8.0 s of CPU in 8.4 s alone), done at the share of the CPU the worker gets beside its
        CPU-mates and the router's (and the client's) work, which the profile's quiet start left
        out; beside a busy CPU-mate, at the pace of the profile's start measured beside a busy
        worker while the host served (`start_busy_s`: 30-42 s where the quiet start took 10 s and
        the share of the CPU says 20; `HostLoad.start_stretch`)."""
        host = self.host
        if host is None:
            if self.profile.start_s > timeout:
                await asyncio.sleep(timeout)
                return False
            await asyncio.sleep(self.profile.start_s)
            return True
        host.place(worker_id)
        work, waited = self.profile.start_s, 0.0
        while work > 0:
            tick = min(START_TICK_S, work)
            seconds = tick * host.start_stretch(worker_id, tick, self._beside_busy)
            if waited + seconds > timeout:
                await asyncio.sleep(max(0.0, timeout - waited))
                host.leave(worker_id)
                return False
            host.occupy(worker_id, seconds)
            await asyncio.sleep(seconds)
            waited += seconds
            work -= tick
        return True

    async def stop_worker(self, worker_id: str, *, graceful: bool = True, timeout: float = 15.0) -> None:
        if self._alive.pop(worker_id, None) is None:
            return
        if self.host is not None:
            self.host.leave(worker_id)
        worker = self.connector.workers.pop(worker_id, None)
        self.connector.factories.pop(worker_id, None)
        if worker is not None:
            await worker.close()
            worker.events.on_disconnect()
        if self._on_exit is not None:
            self._on_exit(WorkerExit(worker_id, True, "stopped (simulated)"))

    def workers(self) -> list[WorkerHandle]:
        return list(self._alive.values())

    async def close(self) -> None:
        for worker_id in list(self._alive):
            await self.stop_worker(worker_id)
