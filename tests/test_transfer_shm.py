"""Shared-memory KV segments: visible to another process, gone when their owner is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from pdserve.transfer.shm import AttachedSegment, OwnedSegment, SharedSegmentError, leftover_segments


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
