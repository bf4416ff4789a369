"""`pdserve profile --served`'s start probe: a real DPD server under load asked for a second prefill
worker, timed from asking to its being up."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.errors import PdserveError
from pdserve.measure import start


def test_a_second_prefill_worker_is_timed_from_asked_to_up_while_the_server_serves(tiny_llama: Path) -> None:
    # Short prompts at 8 a second x3.5: the prefill worker has work when the start is asked for.
    workload = "chat: poisson(8) prompt=uniform(16,64) output=uniform(4,24)"
    seconds = start.start_beside_busy(str(tiny_llama), threads=1, workload=workload, probes=1, warm_s=0.5)
    # A worker process's start (its imports, the model, its KV cache) is never instant, and it came
    # up (the probe raises when it does not).
    assert 0.1 < seconds < start.START_TIMEOUT_S


def test_the_load_is_the_top_of_the_profiles_staircase() -> None:
    builtin = start.top_load(None, 1.0, 7)
    assert [c.arrival.rate for c in builtin.classes] == pytest.approx([2 * 3.5, 0.1 * 3.5])  # type: ignore[attr-defined]
    given = start.top_load("poisson(2) prompt=fixed(32) output=fixed(8)", 0.5, 7)
    assert given.classes[0].arrival.rate == pytest.approx(3.5)  # type: ignore[attr-defined]
    assert not builtin.steps and given.duration_s == start.LOAD_S
    with pytest.raises(PdserveError):
        start.top_load("poisson(2) prompt=nonsense", 1.0, 7)
