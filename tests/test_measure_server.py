"""The real `pdserve serve` behind `pdserve profile`'s probes: one that cannot start says why."""

from __future__ import annotations

import pytest

from pdserve.errors import PdserveError
from pdserve.measure.server import running


def test_a_server_that_cannot_start_is_reported_with_its_own_words() -> None:
    with (
        pytest.raises(PdserveError, match=r"(?s)exited with \d+ while starting: .*no-such-model"),
        running("no-such-model", ["--colocated", "1"]),
    ):
        pytest.fail("a server of no model answered")
