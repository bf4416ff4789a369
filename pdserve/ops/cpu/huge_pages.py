"""The KV cache on transparent huge pages (2 MiB) where the kernel allows it (torch).

A decode step reads every running sequence's blocks, and a serving engine's blocks end up
scattered over a cache of a GiB or more: on 4 KiB pages nearly every block costs a TLB miss and a
page walk before its first byte arrives. Measured (benchmarks/kv_huge_pages.py, docs/performance.md
"KV cache blocks: block size and huge pages"): decode attention over 30 layers' scattered 16-token blocks of
a 1.5 GiB cache, one thread, AVX512-BF16 EPYC, took 0.87-0.93x the time on 2 MiB pages; over blocks
in order (a fresh engine) or 64-token blocks the difference is within the noise.

Linux hands a private anonymous mapping huge pages when `transparent_hugepage/enabled` is
`always`, or `madvise` and the mapping asked (MADV_HUGEPAGE); torch's own allocator asks only when
THP_MEM_ALLOC_ENABLE=1 was set before it started. Shared memory (the `shm` transport's segments)
follows `transparent_hugepage/shmem_enabled` instead; see transfer/shm.py.
PDSERVE_KV_HUGE_PAGES=0 turns the advice off (the cache is then a plain torch.zeros).
"""

from __future__ import annotations

import contextlib
import math
import mmap
import os
from pathlib import Path

import torch

THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_SHMEM_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/shmem_enabled")
# Linux's values (Python's mmap module has MADV_HUGEPAGE, and MADV_POPULATE_WRITE only from 3.12).
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_POPULATE_WRITE = 23


def wanted() -> bool:
    """False when PDSERVE_KV_HUGE_PAGES is 0/false/no/off: the cache is then torch.zeros."""
    value = os.environ.get("PDSERVE_KV_HUGE_PAGES", "1").strip().lower()
    return value not in ("0", "false", "no", "off")


def thp_setting(path: Path = THP_ENABLED) -> str:
    """The selected value of a THP setting ('always', 'madvise', 'never', ...), or 'unavailable'
    (not Linux, or a kernel without THP)."""
    try:
        text = path.read_text()
    except OSError:
        return "unavailable"
    chosen = [word[1:-1] for word in text.split() if word.startswith("[") and word.endswith("]")]
    return chosen[0] if chosen else "unavailable"


def huge_pages_possible(setting: str) -> bool:
    """Whether a mapping that asks (MADV_HUGEPAGE) gets huge pages under this setting."""
    return setting in ("always", "madvise", "within_size", "advise", "force")


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, bool]:
    """A zeroed CPU tensor in its own anonymous mapping that asked for huge pages, every page mapped
    now (as torch.zeros would touch them: no page fault later, mid-step). Returns the tensor and
    whether the kernel's setting lets the advice take effect. The mapping lives as long as the
    tensor (torch.frombuffer keeps a reference to it)."""
    numel = math.prod(shape)
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    # Anonymous memory is zero-filled by the kernel; MAP_PRIVATE: never shared with a child.
    mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advised = False
    with contextlib.suppress(OSError, AttributeError):  # AttributeError: no madvise (not Linux)
        mapping.madvise(MADV_HUGEPAGE)
        advised = True
    with contextlib.suppress(OSError, AttributeError):  # EINVAL before Linux 5.14: faulted lazily
        mapping.madvise(MADV_POPULATE_WRITE)
    tensor = torch.frombuffer(mapping, dtype=dtype, count=numel).view(shape)
    return tensor, advised and huge_pages_possible(thp_setting())


def anon_huge_bytes(tensor: torch.Tensor) -> int | None:
    """Bytes of `tensor`'s mapping that the kernel backs with huge pages now (AnonHugePages of the
    mapping that holds its first byte, from /proc/self/smaps), or None where that cannot be read."""
    address = tensor.data_ptr()
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return None
    inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):  # a mapping's header: start-end perms ...
            start, _, end = head.partition("-")
            try:
                inside = int(start, 16) <= address < int(end, 16)
            except ValueError:
                inside = False
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1]) * 1024
    return None
