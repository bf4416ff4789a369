"""Dead workers' KV segments: born locked by their owner, swept once nobody holds the lock."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pdserve.transfer.segments import (
    SegmentSpaceError,
    create_locked_segment,
    leftover_segments,
    segment_name,
    sweep_dead_segments,
)


def test_a_segment_is_born_locked_and_swept_only_once_its_owner_lets_go(tmp_path: Path) -> None:
    name = segment_name(os.getpid(), "live")
    fd = create_locked_segment(name, 4096, tmp_path)
    try:
        assert (tmp_path / name).stat().st_size == 4096
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600
        assert leftover_segments(directory=tmp_path) == [name]  # no temporary name left
        assert sweep_dead_segments(tmp_path, newborn_seconds=0) == []  # its owner holds it
        with pytest.raises(FileExistsError):
            create_locked_segment(name, 4096, tmp_path)
        assert leftover_segments(directory=tmp_path) == [name]
    finally:
        os.close(fd)
    assert sweep_dead_segments(tmp_path) == [name]  # no owner: removed at once, however young


def test_only_pdserve_segments_are_swept(tmp_path: Path) -> None:
    (tmp_path / "someone-elses").write_bytes(b"x")
    (tmp_path / segment_name(1, "dead")).write_bytes(b"x")
    assert sweep_dead_segments(tmp_path) == [segment_name(1, "dead")]
    assert (tmp_path / "someone-elses").exists()


def test_an_unpublished_segment_is_left_alone_while_it_may_be_being_born(tmp_path: Path) -> None:
    """Between creating its temporary file and locking it, a creator's file is unlocked: a sweep
    removes an unpublished one only once it has stayed unchanged for a while."""
    unpublished = tmp_path / (segment_name(1, "x") + ".new")
    unpublished.write_bytes(b"")
    assert sweep_dead_segments(tmp_path, newborn_seconds=60) == []
    assert unpublished.exists()
    assert sweep_dead_segments(tmp_path, newborn_seconds=0) == [unpublished.name]


def test_no_room_is_its_own_error_and_leaves_nothing(tmp_path: Path) -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    free = os.statvfs("/dev/shm")
    too_big = free.f_bavail * free.f_frsize + (1 << 30)
    name = segment_name(os.getpid(), "huge")
    with pytest.raises(SegmentSpaceError):
        create_locked_segment(name, too_big)
    assert leftover_segments(os.getpid()) == []


def test_a_worker_killed_with_its_resource_tracker_leaves_a_segment_that_a_sweep_removes() -> None:
    """What the lock is for: the whole process group killed at once (a lost Ray node, an OOM
    kill), so Python's resource tracker cannot remove the segment for its owner."""
    code = (
        "import time, torch; from pdserve.transfer.shm import OwnedSegment;"
        "s = OwnedSegment((1024,), torch.float32); print(s.name, flush=True); time.sleep(60)"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
        assert name in leftover_segments(proc.pid)
        assert name not in sweep_dead_segments()  # its owner lives: untouched
        assert name in leftover_segments(proc.pid)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the owner and its resource tracker, together
        proc.wait()
    time.sleep(1.0)
    assert name in leftover_segments(), "the resource tracker removed it: this test shows nothing"
    assert name in sweep_dead_segments()
    assert name not in leftover_segments()
