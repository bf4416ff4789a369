"""The host's CPUs, shared: on one machine (`pdserve serve --cluster local` on CPUs) the router, and
in a benchmark the load generator, run on the cores the workers are pinned to, and every
CPU-second they take is one the workers' steps wait for. No torch.

The profile measures what the router (and the bench's client) spend per request and per token
(`HostCpu`, pdserve/measure/overhead.py), and a worker's steps alone and beside a busy engine on
another CPU (`Profile.steps_busy`: the host's caches and memory are shared). A simulated step costs
its time alone plus the difference, weighed by how busy the other workers were lately. The simulation charges that work as it happens and
stretches every worker's step by 1 / (1 - share), share being the CPU those processes took over
the last `window_s` seconds divided by the host's CPUs (capped at `MAX_SHARE`): the steps run
slower as the load grows, which is what moves the knee on a small host. A GPU deployment (the
router on its own cores) has no such term: the profile then has no `host`. A profile whose steps
were fitted to served ones (`steps_from: serving`) has the router's and the client's CPU in them:
no stretch then, only the neighbours' term, fitted to those steps too.

Workers can also share a CPU: `pdserve serve --cluster local` pins each worker to the CPU with the
fewest workers, so a third worker on two cores (the planner's scale-up, say) shares one with
another, and a worker starting up (loading the model: about a CPU-second a second) takes its CPU
from the one already there. The simulation places its workers the same way and runs each step
slower by its CPU-mates' work: a mate busy for a share b of the step halves its speed for that
share (seconds / (1 - b/2); for several mates, the expected share of the CPU left, each busy on
its own). A mate's share is how much of the last `window_s` it was busy (steps, loop, start-up),
or how much of the step ahead its work already under way will take, whichever is more. Without
pinning (`--no-pin-cpus`) the OS spreads the workers over all the CPUs: a step slows only when
more workers are busy than there are CPUs. A worker's KV pull runs on a thread of its own beside
its engine: the profile times it between idle caches, and the simulation slows it as the worker's
own steps (and its CPU-mates) keep that CPU busy.
"""

from __future__ import annotations

from collections import Counter, deque

from pdserve import clock
from pdserve.sim.profile import HostCpu

MAX_SHARE = 0.9


class HostLoad:
    def __init__(
        self,
        host: HostCpu,
        client_on_host: bool,
        window_s: float = 2.0,
        stretches: bool = True,
        pinned: bool = True,
    ) -> None:
        """`stretches`: whether the router's and the client's CPU stretch the steps (not when the
        profile's steps were fitted to served ones, which ran beside them). `pinned`: whether
        each worker is pinned to one CPU (`--pin-cpus`, the local cluster's default)."""
        self.host = host
        self.stretches = stretches
        self.per_request = host.router_request_s + (host.client_request_s if client_on_host else 0.0)
        self.per_token = host.router_token_s + (host.client_token_s if client_on_host else 0.0)
        self.window_s = window_s
        self._charges: deque[tuple[float, float]] = deque()
        self._total = 0.0
        self._work: deque[tuple[float, str, float]] = deque()  # (when, worker, step seconds)
        self.pinned = pinned
        self._cpu: dict[str, int] = {}  # worker -> the CPU it is pinned to
        self._busy: dict[str, deque[tuple[float, float]]] = {}  # worker -> its (start, end) of work
        self._placed_at: dict[str, float] = {}

    def _charge(self, seconds: float) -> None:
        if seconds <= 0:
            return
        self._charges.append((clock.monotonic(), seconds))
        self._total += seconds

    def request(self) -> None:
        self._charge(self.per_request)

    def tokens(self, count: int) -> None:
        self._charge(self.per_token * count)

    def share(self) -> float:
        """The share of each CPU the router (and client) took lately."""
        horizon = clock.monotonic() - self.window_s
        while self._charges and self._charges[0][0] < horizon:
            self._total -= self._charges.popleft()[1]
        busy = max(0.0, self._total) / self.window_s + self.host.router_idle
        return min(MAX_SHARE, busy / self.host.cpus)

    def stretch(self) -> float:
        """How much longer a worker's step takes now."""
        return self.router_stretch() if self.stretches else 1.0

    def router_stretch(self) -> float:
        """How much longer work measured on a quiet host takes now for the router's (and the
        client's) CPU: a step's, unless its fit has that in it already; a start's, always (the
        profile times a start on a quiet host)."""
        return 1.0 / (1.0 - self.share())

    def worked(self, worker_id: str, seconds: float) -> None:
        """A worker's step of `seconds` starts now."""
        self._work.append((clock.monotonic(), worker_id, seconds))

    def others_busy(self, worker_id: str, span_s: float) -> float:
        """How busy the host's other CPUs are with other workers' steps over the next `span_s`
        (the step or pull about to run: what runs beside it is what slows it), from the steps
        under way (0 to 1). A prompt step of seconds slows every decode step that runs inside it,
        however long ago it began (steps of 8 s on a slow CPU)."""
        now = clock.monotonic()
        while self._work and self._work[0][0] + self._work[0][2] < now:  # ended: kept no longer
            self._work.popleft()
        if span_s <= 0:
            busy = sum(
                1.0 for start, worker, seconds in self._work if worker != worker_id and start + seconds > now
            )
        else:
            end = now + span_s
            busy = (
                sum(
                    max(0.0, min(end, start + seconds) - max(now, start))
                    for start, worker, seconds in self._work
                    if worker != worker_id
                )
                / span_s
            )
        return min(1.0, busy / max(1, self.host.cpus - 1))

    # -- workers sharing CPUs ---------------------------------------------------------------------
    def place(self, worker_id: str) -> int | None:
        """Pins a starting worker as `LocalCluster` does (the CPU with the fewest workers, the
        lowest on a tie); returns its CPU (None unpinned)."""
        self._busy.setdefault(worker_id, deque())
        self._placed_at[worker_id] = clock.monotonic()
        if not self.pinned:
            return None
        used = Counter(self._cpu.values())
        cpu = min(range(self.host.cpus), key=lambda c: (used[c], c))
        self._cpu[worker_id] = cpu
        return cpu

    def free_cpu(self) -> bool:
        """Whether the host has a CPU no worker is on (fewer workers placed than CPUs, pinned or not:
        the rule the profile's traced runs are read by, trace_runs.runs_with_a_free_cpu): the router
        and a local client then run there, not between a worker's steps (`LinearStep.free_spread`,
        `Profile.free_loops`)."""
        return len(self._busy) < self.host.cpus

    def leave(self, worker_id: str) -> None:
        """The worker has stopped: its CPU is free of it."""
        self._cpu.pop(worker_id, None)
        self._busy.pop(worker_id, None)
        self._placed_at.pop(worker_id, None)

    def occupy(self, worker_id: str, seconds: float) -> None:
        """The worker keeps its CPU busy from now for `seconds` (a step, its loop, its start)."""
        spans = self._busy.get(worker_id)
        if seconds > 0 and spans is not None:
            now = clock.monotonic()
            # Kept only while a mate may look back at them: an hour's steps would pile up otherwise.
            while spans and spans[0][1] < now - self.window_s:
                spans.popleft()
            spans.append((now, now + seconds))

    def _busy_share(self, worker_id: str, ahead_s: float) -> float:
        """How much of the CPU `worker_id`'s work took lately, or will take of the next `ahead_s`
        from what is under way, whichever is more."""
        now = clock.monotonic()
        # The window reaches back no further than the worker's start: before it, it was not there.
        window = min(self.window_s, now - self._placed_at.get(worker_id, now))
        horizon = now - window
        spans = self._busy.get(worker_id, deque())
        while spans and spans[0][1] < now - self.window_s:
            spans.popleft()
        past = sum(max(0.0, min(end, now) - max(start, horizon)) for start, end in spans)
        ahead = sum(max(0.0, min(end, now + ahead_s) - max(start, now)) for start, end in spans)
        return min(1.0, max(past / window if window > 0 else 0.0, ahead / ahead_s if ahead_s > 0 else 0.0))

    def _busy_chances(self, worker_id: str, seconds: float, beside_itself: bool) -> tuple[list[float], int]:
        """The chance that k of the workers sharing `worker_id`'s CPU(s) are busy over the next
        `seconds` (each on its own), by k; and the CPUs they share."""
        if self.pinned:
            cpu = self._cpu.get(worker_id)
            others = [w for w, c in self._cpu.items() if c == cpu and w != worker_id]
            cpus = 1
        else:
            others = [w for w in self._busy if w != worker_id]
            cpus = self.host.cpus
        if beside_itself and worker_id in self._busy:
            others.append(worker_id)
        chances = [1.0]
        for other in others:
            b = self._busy_share(other, seconds)
            chances = [
                (chances[k] if k < len(chances) else 0.0) * (1 - b) + (chances[k - 1] * b if k >= 1 else 0.0)
                for k in range(len(chances) + 1)
            ]
        return chances, cpus

    def sharing(self, worker_id: str, seconds: float, beside_itself: bool = False) -> float:
        """How much longer a step of `seconds` takes for the other workers on its CPU(s) (1: none).
        `beside_itself`: work the worker does beside its own engine (a KV pull, on a thread of its
        own), which then waits on the worker's steps for the CPU too (one way only: the steps are
        not slowed by it, a pull being short)."""
        chances, cpus = self._busy_chances(worker_id, seconds, beside_itself)
        # The share of a CPU left to this worker while k others are busy: all of one while the
        # busy ones fit on the other CPUs.
        speed = sum(chance * min(1.0, cpus / (1 + k)) for k, chance in enumerate(chances))
        return 1.0 / speed

    def start_stretch(self, worker_id: str, seconds: float, beside_busy: float) -> float:
        """How much longer `seconds` of a worker's start (measured on a quiet host) take now.

        `beside_busy`: the profile's start beside one busy CPU-mate on a host serving past its
        knee, over its quiet start (0: not measured). A start faults in a gigabyte or more of
        fresh memory (the weights, the KV cache); on a virtual machine under load each fault
        waits on the host (measured: populating the KV segment, 0.3 s quiet, took 19 s while
        serving), so a start beside a busy worker takes several times its share of the CPU says.
        Measured, that factor replaces the share of the CPU and the router's work (both were in
        the measurement) while mates are busy; with k busy, it counts k + 1 ways of time-slicing
        instead of the measurement's 2. Not measured, or no mate busy: the share of the CPU and
        the router's work alone."""
        chances, cpus = self._busy_chances(worker_id, seconds, False)
        router = self.router_stretch()
        speed = 0.0  # the start's progress per second, on average over the mates' busy and idle times
        for busy, chance in enumerate(chances):
            sliced = 1.0 / min(1.0, cpus / (1 + busy))
            if busy and beside_busy > 0 and sliced > 1.0:
                speed += chance * 2 / (beside_busy * sliced)
            else:
                speed += chance / (sliced * router)
        return 1.0 / speed
