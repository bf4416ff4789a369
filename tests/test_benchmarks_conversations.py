"""benchmarks/conversations.py: the oracle's hit rate (every later turn finds the turn before it)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from pdserve.bench.summary import RequestRecord

ROOT = Path(__file__).resolve().parents[1]


def load_script() -> object:
    spec = importlib.util.spec_from_file_location(
        "conversations_benchmark", ROOT / "benchmarks" / "conversations.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def turn(session: int, n: int, prompt: int, output: int) -> RequestRecord:
    r = RequestRecord(session + n, "talk", None, float(n), prompt, output, [float(n) + 0.1])
    r.session, r.turn = session, n
    return r


def test_the_oracle_finds_each_later_turn_s_predecessor_in_whole_blocks() -> None:
    script = load_script()
    records = [
        turn(0, 0, 100, 30),  # nothing before it
        turn(0, 1, 150, 20),  # 129 reusable: 128 in whole blocks of 64
        turn(0, 2, 190, 10),  # 169 reusable: 128
        turn(10, 0, 50, 10),
        turn(10, 1, 70, 5),  # 59 reusable: 0 whole blocks
    ]
    rate = script.oracle_hit_rate(records, 64)  # type: ignore[attr-defined]
    assert rate == (128 + 128) / (100 + 150 + 190 + 50 + 70)
