"""EngineCore: the prefill and decode roles hand a request over through its KV blocks, and the
result is token for token what one colocated engine produces."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.config import EngineConfig, Role
from pdserve.engine.core import EngineCore, pick_dtype
from pdserve.engine.factory import build_engine
from pdserve.errors import InvalidRequestError
from pdserve.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [list(range(10, 10 + n)) for n in (1, 5, 16, 23, 50)]


def engine(path: Path, role: Role, **kw: int) -> EngineCore:
    core, _ = build_engine(EngineConfig(model=str(path), dtype="float32", role=role, **kw))  # type: ignore[arg-type]
    return core


def run_to_end(core: EngineCore) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(1000):
        if not core.has_unfinished:
            return tokens
        for out in core.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    raise AssertionError("engine did not finish")


def test_prefill_then_decode_through_kv_blocks_matches_colocated(tiny_llama: Path) -> None:
    mixed = engine(tiny_llama, Role.MIXED)
    for i, p in enumerate(PROMPTS):
        mixed.add_request(f"r{i}", p, GREEDY)
    expected = run_to_end(mixed)

    # Both sides use the same block size: a block then holds the same token range on each.
    prefill = engine(tiny_llama, Role.PREFILL, block_size=8, chunk_size=16)
    decode = engine(tiny_llama, Role.DECODE, block_size=8)
    for i, p in enumerate(PROMPTS):
        prefill.add_request(f"r{i}", p, GREEDY)
    first: dict[str, int] = {}
    while prefill.has_unfinished:
        for out in prefill.step():
            assert out.finished and out.finish_reason == "prefilled"
            first[out.request_id] = out.new_token_ids[0]
    assert prefill.stats().num_prefilled_held == len(PROMPTS)

    for i, p in enumerate(PROMPTS):
        decode.add_request(f"r{i}", p, GREEDY, first_token_id=first[f"r{i}"])
    decode.step()  # allocates blocks for the incoming KV; nothing to compute yet
    for request_id, dest_blocks in decode.take_kv_to_receive():
        src_blocks = prefill.kv.block_table(request_id)
        decode.runner.write_blocks(dest_blocks, prefill.runner.read_blocks(src_blocks))
        assert decode.kv_received(request_id, ok=True) is None
        assert prefill.release(request_id)
    got = run_to_end(decode)
    for request_id, tokens in expected.items():
        assert [first[request_id], *got[request_id]] == tokens
    assert prefill.kv.num_used_blocks == 0 and decode.kv.num_used_blocks == 0


def test_failed_kv_transfer_ends_request_with_error_and_frees_blocks(tiny_llama: Path) -> None:
    decode = engine(tiny_llama, Role.DECODE)
    decode.add_request("r", PROMPTS[2], GREEDY, first_token_id=7)
    decode.step()
    [(request_id, _)] = decode.take_kv_to_receive()
    failed = decode.kv_received(request_id, ok=False)
    assert failed is not None and failed.finished and failed.finish_reason == "error"
    assert not decode.has_unfinished and decode.kv.num_used_blocks == 0


def test_abort_mid_generation_frees_blocks(tiny_llama: Path) -> None:
    core = engine(tiny_llama, Role.MIXED)
    core.add_request("a", PROMPTS[4], GREEDY)
    core.step()
    assert core.kv.num_used_blocks > 0
    assert core.abort("a") and not core.abort("a")
    assert core.kv.num_used_blocks == 0


def test_validation_happens_before_queueing(tiny_llama: Path) -> None:
    core = engine(tiny_llama, Role.MIXED, num_kv_blocks=4, block_size=4)
    assert core.max_model_len == 16  # capped by the cache: a request can never outgrow it
    with pytest.raises(InvalidRequestError, match="context"):
        core.add_request("long", list(range(16)), GREEDY)
    with pytest.raises(InvalidRequestError, match="SamplingParams"):
        core.add_request("bad", [1], {"max_tokens": 3})  # type: ignore[arg-type]
    assert not core.has_unfinished


def test_auto_dtype_is_fp32_on_a_cpu_without_native_bf16() -> None:
    import torch

    from pdserve.engine.core import cpu_has_native_bf16

    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert pick_dtype("auto", torch.device("cpu")) == expected
