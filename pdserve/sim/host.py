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
"""

from __future__ import annotations

from collections import deque

from pdserve import clock
from pdserve.sim.profile import HostCpu

MAX_SHARE = 0.9


class HostLoad:
    def __init__(
        self, host: HostCpu, client_on_host: bool, window_s: float = 2.0, stretches: bool = True
    ) -> None:
        """`stretches`: whether the router's and the client's CPU stretch the steps (not when the
        profile's steps were fitted to served ones, which ran beside them)."""
        self.host = host
        self.stretches = stretches
        self.per_request = host.router_request_s + (host.client_request_s if client_on_host else 0.0)
        self.per_token = host.router_token_s + (host.client_token_s if client_on_host else 0.0)
        self.window_s = window_s
        self._charges: deque[tuple[float, float]] = deque()
        self._total = 0.0
        self._work: deque[tuple[float, str, float]] = deque()  # (when, worker, step seconds)

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
        return 1.0 / (1.0 - self.share()) if self.stretches else 1.0

    def worked(self, worker_id: str, seconds: float) -> None:
        """A worker's step of `seconds` starts now."""
        self._work.append((clock.monotonic(), worker_id, seconds))

    def others_busy(self, worker_id: str) -> float:
        """How busy the host's other CPUs were lately with other workers' steps (0 to 1)."""
        horizon = clock.monotonic() - self.window_s
        while self._work and self._work[0][0] < horizon:
            self._work.popleft()
        others = sum(seconds for _, worker, seconds in self._work if worker != worker_id)
        return min(1.0, others / self.window_s / max(1, self.host.cpus - 1))
