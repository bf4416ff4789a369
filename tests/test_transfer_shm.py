"""Shared-memory KV segments: visible to another process, gone when their owner is."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import pytest
import torch

from pdserve.transfer.segments import leftover_segments
from pdserve.transfer.shm import AttachedSegment, OwnedSegment, SharedSegmentError


def test_another_process_reads_what_the_owner_wrote() -> None:
    segment = OwnedSegment((4, 8, 16), torch.float32)
    try:
        segment.tensor.copy_(torch.arange(4 * 8 * 16, dtype=torch.float32).view(4, 8, 16))
        code = (
            "import sys, torch; from pdserve.transfer.shm import AttachedSegment;"
            f"a = AttachedSegment({segment.name!r}, (4, 8, 16), torch.float32);"
            "print(float(a.tensor[2].sum())); a.close()"
        )
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert float(out.stdout) == float(segment.tensor[2].sum())
        assert segment.name in leftover_segments(os.getpid())  # an attacher leaves it in place
    finally:
        segment.close()
    assert segment.name not in leftover_segments()


def test_segment_of_a_killed_owner_is_removed() -> None:
    code = (
        "import os, torch; from pdserve.transfer.shm import OwnedSegment;"
        "s = OwnedSegment((1024,), torch.float32); print(s.name, flush=True); os.kill(os.getpid(), 9)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL
    name = proc.stdout.strip()
    deadline = time.monotonic() + 10
    while name in leftover_segments() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert name not in leftover_segments()


def test_attach_errors_are_clear() -> None:
    with pytest.raises(SharedSegmentError, match="not a pdserve"):
        AttachedSegment("../etc/passwd", (1,), torch.float32)
    with pytest.raises(SharedSegmentError, match="cannot open"):
        AttachedSegment("pdserve-kv-0-missing", (1,), torch.float32)
    segment = OwnedSegment((4,), torch.float32)
    try:
        with pytest.raises(SharedSegmentError, match="expected at least"):
            AttachedSegment(segment.name, (1 << 20,), torch.float32)
    finally:
        segment.close()
        segment.close()  # twice is fine


def test_importer_copies_blocks_into_its_own_block_ids_and_counts() -> None:
    from pdserve.transfer.base import FaultInjector, TransferError
    from pdserve.transfer.shm import ShmImporter

    shape = (3, 2, 8, 4, 2, 8)  # [layers, K/V, blocks, block_size, kv_heads, head_dim]
    owner = OwnedSegment(shape, torch.float32)
    owner.tensor.copy_(torch.randn(shape))
    local = torch.zeros((3, 2, 5, 4, 2, 8))  # a different number of blocks on this side
    importer = ShmImporter(local)
    try:
        moved = importer.pull(owner.name, [3, 6], [0, 4], timeout=5.0)
        assert torch.equal(local[:, :, 0], owner.tensor[:, :, 3]) and torch.equal(
            local[:, :, 4], owner.tensor[:, :, 6]
        )
        assert torch.count_nonzero(local[:, :, 1:4]) == 0  # nothing else touched
        assert moved == 2 * 3 * 2 * 4 * 2 * 8 * 4 and importer.stats.bytes == moved
        with pytest.raises(TransferError, match="outside"):
            importer.pull(owner.name, [8], [0], timeout=5.0)
        with pytest.raises(TransferError, match="gone"):
            importer.pull("pdserve-kv-0-nothere", [0], [0], timeout=5.0)
        with pytest.raises(TransferError, match="destination block 5 is outside this cache"):
            importer.pull(owner.name, [0], [5], timeout=5.0)  # every transport checks this, in the base
        importer.faults = FaultInjector(rate=1.0)
        with pytest.raises(TransferError, match="injected"):
            importer.pull(owner.name, [1], [1], timeout=5.0)
        assert importer.stats.pulls == 4 and importer.stats.failures == 3
    finally:
        importer.close()
        owner.close()
    assert owner.name not in leftover_segments()


def test_blocks_are_copied_in_runs_consecutive_on_both_sides() -> None:
    from pdserve.transfer.shm import _runs

    assert _runs([4, 5, 6, 9, 10], [0, 1, 2, 3, 7]) == [(4, 0, 3), (9, 3, 1), (10, 7, 1)]
    assert _runs([], []) == []


def test_a_segment_larger_than_dev_shm_is_a_clear_error_at_once_not_a_sigbus_later() -> None:
    free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize
    with pytest.raises(SharedSegmentError, match=r"/dev/shm|shared-memory segment"):
        OwnedSegment((free + 2**30,), torch.uint8)
    assert leftover_segments(os.getpid()) == []  # nothing half-made is left


def test_a_segment_is_readable_and_writable_by_its_owner_only() -> None:
    """Another user of the host cannot read a worker's KV (prompts in clear) nor write into it."""
    owner = OwnedSegment((2, 2, 4, 4, 2, 8), torch.float32)
    try:
        mode = os.stat(f"/dev/shm/{owner.name}").st_mode
        assert stat.S_IMODE(mode) == 0o600, oct(mode)
    finally:
        owner.close()
