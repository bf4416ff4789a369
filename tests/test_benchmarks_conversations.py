"""benchmarks/conversations.py: the oracle's hit rate (every later turn finds the turn before it)."""

from __future__ import annotations

from types import ModuleType

from benchmark_scripts import benchmark

from pdserve.bench.summary import RequestRecord


def load_script() -> ModuleType:
    return benchmark("conversations", "conversations_benchmark")


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
