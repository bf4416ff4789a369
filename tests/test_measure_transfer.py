"""KV pulls timed over the real transports, with the checksum check, fitted to base + per block;
nothing left behind (no segment, no thread)."""

from __future__ import annotations

import threading

import pytest
import torch

from pdserve.measure import transfer
from pdserve.transfer.segments import SEGMENT_PREFIX, SHM_DIR


@pytest.mark.parametrize("name", ["shm", "tcp"])
def test_pulls_are_timed_and_fitted_and_nothing_is_left(name: str) -> None:
    before = set(SHM_DIR.glob(f"{SEGMENT_PREFIX}*"))
    shape = transfer.cache_shape(2, 8, 16, 2, 8)
    t = transfer.measure(name, shape, torch.bfloat16, counts=(1, 2, 4, 8), repeats=2)
    assert [n for n, _ in t.samples] == [1, 2, 4, 8]
    assert all(seconds > 0 for _, seconds in t.samples)
    assert t.base_s >= 0 and t.per_block_s >= 0
    assert t.seconds(8) >= t.seconds(1)
    assert set(SHM_DIR.glob(f"{SEGMENT_PREFIX}*")) <= before
    assert not [th for th in threading.enumerate() if th.name.startswith("kv-tcp")]


def test_a_transport_it_cannot_measure_is_said() -> None:
    with pytest.raises(ValueError, match="cannot measure the nixl transport"):
        transfer.measure("nixl", transfer.cache_shape(1, 2, 4, 1, 4), torch.float32)


def test_the_line_through_the_medians() -> None:
    assert transfer._line([(1, 0.003), (2, 0.005), (4, 0.009)]) == pytest.approx((0.001, 0.002))
    assert transfer._line([(1, 0.005), (4, 0.002)]) == pytest.approx((0.0035, 0.0))  # never negative
