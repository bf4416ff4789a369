"""The KV cache on transparent huge pages: the setting read as the kernel prints it, a zeroed
writable cache in its own mapping that the kernel backs with 2 MiB pages where its setting lets a
mapping ask, an engine that says in its startup line what it got, and the same tokens with and
without (PDSERVE_KV_HUGE_PAGES=0)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from pdserve.config import EngineConfig, Role
from pdserve.engine.factory import build_engine
from pdserve.ops.cpu import huge_pages
from pdserve.sampling_params import SamplingParams


def test_the_setting_is_the_bracketed_word(tmp_path: Path) -> None:
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    assert huge_pages.thp_setting(setting) == "madvise"
    setting.write_text("always within_size advise [never] deny force\n")
    assert huge_pages.thp_setting(setting) == "never"
    assert not huge_pages.huge_pages_possible("never")
    assert huge_pages.huge_pages_possible("madvise") and huge_pages.huge_pages_possible("within_size")
    assert huge_pages.thp_setting(tmp_path / "missing") == "unavailable"


def test_a_cache_on_huge_pages_is_zeroed_writable_and_backed_where_the_kernel_allows() -> None:
    shape = (2, 2, 2048, 16, 4, 64)  # 64 MiB of bf16: room for many aligned 2 MiB pages
    cache, granted = huge_pages.zeros_on_huge_pages(shape, torch.bfloat16)
    assert cache.shape == shape and cache.dtype == torch.bfloat16 and cache.is_contiguous()
    assert not cache.any()
    cache[1, 0, 7].fill_(1.5)  # a block of one layer's keys
    assert float(cache.float().sum()) == 1.5 * 16 * 4 * 64
    setting = huge_pages.thp_setting()
    assert granted == huge_pages.huge_pages_possible(setting)
    huge = huge_pages.anon_huge_bytes(cache)
    if not granted or huge is None:
        pytest.skip(f"transparent_hugepage here is {setting!r}: nothing to observe")
    # Every page was mapped at allocation; all but the unaligned ends can be 2 MiB ones. The
    # kernel may still fall back to small pages when it finds no free 2 MiB run: then say so.
    if huge == 0:
        pytest.skip("the kernel found no free 2 MiB pages (fragmented memory)")
    assert huge >= 32 * 2**20


def run(prompts: list[list[int]], model: Path) -> tuple[list[list[int]], bool]:
    engine, _ = build_engine(
        EngineConfig(model=str(model), dtype="float32", role=Role.MIXED, num_kv_blocks=2048, block_size=16)
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    outputs: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished:
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    return [outputs[f"r{i}"] for i in range(len(prompts))], engine.runner.kv_huge_pages


def test_an_engine_says_what_pages_its_cache_got_and_decodes_the_same_either_way(
    tiny_llama: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompts = [[5 + i, 9, 31, 7 * i + 3] * (3 + i) for i in range(4)]
    with caplog.at_level(logging.INFO, logger="pdserve.engine.factory"):
        advised_tokens, advised = run(prompts, tiny_llama)
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready")]
    assert ready
    if advised:
        assert "on 2 MiB pages" in ready[-1] or "asked for 2 MiB pages" in ready[-1]
    else:
        assert f"transparent_hugepage is {huge_pages.thp_setting()}" in ready[-1]

    caplog.clear()
    monkeypatch.setenv("PDSERVE_KV_HUGE_PAGES", "0")
    with caplog.at_level(logging.INFO, logger="pdserve.engine.factory"):
        plain_tokens, plain = run(prompts, tiny_llama)
    assert not plain
    assert any("PDSERVE_KV_HUGE_PAGES=0" in r.getMessage() for r in caplog.records)
    assert plain_tokens == advised_tokens
    assert all(len(tokens) == 12 for tokens in plain_tokens)
