"""deploy/grafana/pdserve.json: Grafana imports it as is, and every query asks for series the router
really exports (a wrong name or label is a panel that silently says "No data")."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.metrics import MetricWrapperBase

from pdserve.router.metrics import RouterMetrics

DASHBOARD = Path(__file__).resolve().parents[1] / "deploy" / "grafana" / "pdserve.json"
DATASOURCE_REF = {"type": "prometheus", "uid": "${datasource}"}
PANEL_TYPES = {"timeseries", "stat", "gauge", "bargauge", "table", "heatmap"}  # core, query-backed


@dataclass(frozen=True)
class Series:
    """One series name the router exports: `family` is the prometheus_client family it belongs to."""

    family: str
    kind: str  # gauge, counter (NAME_total, NAME_created), bucket, histogram_sum, histogram_count, ...
    labels: frozenset[str]


def exported_series() -> dict[str, Series]:
    metrics = RouterMetrics()
    labels: dict[str, tuple[str, ...]] = {
        m._name: tuple(m._labelnames) for m in vars(metrics).values() if isinstance(m, MetricWrapperBase)
    }
    out: dict[str, Series] = {}
    for family in metrics.registry.collect():
        assert family.name in labels, f"{family.name}: not an attribute of RouterMetrics, labels unknown"
        own = frozenset(labels[family.name])
        if family.type == "histogram":
            names = {"_bucket": "bucket", "_sum": "histogram_sum", "_count": "histogram_count"}
        elif family.type == "counter":
            names = {"_total": "counter"}
        elif family.type == "gauge":
            names = {"": "gauge"}
        else:
            pytest.fail(f"{family.name}: metric type {family.type} not handled by this test")
        for suffix, kind in names.items():
            out[family.name + suffix] = Series(family.name, kind, own | {"le"} if kind == "bucket" else own)
        if family.type in ("histogram", "counter"):
            out[family.name + "_created"] = Series(family.name, "gauge", own)
    return out


EXPORTED = exported_series()

# -- a small PromQL reader: enough to find metric names, label matchers and grouping clauses --------

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^()]*)\)")
_IDENT = re.compile(r"(?<![\w:.$])[A-Za-z_:][\w:]*")
_MATCHER_LABEL = re.compile(r"([A-Za-z_]\w*)\s*(?:=~|!~|!=|=)")
_LEGEND_LABEL = re.compile(r"\{\{\s*([^}\s]+)\s*\}\}")
_AGGREGATIONS = {
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk",
    "quantile", "limitk", "limit_ratio",
}  # fmt: skip
_KEYWORDS = _AGGREGATIONS | {
    "by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
    "offset", "atan2", "inf", "nan",
}  # fmt: skip
_RATES = re.compile(r"\b(rate|irate|increase)\s*\(")


def _blank(text: str, pattern: re.Pattern[str], keep_ends: bool = True) -> str:
    """`text` with what `pattern` matches replaced by spaces (the delimiters kept), positions unchanged."""

    def spaces(m: re.Match[str]) -> str:
        s = m.group(0)
        return s[0] + " " * (len(s) - 2) + s[-1] if keep_ends and len(s) >= 2 else " " * len(s)

    return pattern.sub(spaces, text)


def _close(expr: str, open_at: int) -> int:
    """The index of the parenthesis closing the one at `open_at`."""
    depth = 0
    for i in range(open_at, len(expr)):
        depth += {"(": 1, ")": -1}.get(expr[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced parentheses in {expr!r}")


def _open(expr: str, close_at: int) -> int:
    """The index of the parenthesis opened by the one closing at `close_at`."""
    depth = 0
    for i in range(close_at, -1, -1):
        depth += {")": 1, "(": -1}.get(expr[i], 0)
        if depth == 0:
            return i
    raise ValueError(f"unbalanced parentheses in {expr!r}")


def _check_balanced(code: str) -> None:
    depth = 0
    for c in code:
        depth += {"(": 1, ")": -1}.get(c, 0)
        if depth < 0:
            break
    if depth != 0:
        raise ValueError(f"unbalanced parentheses in {code!r}")


@dataclass(frozen=True)
class Selector:
    name: str
    start: int
    end: int  # past the name and its {...} matchers, if any
    matcher_labels: tuple[str, ...]


def selectors(expr: str) -> list[Selector]:
    """Every metric selector of `expr`: an identifier that is no function, keyword or label."""
    code = _blank(_blank(expr, _STRING), _RANGE)  # label values and [durations] are no identifiers
    scan = _blank(_blank(code, re.compile(r"\{[^}]*\}")), _GROUPING, keep_ends=False)
    found: list[Selector] = []
    for m in _IDENT.finditer(scan):
        rest = scan[m.end() :].lstrip()
        if m.group(0).lower() in _KEYWORDS or rest.startswith("("):  # an operator or a function call
            continue
        end, labels = m.end(), ()
        brace = re.match(r"\s*\{([^}]*)\}", code[end:])
        if brace:
            end += brace.end()
            labels = tuple(_MATCHER_LABEL.findall(brace.group(1)))
        found.append(Selector(m.group(0), m.start(), end, labels))
    return found


def _calls(code: str, pattern: re.Pattern[str]) -> Iterator[tuple[int, int, str]]:
    """(start, end, argument text) of every call whose name `pattern` matches up to its '('."""
    for m in pattern.finditer(code):
        close = _close(code, m.end() - 1)
        yield m.start(), close, code[m.end() : close]


def _groupings(code: str) -> Iterator[tuple[str, list[str], int, int]]:
    """(keyword, labels, scope start, scope end) of every grouping clause; the scope of by/without is the
    aggregation's argument, that of on/ignoring/group_* the whole expression."""
    for m in _GROUPING.finditer(code):
        keyword, labels = m.group(1), [s.strip() for s in m.group(2).split(",") if s.strip()]
        if keyword not in ("by", "without"):
            yield keyword, labels, 0, len(code)
            continue
        rest = code[m.end() :]
        after = m.end() + len(rest) - len(rest.lstrip())
        if after < len(code) and code[after] == "(":  # sum by (x) (expr)
            yield keyword, labels, after, _close(code, after)
            continue
        before = len(code[: m.start()].rstrip()) - 1  # sum (expr) by (x)
        if before < 0 or code[before] != ")":
            raise ValueError(f"cannot find what {m.group(0)!r} aggregates in {code!r}")
        yield keyword, labels, _open(code, before), before


def output_labels(expr: str) -> set[str]:
    """Roughly the labels the result of `expr` keeps (what a legend's {{label}} can show)."""
    code = _blank(_blank(expr, _STRING), _RANGE)
    sels = selectors(expr)
    aggregated = any(re.search(rf"\b{a}\s*(\(|by\b|without\b)", code) for a in _AGGREGATIONS)
    keep: set[str] = set()
    for keyword, labels, start, end in _groupings(code):
        if keyword == "by":
            keep |= set(labels)
        elif keyword == "without":
            for s in sels:
                if start <= s.start < end and s.name in EXPORTED:
                    keep |= EXPORTED[s.name].labels - set(labels)
    if not aggregated:
        keep = {label for s in sels if s.name in EXPORTED for label in EXPORTED[s.name].labels}
    return keep - {"le"}


def expr_problems(expr: str) -> list[str]:
    """What would make `expr` show nothing or nonsense against the router's /metrics."""
    problems: list[str] = []
    code = _blank(_blank(expr, _STRING), _RANGE)
    try:
        _check_balanced(code)
        groupings = list(_groupings(code))
        rate_spans = [(s, e) for s, e, _ in _calls(code, _RATES)]
        quantiles = list(_calls(code, re.compile(r"\bhistogram_quantile\s*\(")))
    except ValueError as e:
        return [str(e)]
    sels = selectors(expr)
    if not sels:
        problems.append("no metric in it")
    for s in sels:
        series = EXPORTED.get(s.name)
        if series is None:
            problems.append(f"{s.name}: the router exports no such series")
            continue
        problems += [
            f"{s.name} has no label {label!r}" for label in s.matcher_labels if label not in series.labels
        ]
        in_rate = any(a <= s.start < b for a, b in rate_spans)
        if in_rate and series.kind == "gauge":
            problems.append(f"{s.name} is a gauge: rate() or increase() of it means nothing")
        if not in_rate and series.kind in ("counter", "bucket"):
            problems.append(f"{s.name} only ever grows: wrap it in rate() or increase()")
    for keyword, labels, start, end in groupings:
        inside = [s for s in sels if start <= s.start < end and s.name in EXPORTED]
        for label in labels:
            lacking = [s.name for s in inside if label not in EXPORTED[s.name].labels]
            if keyword in ("by", "without") and lacking:
                problems.append(f"{keyword} ({label}): not a label of {', '.join(lacking)}")
            if keyword not in ("by", "without") and not any(label in EXPORTED[s.name].labels for s in inside):
                problems.append(f"{keyword} ({label}): not a label of any metric of the expression")
    for start, end, args in quantiles:
        phi = args.split(",", 1)[0].strip()
        try:
            if not 0 <= float(phi) <= 1:
                problems.append(f"histogram_quantile({phi}, ...): the quantile must lie in [0, 1]")
        except ValueError:
            problems.append(f"histogram_quantile({phi}, ...): not a number")
        for s in sels:
            if start <= s.start < end and s.name in EXPORTED and EXPORTED[s.name].kind != "bucket":
                problems.append(f"histogram_quantile over {s.name}, not a _bucket series")
        for keyword, labels, g_start, _ in groupings:
            if keyword not in ("by", "without") or not start <= g_start < end:
                continue
            if (keyword == "by") != ("le" in labels):
                problems.append(f"histogram_quantile needs `le` kept ({keyword} ({', '.join(labels)}))")
    return problems


# -- the dashboard -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    with DASHBOARD.open(encoding="utf-8") as f:
        loaded = json.load(f)
    assert isinstance(loaded, dict)
    return loaded


def all_panels(dashboard: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Every panel, rows and the panels inside collapsed rows included."""
    for panel in dashboard["panels"]:
        yield panel
        yield from panel.get("panels", [])


def query_panels(dashboard: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in all_panels(dashboard) if p.get("type") != "row"]


def targets(dashboard: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(p.get("title", ""), t) for p in query_panels(dashboard) for t in p.get("targets", [])]


def test_the_dashboard_has_what_grafana_needs_to_import_it(dashboard: dict[str, Any]) -> None:
    for key, kind in (("title", str), ("uid", str), ("schemaVersion", int), ("panels", list)):
        assert isinstance(dashboard.get(key), kind), key
    assert dashboard["title"].strip()
    assert re.fullmatch(r"[A-Za-z0-9_-]{1,40}", dashboard["uid"]), "Grafana uids: at most 40 of [A-Za-z0-9_-]"
    assert dashboard["schemaVersion"] >= 36  # datasource references as {type, uid} objects
    assert dashboard.get("id") is None  # an id of another Grafana would clash on import
    assert {"from", "to"} <= set(dashboard["time"])
    assert isinstance(dashboard.get("refresh"), str)

    panels = list(all_panels(dashboard))
    ids: list[Any] = [p.get("id") for p in panels]
    assert all(isinstance(i, int) for i in ids), ids
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted({i for i in ids if ids.count(i) > 1})}"
    assert query_panels(dashboard)

    for panel in panels:
        title = panel.get("title")
        assert isinstance(title, str) and title.strip(), panel.get("id")
        grid = panel.get("gridPos")
        assert isinstance(grid, dict) and all(isinstance(grid.get(k), int) for k in "hwxy"), title
        assert grid["w"] > 0 and grid["h"] > 0 and grid["x"] >= 0 and grid["y"] >= 0, title
        assert grid["x"] + grid["w"] <= 24, f"{title}: wider than Grafana's 24 columns"

    for panel in query_panels(dashboard):
        title = panel["title"]
        assert panel.get("type") in PANEL_TYPES, f"{title}: type {panel.get('type')!r}"
        queries = panel.get("targets")
        assert isinstance(queries, list) and queries, f"{title}: no queries"
        ref_ids = [t.get("refId") for t in queries]
        assert all(isinstance(r, str) and r for r in ref_ids), title
        assert len(ref_ids) == len(set(ref_ids)), f"{title}: duplicate refIds {ref_ids}"
        for t in queries:
            assert isinstance(t.get("expr"), str) and t["expr"].strip(), f"{title}: empty expr"
            assert isinstance(t.get("legendFormat"), str), f"{title} {t['refId']}: no legendFormat"


def test_panels_do_not_overlap(dashboard: dict[str, Any]) -> None:
    cells: dict[tuple[int, int], str] = {}
    for panel in dashboard["panels"]:  # the top level: a collapsed row's panels are laid out on expanding
        g = panel["gridPos"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]


def test_every_panel_queries_the_datasource_variable(dashboard: dict[str, Any]) -> None:
    variables = dashboard["templating"]["list"]
    chosen = [v for v in variables if v.get("name") == "datasource"]
    assert len(chosen) == 1, "no `datasource` variable in templating"
    assert chosen[0].get("type") == "datasource" and chosen[0].get("query") == "prometheus"
    for panel in query_panels(dashboard):
        assert panel.get("datasource") == DATASOURCE_REF, f"{panel['title']}: {panel.get('datasource')}"
        for t in panel["targets"]:
            assert t.get("datasource", DATASOURCE_REF) == DATASOURCE_REF, f"{panel['title']} {t['refId']}"


def test_every_query_asks_for_series_and_labels_the_router_exports(dashboard: dict[str, Any]) -> None:
    problems = [
        f"{title} / {t['refId']}: {problem}  [{t['expr']}]"
        for title, t in targets(dashboard)
        for problem in expr_problems(t["expr"])
    ]
    assert not problems, "\n".join(problems)


def test_legends_name_labels_the_query_keeps(dashboard: dict[str, Any]) -> None:
    problems = []
    for title, t in targets(dashboard):
        missing = set(_LEGEND_LABEL.findall(t["legendFormat"])) - output_labels(t["expr"])
        if missing:
            problems.append(f"{title} / {t['refId']}: legend {t['legendFormat']!r} shows {sorted(missing)}")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("expr", "complaint"),
    [
        ("sum(rate(pdserve_requests[5m]))", "no such series"),  # the Counter's name, not its series
        ("sum(rate(pdserve_time_to_first_token_seconds[5m]))", "no such series"),
        ("up", "no such series"),
        ("sum by (worker) (rate(pdserve_requests_total[5m]))", "by (worker)"),
        ("sum(rate(pdserve_requests_total[5m])) by (pool)", "by (pool)"),
        ('pdserve_pool_workers{status="up"}', "no label 'status'"),
        (
            "histogram_quantile(0.9, sum by (pool) (rate(pdserve_time_to_first_token_seconds_bucket[5m])))",
            "`le`",
        ),
        (
            "histogram_quantile(90, sum by (le) (rate(pdserve_e2e_request_latency_seconds_bucket[5m])))",
            "[0, 1]",
        ),
        (
            "histogram_quantile(0.9, sum by (le) (rate(pdserve_e2e_request_latency_seconds_sum[5m])))",
            "_bucket",
        ),
        ("sum(pdserve_requests_total)", "only ever grows"),
        ("rate(pdserve_requests_in_flight[5m])", "gauge"),
        ("sum by (pool) (pdserve_pool_workers", "unbalanced"),
    ],
)
def test_the_checker_catches_queries_that_would_show_nothing(expr: str, complaint: str) -> None:
    problems = expr_problems(expr)
    assert any(complaint in p for p in problems), problems


@pytest.mark.parametrize(
    ("histogram", "slo"),
    [("pdserve_time_to_first_token_seconds", "ttft"), ("pdserve_inter_token_latency_seconds", "itl")],
)
def test_latency_per_pool_is_drawn_against_its_slo(
    dashboard: dict[str, Any], histogram: str, slo: str
) -> None:
    def per_pool_quantile(expr: str) -> float | None:
        code = _blank(expr, _STRING)
        if not any(s.name == histogram + "_bucket" for s in selectors(expr)):
            return None
        if not any(k == "by" and "pool" in labels for k, labels, _, _ in _groupings(_blank(code, _RANGE))):
            return None
        m = re.match(r"\s*histogram_quantile\s*\(\s*([0-9.]+)\s*,", code)
        return float(m.group(1)) if m else None

    def is_slo_line(expr: str) -> bool:
        return bool(re.search(rf'pdserve_slo_seconds\s*\{{[^}}]*metric\s*=\s*"{slo}"', expr))

    panels = [
        p
        for p in query_panels(dashboard)
        if any(per_pool_quantile(t["expr"]) is not None for t in p["targets"] if not t.get("hide"))
    ]
    assert panels, f"no panel shows {histogram} percentiles per pool"
    with_slo = [p for p in panels if any(is_slo_line(t["expr"]) and not t.get("hide") for t in p["targets"])]
    assert with_slo, f"{[p['title'] for p in panels]}: none draws pdserve_slo_seconds{{metric={slo!r}}}"
    for panel in with_slo:
        shown = {per_pool_quantile(t["expr"]) for t in panel["targets"] if not t.get("hide")}
        assert {0.5, 0.9, 0.99} <= shown, f"{panel['title']}: percentiles {shown}"
        for t in panel["targets"]:
            if per_pool_quantile(t["expr"]) is not None:
                assert "{{pool}}" in t["legendFormat"].replace(" ", ""), f"{panel['title']}: pools unnamed"
        assert panel["fieldConfig"]["defaults"].get("unit") == "s", f"{panel['title']}: not in seconds"


@pytest.mark.parametrize(
    "series",
    [
        "pdserve_ttft_breakdown_seconds_bucket",
        "pdserve_pool_workers",
        "pdserve_pool_target_replicas",
        "pdserve_planner_target_replicas",
        "pdserve_planner_decisions_total",
        "pdserve_planner_predicted_seconds",
        "pdserve_planner_observed_seconds",
        "pdserve_path_choices_total",
        "pdserve_ttft_prediction_ratio_bucket",
        "pdserve_worker_kv_blocks_used",
        "pdserve_worker_kv_blocks_free",
        "pdserve_kv_transfer_seconds_bucket",
        "pdserve_requests_total",
        "pdserve_requests_in_flight",
        "pdserve_request_retries_total",
        "pdserve_slo_rejections_total",
        "pdserve_request_migrations_total",
    ],
)
def test_the_dashboard_shows(dashboard: dict[str, Any], series: str) -> None:
    assert any(
        s.name == series for _, t in targets(dashboard) if not t.get("hide") for s in selectors(t["expr"])
    ), f"no visible query shows {series}"
