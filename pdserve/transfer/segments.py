"""KV segments in /dev/shm: their names, who owns one, and removing those whose owner is dead.
No torch (the cluster backends sweep a host without loading it).

A worker's segment is removed by the worker when it closes, and by Python's resource tracker (a
child process of the worker) when the worker is killed. Neither runs when the whole process tree
is killed at once: a lost Ray node (its raylet kills every process it started), a container's
cgroup killed by the OOM killer, `kill -9` of a process group. The segment then stays in /dev/shm,
holding as much memory as the KV cache, with nobody to remove it.

So the owner holds an exclusive `flock` on its segment for as long as it lives; the kernel lets go
of it when the process ends, however it ends. A segment whose lock can be taken has no owner, and
`sweep_dead_segments` removes it. That is exact across PID namespaces (two containers sharing one
/dev/shm), where a pid in the name would prove nothing. A segment is born locked: it is created
under a temporary name (`<name>.new`), locked, given its memory, and only then renamed to its
name, so no sweep ever sees a segment of a live owner unlocked. A temporary file is unlocked only
for the microseconds between its creation and its lock, so a sweep removes one only once it has
stayed unchanged for a few seconds (its creator died before publishing it).
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)

SEGMENT_PREFIX = "pdserve-kv-"
SHM_DIR = Path("/dev/shm")
# An unpublished file this recent may be one whose creator has not yet taken its lock.
_NEWBORN_SECONDS = 5.0


_UNPUBLISHED = ".new"


class SegmentSpaceError(OSError):
    """/dev/shm has no room for the segment."""


def segment_name(pid: int, suffix: str) -> str:
    return f"{SEGMENT_PREFIX}{pid}-{suffix}"


def create_locked_segment(name: str, nbytes: int, directory: Path = SHM_DIR) -> int:
    """Create segment `name` of `nbytes` (memory given now, zero-filled), locked by this process
    from birth: returns the descriptor that holds the lock until closed (or until the process
    ends). FileExistsError if the name is taken; SegmentSpaceError if /dev/shm has no room.

    /dev/shm hands out pages on first touch: without the fallocate, a segment larger than what
    /dev/shm has left would kill its owner with SIGBUS mid-request."""
    temporary = directory / (name + _UNPUBLISHED)
    fd = os.open(temporary, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # nobody else knows this inode yet: at once
        try:
            os.posix_fallocate(fd, 0, max(nbytes, 1))
        except OSError as exc:
            raise SegmentSpaceError(exc.errno, exc.strerror) from exc
        os.link(temporary, directory / name)  # published, already locked (FileExistsError if taken)
        temporary.unlink()
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        os.close(fd)
        raise
    return fd


def leftover_segments(pid: int | None = None, directory: Path = SHM_DIR) -> list[str]:
    """Names of pdserve KV segments in /dev/shm (of one process, if `pid` is given)."""
    prefix = SEGMENT_PREFIX if pid is None else f"{SEGMENT_PREFIX}{pid}-"
    try:
        return sorted(p.name for p in directory.iterdir() if p.name.startswith(prefix))
    except FileNotFoundError:
        return []


def sweep_dead_segments(directory: Path = SHM_DIR, newborn_seconds: float = _NEWBORN_SECONDS) -> list[str]:
    """Remove every pdserve KV segment in `directory` whose owner is gone (its lock is free);
    returns their names. Any process on the host may call it: a live owner's segment is never
    touched (it is locked from its birth), and an unpublished one is removed only once it has
    stayed unchanged for `newborn_seconds`."""
    removed: list[str] = []
    for name in leftover_segments(directory=directory):
        path = directory / name
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            continue  # gone already, or not ours to open
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # its owner is alive
            if name.endswith(_UNPUBLISHED):
                info = os.fstat(fd)
                if time.time() - max(info.st_mtime, info.st_ctime) < newborn_seconds:
                    continue  # perhaps created a moment ago, its creator about to lock it
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                removed.append(name)
        finally:
            os.close(fd)  # lets go of the lock too
    if removed:
        logger.warning(
            "removed %d KV segment(s) left in %s by workers that died without closing them: %s",
            len(removed),
            directory,
            ", ".join(removed),
        )
    return removed
