"""Where a pdserve server says a run's TTFT went: the parts of its remotely prefilled requests'
first tokens (`pdserve_ttft_breakdown_seconds{part}`: prefill_queue, prefill_compute, kv_transfer,
first_decode), how many prompts took each path (`pdserve_path_choices{path}`: remote or a
local prefill on the decode worker), and the prefix caches' hit rate
(`pdserve_prefix_cache_{queries,hits}`), scraped from /metrics before and after the run, so a server
that served several runs gives each run its own. No torch. Another server (no such metrics, or no
/metrics) gives none. `pdserve sim` reads the same metrics from its router's registry, so the two
compare part by part and path by path."""

from __future__ import annotations

import logging
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger("pdserve.bench")

METRIC = "pdserve_ttft_breakdown_seconds"
PATHS = "pdserve_path_choices"
PREFIX_QUERIES = "pdserve_prefix_cache_queries"
PREFIX_HITS = "pdserve_prefix_cache_hits"
Totals = dict[str, tuple[float, float]]  # part -> (sum of seconds, count)


def totals(text: str) -> Totals:
    """Each part's running sum and count in a /metrics answer."""
    found: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        if family.name != METRIC:
            continue
        for sample in family.samples:
            part = sample.labels.get("part")
            if part is None:
                continue
            slot = found.setdefault(part, [0.0, 0.0])
            if sample.name == f"{METRIC}_sum":
                slot[0] = sample.value
            elif sample.name == f"{METRIC}_count":
                slot[1] = sample.value
    return {part: (s, c) for part, (s, c) in found.items()}


def parts(before: Totals, after: Totals) -> dict[str, dict[str, float]]:
    """Each part's mean (milliseconds) and count over what happened between two scrapes."""
    out = {}
    for part, (total, count) in after.items():
        base_total, base_count = before.get(part, (0.0, 0.0))
        n = count - base_count
        if n > 0:
            out[part] = {"mean_ms": round((total - base_total) / n * 1000, 3), "count": int(n)}
    return out


def path_totals(text: str) -> dict[str, float]:
    """Prompts per path so far (every reason together) in a /metrics answer."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name != PATHS:
            continue
        for sample in family.samples:
            if sample.name == f"{PATHS}_total" and "path" in sample.labels:
                found[sample.labels["path"]] = found.get(sample.labels["path"], 0.0) + sample.value
    return found


def paths(before: dict[str, float], after: dict[str, float]) -> dict[str, int]:
    """Prompts per path between two scrapes."""
    return {
        path: int(n - before.get(path, 0.0)) for path, n in after.items() if n - before.get(path, 0.0) > 0
    }


async def scrape(client: httpx.AsyncClient, headers: dict[str, str] | None = None) -> str | None:
    """The server's /metrics now; None when it has none to read (or refuses it)."""
    try:
        response = await client.get("/metrics", timeout=10.0, headers=headers)
    except httpx.HTTPError as exc:
        logger.info("GET /metrics failed (%s): no TTFT parts for this run", exc)
        return None
    return response.text if response.status_code == 200 else None


# vLLM's names for the same two counters: its hit rate is then read the same way.
_PREFIX_ALIASES = {"vllm:prefix_cache_queries": PREFIX_QUERIES, "vllm:prefix_cache_hits": PREFIX_HITS}


def prefix_totals(text: str) -> dict[str, float]:
    """Prefix-cache tokens looked up and found so far, every pool (or vLLM engine) together, in a
    /metrics answer."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        name = _PREFIX_ALIASES.get(family.name, family.name)
        if name in (PREFIX_QUERIES, PREFIX_HITS):
            for sample in family.samples:
                if sample.name == f"{family.name}_total":
                    found[name] = found.get(name, 0.0) + sample.value
    return found


def prefix_cache(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """{"queries", "hits" (tokens), "hit_rate"} between two scrapes; {} when none was looked up."""
    queries = after.get(PREFIX_QUERIES, 0.0) - before.get(PREFIX_QUERIES, 0.0)
    hits = after.get(PREFIX_HITS, 0.0) - before.get(PREFIX_HITS, 0.0)
    if queries <= 0:
        return {}
    return {"queries": int(queries), "hits": int(hits), "hit_rate": round(hits / queries, 4)}


def summary_section(before: str | None, after: str | None) -> dict[str, Any]:
    """{"ttft_parts": ..., "paths": ..., "prefix_cache": ...} of what happened between two
    scrapes, where they say."""
    if before is None or after is None:
        return {}
    try:
        section: dict[str, Any] = {}
        found = parts(totals(before), totals(after))
        if found:
            section["ttft_parts"] = found
        taken = paths(path_totals(before), path_totals(after))
        if taken:
            section["paths"] = taken
        cache = prefix_cache(prefix_totals(before), prefix_totals(after))
        if cache:
            section["prefix_cache"] = cache
        return section
    except ValueError:  # not the exposition format: another server
        return {}
