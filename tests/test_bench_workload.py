"""The workload model of `pdserve bench`: classes, merged streams, parsed traces, the spec and presets."""

from __future__ import annotations

import csv
import itertools
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.bench.distributions import (
    Concurrency,
    Constant,
    Fixed,
    Poisson,
    Step,
    Stepped,
    SyntheticLengths,
    Uniform,
    WorkloadError,
)
from pdserve.bench.traces import load_lengths
from pdserve.bench.workload import (
    NAMED_MIXES,
    WorkloadClass,
    build_workload,
    parse_workload,
)

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"
AZURE, SHAREGPT = TRACES / "azure_conv_2023.csv", TRACES / "sharegpt_lengths.csv"
needs_traces = pytest.mark.skipif(not AZURE.exists(), reason=f"no traces in {TRACES}")


def _csv_rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as f:
        return list(csv.DictReader(f))


def test_the_same_seed_gives_the_same_requests_and_another_seed_others() -> None:
    spec = "chat: poisson(rate=3) prompt=lognormal(200, 0.6) output=uniform(50, 150); doc: gamma(0.5, 0.5) prompt=fixed(900) output=fixed(9)"
    a, b = parse_workload(spec, 7, 200), parse_workload(spec, 7, 200)
    assert a.requests == b.requests and len(a.requests) == 200
    assert parse_workload(spec, 8, 200).requests != a.requests
    assert [r.index for r in a.requests] == list(range(200))
    times = [r.arrival_s for r in a.requests]
    assert times == sorted(times)  # type: ignore[type-var]


def test_adding_or_reordering_classes_leaves_another_class_draws_alone() -> None:
    chat = "chat: poisson(rate=2) prompt=lognormal(100, 0.5) output=uniform(32, 96)"
    docs = "docs: constant(rate=0.2) prompt=fixed(1500) output=fixed(16)"
    bursty = "burst: gamma(rate=5, burstiness=0.3) prompt=uniform(1, 9) output=fixed(3)"

    def chat_requests(spec: str) -> list[tuple[float | None, int, int]]:
        w = parse_workload(spec, 3, duration_s=120)
        return [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in w.requests if r.cls == "chat"]

    alone = chat_requests(chat)
    assert len(alone) > 150
    assert chat_requests(f"{chat}; {docs}") == alone
    assert chat_requests(f"{docs}; {bursty}; {chat}") == alone


def test_generation_stops_at_max_requests_or_duration_whichever_comes_first() -> None:
    spec = "a: poisson(rate=4) prompt=fixed(8) output=fixed(8); b: constant(rate=1) prompt=fixed(9) output=fixed(9)"
    by_count = parse_workload(spec, 0, max_requests=50)
    assert len(by_count.requests) == 50
    by_time = parse_workload(spec, 0, duration_s=100.0)
    assert all(r.arrival_s is not None and r.arrival_s < 100.0 for r in by_time.requests)
    assert sum(r.cls == "b" for r in by_time.requests) == 99  # at 1, 2, ..., 99 s
    assert 340 < sum(r.cls == "a" for r in by_time.requests) < 460  # 400 +- 3 sd
    # The first 50 by time are the ones the count cap keeps; a long duration changes nothing.
    assert by_time.requests[:50] == by_count.requests
    assert parse_workload(spec, 0, 50, 10_000.0).requests == by_count.requests
    assert len(parse_workload(spec, 0, 10_000, 10.0).requests) == len(
        parse_workload(spec, 0, None, 10.0).requests
    )
    with pytest.raises(WorkloadError, match="max_requests and/or duration_s"):
        parse_workload(spec, 0)


def test_closed_loop_concurrency_has_no_arrival_times() -> None:
    w = parse_workload("concurrency(8) prompt=fixed(128) output=fixed(64)", 0, 40, 30.0)
    assert w.concurrency == 8 and len(w.requests) == 40
    assert all(r.arrival_s is None and (r.prompt_tokens, r.output_tokens) == (128, 64) for r in w.requests)
    assert parse_workload("poisson(1) prompt=fixed(1) output=fixed(1)", 0, 5).concurrency is None
    with pytest.raises(WorkloadError, match="needs max_requests"):
        parse_workload("concurrency(8) prompt=fixed(128) output=fixed(64)", 0, duration_s=30.0)
    with pytest.raises(WorkloadError, match="only class"):
        parse_workload(
            "a: concurrency(2) prompt=fixed(1) output=fixed(1); b: poisson(1) prompt=fixed(1) output=fixed(1)",
            0,
            9,
        )
    assert Concurrency(8).scaled(1.5) == Concurrency(12)


@needs_traces
def test_a_parsed_trace_keeps_each_row_arrival_with_its_lengths() -> None:
    rows = _csv_rows(AZURE)
    w = parse_workload(f"trace(path={AZURE}, time_scale=2, length_scale=0.1)", 0, 100, 60.0)
    assert len(w.requests) == sum(float(r["arrived_at"]) * 2 < 60.0 for r in rows[:100])
    for req, row in zip(w.requests, rows, strict=False):
        assert req.arrival_s == pytest.approx(float(row["arrived_at"]) * 2)
        assert req.prompt_tokens == max(1, round(int(row["num_prefill_tokens"]) * 0.1))
    faster = parse_workload(f"trace(path={AZURE})", 0, 100, rate_scale=4.0)
    assert faster.requests[10].arrival_s == pytest.approx(float(rows[10]["arrived_at"]) / 4)


@needs_traces
def test_a_lengths_only_csv_gets_drawn_arrivals_and_paired_rows() -> None:
    rows = _csv_rows(SHAREGPT)
    pairs = {(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"])) for r in rows}
    w = parse_workload(f"lengths(path={SHAREGPT}) gamma(rate=1, burstiness=0.5)", 5, 300)
    assert len(w.requests) == 300 and all(r.arrival_s is not None for r in w.requests)
    assert all((r.prompt_tokens, r.output_tokens) in pairs for r in w.requests)  # rows stay paired
    assert len({r.prompt_tokens for r in w.requests}) > 100  # drawn, not the first rows
    in_order = parse_workload(f"lengths({SHAREGPT}, order=file, max_output_tokens=500) poisson(2)", 5, 20)
    assert [r.prompt_tokens for r in in_order.requests] == [int(r["num_prefill_tokens"]) for r in rows[:20]]
    assert [r.output_tokens for r in in_order.requests] == [
        min(500, int(r["num_decode_tokens"])) for r in rows[:20]
    ]
    assert load_lengths(SHAREGPT, length_scale=0.01).prompts[0] == max(
        1, round(int(rows[0]["num_prefill_tokens"]) * 0.01)
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            "poisson(rate=2) prompt=lognorm(200,0.6) output=fixed(5)",
            "unknown distribution 'lognorm' in 'prompt=lognorm(200,0.6)'; known: fixed, uniform, lognormal, empirical",
        ),
        (
            "poison(2) prompt=fixed(1) output=fixed(1)",
            "unknown arrival process 'poison' in 'poison(2)'; known: poisson, gamma, constant, concurrency, trace, lengths, step (did you mean 'poisson'?)",
        ),
        (
            "poisson(rate=fast) prompt=fixed(1) output=fixed(1)",
            "bad value 'fast' for rate in 'poisson(rate=fast)': expected a number",
        ),
        (
            "poisson(1) prompt=fixed(1.5) output=fixed(1)",
            "bad value '1.5' for n in 'prompt=fixed(1.5)': expected a whole number",
        ),
        (
            "poisson(1, 2) prompt=fixed(1) output=fixed(1)",
            "too many positional arguments in 'poisson(1, 2)'; poisson takes rate",
        ),
        (
            "gamma(rate=1) prompt=fixed(1) output=fixed(1)",
            "missing a required argument: 'burstiness' in 'gamma(rate=1)'",
        ),
        (
            "poisson(rate=1, rate=2) prompt=fixed(1) output=fixed(1)",
            "an argument is given twice in 'poisson(rate=1, rate=2)'",
        ),
        (
            "poisson(-1) prompt=fixed(1) output=fixed(1)",
            "rate must be a finite number > 0, got -1.0 (in 'poisson(-1)')",
        ),
        (
            "poisson(1) prompt=uniform(9, 3) output=fixed(1)",
            "uniform needs 1 <= lo <= hi, got lo=9, hi=3 (in 'prompt=uniform(9, 3)')",
        ),
        ("poisson(1) prompt=fixed(1)", "missing output= in 'poisson(1) prompt=fixed(1)'"),
        ("prompt=fixed(1) output=fixed(1)", "no arrival process in 'prompt=fixed(1) output=fixed(1)'"),
        (
            "poisson(1) constant(1) prompt=fixed(1) output=fixed(1)",
            "two arrival processes in 'poisson(1) constant(1) prompt=fixed(1) output=fixed(1)': 'poisson(1)' and 'constant(1)'",
        ),
        (
            "poisson(1) promt=fixed(1) output=fixed(1)",
            "unknown key 'promt' in 'promt=fixed(1)'; known: prompt, output",
        ),
        (
            "poisson(1 prompt=fixed(1) output=fixed(1)",
            "missing ')' in 'poisson(1 prompt=fixed(1) output=fixed(1)'",
        ),
        ("poisson(1)) prompt=fixed(1) output=fixed(1)", "unmatched ')' in 'poisson(1))'"),
        ("poisson(1) prompt=fixed(1) output=fixed(1) extra", "at 'extra'"),
        (
            "a: poisson(1) prompt=fixed(1) output=fixed(1); poisson(2) prompt=fixed(1) output=fixed(1)",
            "with several classes, each needs a name",
        ),
        (
            "a: poisson(1) prompt=fixed(1) output=fixed(1); a: poisson(2) prompt=fixed(1) output=fixed(1)",
            "class names must be unique; repeated: a",
        ),
        ("chat+doc", "unknown preset 'chat+doc'; known: chat, "),
        ("  ", "empty workload spec"),
    ],
)
def test_parse_errors_say_what_is_wrong_and_where(spec: str, message: str) -> None:
    with pytest.raises(WorkloadError) as error:
        parse_workload(spec, 0, 10)
    assert message in str(error.value)


@needs_traces
def test_parse_errors_about_sources() -> None:
    with pytest.raises(WorkloadError, match="missing column\\(s\\) arrived_at"):
        parse_workload(f"trace({SHAREGPT})", 0, 10)
    with pytest.raises(WorkloadError, match="two arrival processes"):
        parse_workload(f"poisson(1) trace({AZURE})", 0, 10)
    with pytest.raises(WorkloadError, match="gives both lengths; drop output="):
        parse_workload(f"poisson(1) lengths({SHAREGPT}) output=fixed(3)", 0, 10)
    with pytest.raises(WorkloadError, match="time_scale or rate, not both"):
        parse_workload(f"trace({AZURE}, time_scale=1, rate=2)", 0, 10)


def test_presets_parse_and_scale() -> None:
    assert {"chat", "chat+docs"} <= NAMED_MIXES.keys()
    for name in NAMED_MIXES:
        assert parse_workload(name, 0, duration_s=60.0).requests
    mix = parse_workload("chat+docs", 0, duration_s=60.0)
    assert [c.name for c in mix.classes] == ["chat", "docs"]
    docs = [r for r in mix.requests if r.cls == "docs"]
    assert [r.arrival_s for r in docs] == pytest.approx([5.0 * k for k in range(1, 12)])
    assert {(r.prompt_tokens, r.output_tokens) for r in docs} == {(1500, 16)}
    chat = [r for r in mix.requests if r.cls == "chat"]
    assert 40 < len(chat) < 85 and all(
        16 <= r.prompt_tokens <= 400 and 32 <= r.output_tokens <= 96 for r in chat
    )
    doubled = parse_workload("chat+docs", 0, duration_s=60.0, rate_scale=2.0)
    assert [r.arrival_s for r in doubled.requests if r.cls == "docs"][:2] == pytest.approx([2.5, 5.0])
    assert "constant(rate=0.4)" in doubled.describe() and "poisson(rate=2)" in doubled.describe()


def test_describe_has_a_line_per_class() -> None:
    w = parse_workload("chat+docs", 0, 30)
    lines = w.describe().splitlines()
    assert len(lines) == 2
    assert lines[0].startswith(
        "chat: poisson(rate=1) prompt=lognormal(median=100, sigma=0.5, min=16, max=400)"
    )
    assert lines[1].startswith("docs: constant(rate=0.2) prompt=fixed(n=1500) output=fixed(n=16)")
    assert f"[{sum(r.cls == 'docs' for r in w.requests)} requests]" in lines[1]


def test_classes_can_be_built_without_the_spec() -> None:
    chat = WorkloadClass("chat", Poisson(2.0), SyntheticLengths(Fixed(10), Uniform(1, 4)))
    w = build_workload([chat], seed=1, max_requests=30)
    assert (
        len(w.requests) == 30
        and w.requests
        == parse_workload("chat: poisson(2) prompt=fixed(10) output=uniform(1, 4)", 1, 30).requests
    )
    with pytest.raises(WorkloadError, match="bad class name"):
        WorkloadClass("two words", Poisson(1.0), SyntheticLengths(Fixed(1), Fixed(1)))


def test_importing_the_workload_module_does_not_load_torch() -> None:
    code = (
        "import sys, pdserve.bench.workload, pdserve.bench.timeline, pdserve.bench.client, pdserve.bench.run; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- rate steps -------------------------------------------------------------------------------


def _counts(spec: str, seed: int, edges: list[float]) -> list[int]:
    w = parse_workload(spec, seed, duration_s=edges[-1])
    times = [r.arrival_s for r in w.requests]
    return [sum(lo <= t < hi for t in times if t is not None) for lo, hi in itertools.pairwise(edges)]


def test_a_poisson_step_multiplies_the_arrivals_of_its_segment() -> None:
    """poisson(2) for 60 s, x3 for 60 s, back to 2: 120, 360, 120 expected per segment."""
    spec = "chat: poisson(2) step(60, 60, 3) prompt=fixed(8) output=fixed(8)"
    edges = [0.0, 60.0, 120.0, 180.0]
    expected = [120, 360, 120]
    for n, mean in zip(_counts(spec, 0, edges), expected, strict=True):
        assert abs(n - mean) < 4 * math.sqrt(mean), (n, mean)  # Poisson counts: sd sqrt(mean)
    # Over 30 seeds the mean count of each segment is within 2% of the expectation (4 sd of the mean).
    totals = [0, 0, 0]
    for seed in range(30):
        for k, n in enumerate(_counts(spec, seed, edges)):
            totals[k] += n
    for total, mean in zip(totals, expected, strict=True):
        assert abs(total / 30 - mean) < 4 * math.sqrt(mean / 30), (total / 30, mean)
    # Arrival times inside a segment are uniform: the second half of the step gets half of it.
    second = sum(_counts(spec, seed, [60.0, 90.0, 120.0])[1] for seed in range(30))
    assert abs(second / 30 - 180) < 4 * math.sqrt(180 / 30), second / 30


def test_steps_compose_with_constant_and_gamma_arrivals() -> None:
    # constant(1) at 1, 2, ..., 9; x3 from 10 to 20 (30 arrivals, 1/3 s apart); a pause from 30 to
    # 40 (the one due at its start comes at its end); overlapping steps multiply (x2 x3 from 50).
    w = parse_workload(
        "constant(1) step(10, 10, 3) step(30, 10, 0) step(45, 10, 2) step(50, 10, 3) prompt=fixed(1) output=fixed(1)",
        0,
        duration_s=70.0,
    )
    times = [r.arrival_s for r in w.requests]
    assert times[:10] == pytest.approx([1, 2, 3, 4, 5, 6, 7, 8, 9, 10])
    assert times[9:40] == pytest.approx([10 + k / 3 for k in range(31)])
    assert not [t for t in times if t is not None and 30 <= t < 40]
    counts = _counts(
        "constant(1) step(10, 10, 3) step(30, 10, 0) step(45, 10, 2) step(50, 10, 3) prompt=fixed(1) output=fixed(1)",
        0,
        [0.0, 10.0, 20.0, 30.0, 40.0, 45.0, 50.0, 55.0, 60.0, 70.0],
    )
    assert counts == [9, 30, 10, 0, 5, 10, 30, 15, 10]
    # gamma: burstier than Poisson (counts vary ~2x as much), the same means.
    spec = "gamma(rate=2, burstiness=0.5) step(60, 60, 3) prompt=fixed(1) output=fixed(1)"
    totals = [0, 0, 0]
    for seed in range(30):
        for k, n in enumerate(_counts(spec, seed, [0.0, 60.0, 120.0, 180.0])):
            totals[k] += n
    for total, mean in zip(totals, [120, 360, 120], strict=True):
        assert abs(total / 30 - mean) < 4 * math.sqrt(2 * mean / 30), (total / 30, mean)


def test_a_step_is_deterministic_and_only_moves_arrivals() -> None:
    spec = "chat: poisson(2) step(60, 60, 3) prompt=lognormal(100, 0.5) output=uniform(8, 64)"
    a, b = parse_workload(spec, 7, duration_s=180.0), parse_workload(spec, 7, duration_s=180.0)
    assert a.requests == b.requests
    assert parse_workload(spec, 8, duration_s=180.0).requests != a.requests
    plain = parse_workload(spec.replace(" step(60, 60, 3)", ""), 7, duration_s=180.0)
    # The same draws: before the step the same times; the lengths of request i are unchanged.
    before = [r for r in a.requests if r.arrival_s is not None and r.arrival_s < 60]
    assert before == plain.requests[: len(before)]
    n = min(len(a.requests), len(plain.requests))
    lengths = [(r.prompt_tokens, r.output_tokens) for r in a.requests[:n]]
    assert lengths == [(r.prompt_tokens, r.output_tokens) for r in plain.requests[:n]]
    # Another class's draws are left alone; max_requests cuts the stepped stream as any other.
    docs = "docs: constant(0.2) prompt=fixed(900) output=fixed(9)"
    mixed = parse_workload(f"{spec}; {docs}", 7, duration_s=180.0)
    assert [r for r in mixed.requests if r.cls == "docs"] != []
    assert [r.arrival_s for r in mixed.requests if r.cls == "chat"] == [r.arrival_s for r in a.requests]
    assert parse_workload(spec, 7, max_requests=200).requests == a.requests[:200]


def test_steps_describe_scale_and_are_listed() -> None:
    spec = "chat: poisson(2) step(60, 60, 3) step(at_s=150, for_s=10, factor=0.5) prompt=fixed(8) output=fixed(8); docs: constant(0.2) prompt=fixed(9) output=fixed(9)"
    w = parse_workload(spec, 0, duration_s=180.0, rate_scale=2.0)
    line = w.describe().splitlines()[0]
    assert line.startswith(
        "chat: poisson(rate=4) step(at_s=60, for_s=60, factor=3) step(at_s=150, for_s=10, factor=0.5) prompt="
    )
    assert w.steps == [("chat", Step(60, 60, 3)), ("chat", Step(150, 10, 0.5))]
    assert parse_workload("chat", 0, 10).steps == []
    built = WorkloadClass("c", Stepped(Constant(1.0), (Step(5, 5, 2),)), SyntheticLengths(Fixed(1), Fixed(1)))
    assert len(build_workload([built], max_requests=None, duration_s=10.0).requests) == 14


def test_bad_steps_are_clear_errors(tmp_path: Path) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("arrived_at,num_prefill_tokens,num_decode_tokens\n0.5,10,5\n1.5,20,6\n")
    cases = [
        (
            "concurrency(2) step(1, 1, 2) prompt=fixed(1) output=fixed(1)",
            "step(...) multiplies an arrival rate, and 'concurrency(2)' is a closed loop with none",
        ),
        (f"trace({trace}) step(1, 1, 2)", "replays its own arrival times"),
        (
            "poisson(1) step(1, 0, 2) prompt=fixed(1) output=fixed(1)",
            "for_s must be a finite number > 0, got 0.0 (in 'step(1, 0, 2)')",
        ),
        (
            "poisson(1) step(1, 2, -1) prompt=fixed(1) output=fixed(1)",
            "factor must be a finite number >= 0, got -1.0",
        ),
        (
            "poisson(1) step(-1, 2, 1) prompt=fixed(1) output=fixed(1)",
            "at_s must be a finite number >= 0, got -1.0",
        ),
        (
            "poisson(1) step(1, 2) prompt=fixed(1) output=fixed(1)",
            "missing a required argument: 'factor' in 'step(1, 2)'; step takes at_s, for_s, factor",
        ),
        (
            "poisson(1) step(1, 2, fast) prompt=fixed(1) output=fixed(1)",
            "bad value 'fast' for factor in 'step(1, 2, fast)': expected a number",
        ),
        ("poisson(1) stpe(1, 2, 3) prompt=fixed(1) output=fixed(1)", "(did you mean 'step'?)"),
        ("step(1, 2, 3) prompt=fixed(1) output=fixed(1)", "no arrival process in"),
        (
            "poisson(1) step(60, 60, 3) prompt=fixed(1) output=fixed(1)",
            "class default: step(at_s=60, for_s=60, factor=3) starts after the run ends (30 s)",
        ),
    ]
    for spec, message in cases:
        with pytest.raises(WorkloadError) as error:
            parse_workload(spec, 0, 10, 30.0)
        assert message in str(error.value), (spec, str(error.value))


# -- conversations ----------------------------------------------------------------------------------
CONVERSATIONS = (
    "chat: poisson(1) prompt=fixed(200) output=uniform(10,20) turns=uniform(2,4) "
    "followup=uniform(5,30) think=fixed(1500)"
)


def test_a_conversation_class_draws_whole_conversations_with_later_turns_unscheduled() -> None:
    w = parse_workload(
        CONVERSATIONS + "; docs: poisson(0.2) prompt=fixed(50) output=fixed(4)", seed=3, duration_s=30
    )
    chats = [r for r in w.requests if r.cls == "chat"]
    starts = [r for r in chats if r.turn == 0]
    assert starts and all(r.arrival_s is not None and r.session == r.index for r in starts)
    for first in starts:
        turns = [r for r in chats if r.session == first.session]
        assert [r.turn for r in turns] == list(range(len(turns))) and 2 <= len(turns) <= 4
        assert turns[0].prompt_tokens == 200
        for later in turns[1:]:  # sent after the turn before, not at a planned time
            assert later.arrival_s is None and later.think_s == 1.5 and 5 <= later.prompt_tokens <= 30
            assert 10 <= later.output_tokens <= 20 and isinstance(later.output_tokens, int)
    # Each conversation's turns follow its first; the other class is as it would be alone.
    assert [r.index for r in w.requests] == list(range(len(w.requests)))
    alone = parse_workload("docs: poisson(0.2) prompt=fixed(50) output=fixed(4)", seed=3, duration_s=30)
    docs = [(r.arrival_s, r.prompt_tokens) for r in w.requests if r.cls == "docs"]
    assert docs == [(r.arrival_s, r.prompt_tokens) for r in alone.requests]
    assert w == parse_workload(w.spec, seed=3, duration_s=30)  # the same seed, the same conversations
    assert "turns=uniform(lo=2, hi=4)" in w.describe()


def test_max_requests_counts_turns() -> None:
    w = parse_workload(CONVERSATIONS, seed=0, max_requests=7)
    assert len(w.requests) == 7
    assert w.requests[0].turn == 0 and w.requests[-1].session is not None


@pytest.mark.parametrize(
    "spec,message",
    [
        ("poisson(1) prompt=fixed(9) output=fixed(9) turns=fixed(2)", "missing followup= and think="),
        (
            "concurrency(2) prompt=fixed(9) output=fixed(9) turns=fixed(2) followup=fixed(3) think=fixed(9)",
            "closed loop",
        ),
        (
            "poisson(1) prompt=fixed(9) output=fixed(9) turns=fixed(2) followup=fixed(3) think=fixed(9) turns=fixed(3)",
            "two turns=",
        ),
        (
            "poisson(1) prompt=fixed(9) output=fixed(9) chats=fixed(2)",
            "known: prompt, output, turns, followup, think",
        ),
    ],
)
def test_bad_conversation_specs_are_clear_errors(spec: str, message: str) -> None:
    with pytest.raises(WorkloadError, match=re.escape(message)):
        parse_workload(spec, max_requests=4)
