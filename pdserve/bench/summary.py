"""What a benchmark run measured: per-request records and their summary. No torch.

Definitions are those of `vllm bench serve`, so numbers can be compared:
- TTFT: request sent -> first streamed chunk with text.
- ITL: every gap between consecutive chunks of a stream (all streams' gaps pooled).
- TPOT: (E2E - TTFT) / (output tokens - 1), per request with at least two output tokens.
- E2E: request sent -> last chunk.
- goodput: completed requests per second that meet every SLO given. A request meets `ttft`,
  `tpot` and `e2e` SLOs by its own value; it meets an `itl` SLO when the 99th percentile of its
  own gaps is within it (with fewer than 100 gaps that is about its largest gap).
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pdserve.slo import parse_limits, quantile, request_meets

SLO_KEYS = ("ttft", "itl", "tpot", "e2e")


@dataclass
class RequestRecord:
    index: int
    cls: str
    scheduled_s: float | None  # planned send time after the start (None: closed loop)
    sent_s: float  # actual send time after the start
    prompt_tokens: int
    output_tokens: int = 0  # from the server's usage when it sent one, else chunks counted
    chunk_times_s: list[float] = field(default_factory=list)  # arrival of each chunk with text
    error: str | None = None
    session: int | None = None  # a conversation's turn: the index of its first turn
    turn: int = 0

    @property
    def ok(self) -> bool:
        """Completed without error (as vLLM counts it), whether or not any chunk carried text."""
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return self.chunk_times_s[0] - self.sent_s if self.chunk_times_s else None

    @property
    def e2e(self) -> float | None:
        return self.chunk_times_s[-1] - self.sent_s if self.chunk_times_s else None

    @property
    def itls(self) -> list[float]:
        times = self.chunk_times_s
        return [b - a for a, b in itertools.pairwise(times)]

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2 or self.e2e is None or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, line: str) -> RequestRecord:
        return cls(**json.loads(line))


def parse_slos(text: str | None) -> dict[str, float]:
    """`ttft=500,itl=100` (milliseconds) -> {"ttft": 0.5, "itl": 0.1} in seconds (slo.py's parser,
    with the bench's tpot and e2e besides)."""
    return parse_limits(text, SLO_KEYS)


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) by slo.quantile's one definition; NaN if there are none."""
    value = quantile(values, q / 100)
    return math.nan if value is None else value


def distribution(values: Sequence[float]) -> dict[str, float]:
    """mean, p50, p90, p99 and max in milliseconds. The max is there for ITL: a long prompt that
    stalls a few streams for seconds can leave p99 of all gaps untouched, but not the worst gap."""
    if not values:
        return {"mean": math.nan, "p50": math.nan, "p90": math.nan, "p99": math.nan, "max": math.nan}
    ms = [v * 1000 for v in values]
    return {
        "mean": sum(ms) / len(ms),
        "p50": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
        "max": max(ms),
    }


def meets(record: RequestRecord, slos: dict[str, float]) -> bool:
    """The record's verdict against the SLOs (slo.request_meets); nothing streamed meets nothing."""
    if not record.ok or not record.chunk_times_s:
        return False
    return request_meets(slos, ttft=record.ttft, itls=record.itls, tpot=record.tpot, e2e=record.e2e)


def summarize(
    records: Iterable[RequestRecord], duration_s: float, slos: dict[str, float] | None = None
) -> dict[str, Any]:
    """The summary of one run, overall and per class."""
    records = list(records)
    slos = slos or {}

    def one(group: list[RequestRecord]) -> dict[str, Any]:
        done = [r for r in group if r.ok]
        output = sum(r.output_tokens for r in done)
        prompt = sum(r.prompt_tokens for r in done)
        result: dict[str, Any] = {
            "requests": len(group),
            "completed": len(done),
            "errors": len(group) - len(done),
            "duration_s": duration_s,
            "request_throughput": len(done) / duration_s if duration_s > 0 else math.nan,
            "output_token_throughput": output / duration_s if duration_s > 0 else math.nan,
            "total_token_throughput": (output + prompt) / duration_s if duration_s > 0 else math.nan,
            "prompt_tokens": prompt,
            "output_tokens": output,
            "ttft_ms": distribution([r.ttft for r in done if r.ttft is not None]),
            "itl_ms": distribution([gap for r in done for gap in r.itls]),
            "tpot_ms": distribution([t for r in done if (t := r.tpot) is not None]),
            "e2e_ms": distribution([r.e2e for r in done if r.e2e is not None]),
        }
        if slos:
            good = sum(1 for r in done if meets(r, slos))
            result["slos_ms"] = {k: v * 1000 for k, v in slos.items()}
            result["good_requests"] = good
            result["goodput"] = good / duration_s if duration_s > 0 else math.nan
        errors = sorted({r.error for r in group if r.error})
        if errors:
            result["error_kinds"] = errors[:10]
        return result

    summary = {"overall": one(records)}
    classes = sorted({r.cls for r in records})
    if len(classes) > 1:
        summary["classes"] = {c: one([r for r in records if r.cls == c]) for c in classes}
    if any(r.session is not None for r in records):
        summary["turns"] = by_turn([r for r in records if r.session is not None])
    return summary


def by_turn(records: list[RequestRecord]) -> dict[str, dict[str, Any]]:
    """Conversations' turns: TTFT and prompt length by turn ("1", "2", "3", "4+"): later turns
    resend longer conversations, which a prefix cache does not have to compute again."""
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        groups.setdefault(str(r.turn + 1) if r.turn < 3 else "4+", []).append(r)
    result = {}
    for name in sorted(groups):
        done = [r for r in groups[name] if r.ok]
        result[name] = {
            "requests": len(groups[name]),
            "completed": len(done),
            "prompt_tokens_mean": sum(r.prompt_tokens for r in done) / len(done) if done else math.nan,
            "ttft_ms": distribution([r.ttft for r in done if r.ttft is not None]),
        }
    return result


def format_summary(summary: dict[str, Any]) -> str:
    """A plain-text table like `vllm bench serve` prints."""
    lines = []
    groups = [("overall", summary["overall"]), *list(summary.get("classes", {}).items())]
    for name, s in groups:
        lines.append(f"==== {name} ====")
        lines.append(
            f"requests: {s['completed']} completed, {s['errors']} errors, in {s['duration_s']:.1f} s"
        )
        lines.append(
            f"throughput: {s['request_throughput']:.2f} req/s, {s['output_token_throughput']:.1f} output tok/s, "
            f"{s['total_token_throughput']:.1f} total tok/s"
        )
        for key in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            d = s[key]
            lines.append(
                f"{key[:-3].upper():>5} ms: mean {d['mean']:8.1f}  p50 {d['p50']:8.1f}  p90 {d['p90']:8.1f}  p99 {d['p99']:8.1f}"
                f"  max {d.get('max', math.nan):8.1f}"
            )
        if "goodput" in s:
            slo = ", ".join(f"{k}<={v:g}ms" for k, v in s["slos_ms"].items())
            lines.append(f"goodput ({slo}): {s['goodput']:.2f} req/s ({s['good_requests']} requests)")
    if "turns" in summary:
        lines.append("==== conversations, by turn ====")
        for turn, t in summary["turns"].items():
            d = t["ttft_ms"]
            lines.append(
                f"turn {turn:>2}: {t['completed']:4d} done, prompt mean {t['prompt_tokens_mean']:7.0f} tokens, "
                f"TTFT ms p50 {d['p50']:8.1f}  p90 {d['p90']:8.1f}"
            )
    return "\n".join(lines)


def write_records(path: Path, records: Iterable[RequestRecord]) -> None:
    with path.open("w") as fh:
        for record in records:
            fh.write(record.to_json() + "\n")


def read_records(path: Path) -> list[RequestRecord]:
    return [RequestRecord.from_json(line) for line in path.read_text().splitlines() if line.strip()]


def redacted_command(argv: list[str]) -> str:
    """The command line as a report records it, without the value of any --...-key flag: reports
    are shared and committed, keys must not be."""
    shown: list[str] = []
    hide_next = False
    for arg in argv:
        if hide_next:
            shown.append("<redacted>")
            hide_next = False
        elif arg.startswith("--") and arg.split("=", 1)[0].endswith("-key"):
            if "=" in arg:
                shown.append(arg.split("=", 1)[0] + "=<redacted>")
            else:
                shown.append(arg)
                hide_next = True
        else:
            shown.append(arg)
    return " ".join(shown)
