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

import asyncio
import logging
import time

from pdserve import wire
from pdserve.router.workers import Leg, WorkerLink, WorkerSet

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05


def ask_to_move(link: WorkerLink, legs: list[Leg], reason: str) -> int:
    """Ask the worker to hand these streams over (each answers with Migrated). Returns how many."""
    legs = [leg for leg in legs if not leg.done and leg.move_reason is None]
    if not legs:
        return 0
    for leg in legs:
        leg.move_reason = reason
    if not link.send(wire.Migrate([leg.leg_id for leg in legs])):
        for leg in legs:  # not connected: nothing was asked
            leg.move_reason = None
        return 0
    return len(legs)


async def drain(link: WorkerLink, workers: WorkerSet, timeout: float, *, moves_streams: bool) -> str:
    """Wait until the draining worker holds nothing. Returns the outcome: `ok`, `timeout` (it
    still held something after `timeout` seconds) or `lost` (it went down or ended meanwhile)."""
    deadline = time.monotonic() + timeout
    empty_since: float | None = None
    while True:
        if not link.connected:
            return "lost"
        if moves_streams:
            others = [w for w in workers.up(link.pool) if w is not link]
            if others:
                ask_to_move(link, link.streams(), "drain")
        if link.legs:
            empty_since = None
        elif empty_since is None:
            empty_since = time.monotonic()
        elif link.idle_since(empty_since):
            return "ok"
        if time.monotonic() > deadline:
            logger.warning(
                "worker %s: drain timed out after %g s with %d requests still on it",
                link.worker_id,
                timeout,
                len(link.legs),
            )
            return "timeout"
        await asyncio.sleep(POLL_SECONDS)
