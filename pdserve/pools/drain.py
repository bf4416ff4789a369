"""Drain a worker without losing anything, and move streams between workers. No torch.

Draining: the worker is out of service (the router sends it nothing new) and this waits until it
holds nothing, or until the drain timeout:
- a prefill worker finishes the prompts it holds and keeps their KV until the decode workers have
  pulled it (the router releases each lease once the pull is done) or the lease ran out;
- a decode (or colocated) worker's streams move to the other workers of its pool (`Migrate`: the
  worker stops each between two tokens and holds its blocks; the router continues it elsewhere,
  `pdserve.router.dispatch`). While no other worker is up, the streams carry on where they are.
The worker is idle when the router has no leg open on it and a load report sent after that says it
holds no request and no block.
"""

from __future__ import annotations

import logging

from pdserve import clock
from pdserve.router.workers import WorkerSet

logger = logging.getLogger(__name__)

# The longest wait between two looks at a draining worker when nothing changes (a worker reports
# its load every 0.1 s, and every report wakes the drain).
WAKE_SECONDS = 1.0


async def drain(workers: WorkerSet, worker_id: str, timeout: float, *, moves_streams: bool) -> str:
    """Wait until the draining worker holds nothing. Returns the outcome: `ok`, `timeout` (it
    still held something after `timeout` seconds) or `lost` (it went down or ended meanwhile)."""
    deadline = clock.monotonic() + timeout
    empty_since: float | None = None
    while True:
        view = workers.view(worker_id)
        if view is None or not view.connected:
            return "lost"
        if moves_streams and any(w.worker_id != worker_id for w in workers.up(view.pool)):
            workers.move_streams(worker_id, "drain")
        if view.streams:
            empty_since = None
        elif empty_since is None:
            empty_since = clock.monotonic()  # a report after this moment decides
        elif view.idle_since(empty_since):
            return "ok"
        left = deadline - clock.monotonic()
        if left <= 0:
            logger.warning(
                "worker %s: drain timed out after %g s with %d requests still on it",
                worker_id,
                timeout,
                view.streams,
            )
            return "timeout"
        await workers.wait_for_change(min(left, WAKE_SECONDS))
