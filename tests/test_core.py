"""EngineCore: the prefill and decode roles hand a request over through its KV blocks, and the
result is token for token what one colocated engine produces."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pdserve import LLM
from pdserve.config import EngineConfig, Role
from pdserve.engine.core import EngineCore
from pdserve.engine.factory import build_engine, pick_dtype
from pdserve.engine.sched_types import Handover
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
    assert prefill.stats().num_held == len(PROMPTS)

    for i, p in enumerate(PROMPTS):
        decode.add_request(f"r{i}", p, GREEDY, output_token_ids=[first[f"r{i}"]])
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
    decode.add_request("r", PROMPTS[2], GREEDY, output_token_ids=[7])
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
    with pytest.raises(InvalidRequestError, match="max_step_seconds"):
        core.add_request("budget", [1], GREEDY, max_step_seconds=True)  # type: ignore[arg-type]
    assert not core.has_unfinished


def test_a_decode_engine_learns_its_own_step_times_and_counts_a_request_from_its_arrival(
    tiny_llama: Path,
) -> None:
    core = engine(tiny_llama, Role.DECODE)
    # Arrived 2 s ago, while a step ran: its queue time (and its stall budget) count from then.
    core.add_request("r", [1, 2, 3], GREEDY, max_step_seconds=0.25, arrived_at=time.monotonic() - 2.0)
    queued = [out.queue_seconds for out in core.step()]
    assert queued and queued[0] is not None and queued[0] >= 2.0
    run_to_end(core)
    model = core.scheduler.step_cost
    assert model is not None and model.num_samples == GREEDY.max_tokens  # one sample per step
    assert engine(tiny_llama, Role.MIXED).scheduler.step_cost is None  # decode role only


def test_auto_dtype_is_fp32_on_a_cpu_without_native_bf16() -> None:
    import torch

    from pdserve.engine.factory import cpu_has_native_bf16

    expected = torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    assert pick_dtype("auto", torch.device("cpu")) == expected


@pytest.mark.parametrize(
    "params",
    [
        GREEDY,
        # Seeded sampling with penalties over the output: the stream that moves draws the same
        # numbers (its generator state moves with it) and counts the same outputs.
        SamplingParams(
            max_tokens=24, temperature=0.9, top_p=0.95, seed=5, frequency_penalty=0.5, ignore_eos=True
        ),
    ],
    ids=["greedy", "seeded-penalties"],
)
@pytest.mark.parametrize("role", [Role.DECODE, Role.MIXED])
def test_a_stream_handed_over_mid_decode_goes_on_with_the_same_tokens(
    tiny_llama: Path, params: SamplingParams, role: Role
) -> None:
    alone = engine(tiny_llama, role)
    for i, p in enumerate(PROMPTS):
        alone.add_request(f"r{i}", p, params)
    expected = run_to_end(alone)

    source, target = engine(tiny_llama, role, block_size=8), engine(tiny_llama, role, block_size=8)
    for i, p in enumerate(PROMPTS):
        source.add_request(f"r{i}", p, params)
    got: dict[str, list[int]] = {}
    for _ in range(7):  # every prompt done and a few tokens decoded
        for out in source.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
    moved = {}
    for i in range(len(PROMPTS)):
        outcome, request, state = source.hand_over(f"r{i}")
        assert outcome is Handover.HELD and request is not None
        assert request.output_token_ids == got[f"r{i}"]
        assert (state is None) == params.greedy
        moved[f"r{i}"] = (request, state)
    assert source.stats().num_held == len(PROMPTS) and not source.has_unfinished
    assert source.step() == []  # held streams are not scheduled any more

    for rid, (request, state) in moved.items():
        target.add_request(
            rid, request.prompt_token_ids, params, output_token_ids=got[rid], sampler_state=state
        )
    target.admit_remote_kv()
    for rid, dst in target.take_kv_to_receive():
        src = source.kv.block_table(rid)[: source.kv.blocks_for_tokens(moved[rid][0].num_tokens - 1)]
        target.runner.write_blocks(dst, source.runner.read_blocks(src))
        assert target.kv_received(rid, ok=True) is None
        assert source.release(rid)
    for rid, tokens in run_to_end(target).items():
        got[rid] += tokens
    assert got == expected
    assert source.kv.num_used_blocks == 0 and target.kv.num_used_blocks == 0


def test_a_request_not_started_is_handed_back_without_kv_and_one_mid_prompt_waits(tiny_llama: Path) -> None:
    core = engine(tiny_llama, Role.MIXED, chunk_size=16, max_num_batched_tokens=16)
    core.add_request("long", PROMPTS[4], GREEDY)  # 50 tokens: four chunks
    core.add_request("queued", PROMPTS[1], GREEDY)
    core.step()
    assert core.hand_over("long")[0] is Handover.NOT_YET  # still in its prompt
    outcome, request, _ = core.hand_over("queued")
    assert outcome is Handover.NO_KV and request is not None and request.output_token_ids == []
    assert core.hand_over("queued")[0] is Handover.UNKNOWN
    while core.hand_over("long")[0] is Handover.NOT_YET:
        core.step()
    assert core.release("long") and core.kv.num_used_blocks == 0 and not core.has_unfinished


def test_taking_a_stream_checks_what_was_sampled_elsewhere(tiny_llama: Path) -> None:
    core = engine(tiny_llama, Role.DECODE)
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        core.add_request("r", PROMPTS[2], GREEDY, output_token_ids=[7, 10**6])
    with pytest.raises(InvalidRequestError, match="max_tokens is reached"):
        core.add_request("r", PROMPTS[2], GREEDY, output_token_ids=[7] * GREEDY.max_tokens)
    assert not core.has_unfinished


def test_a_seeded_stream_moved_twice_before_it_samples_again_keeps_its_generator(tiny_llama: Path) -> None:
    params = SamplingParams(max_tokens=20, temperature=0.9, seed=3, ignore_eos=True)
    alone = engine(tiny_llama, Role.DECODE)
    alone.add_request("r", PROMPTS[3], params)
    expected = run_to_end(alone)["r"]

    a, b, c = (engine(tiny_llama, Role.DECODE, block_size=8) for _ in range(3))
    a.add_request("r", PROMPTS[3], params)
    got: list[int] = []
    for _ in range(5):
        got += [t for out in a.step() for t in out.new_token_ids]

    def move(source: EngineCore, target: EngineCore) -> None:
        _, request, state = source.hand_over("r")
        assert request is not None and state is not None
        target.add_request("r", request.prompt_token_ids, params, output_token_ids=got, sampler_state=state)
        target.admit_remote_kv()
        [(rid, dst)] = target.take_kv_to_receive()
        src = source.kv.block_table(rid)[: source.kv.blocks_for_tokens(request.num_tokens - 1)]
        target.runner.write_blocks(dst, source.runner.read_blocks(src))
        target.kv_received(rid, ok=True)
        source.release(rid)

    move(a, b)
    move(b, c)  # before b sampled anything: the state it came with goes on
    got += run_to_end(c)["r"]
    assert got == expected


@pytest.mark.parametrize("role", [Role.DECODE, Role.MIXED, Role.PREFILL])
def test_a_stream_resumed_without_its_kv_recomputes_it_and_goes_on_with_the_same_tokens(
    tiny_llama: Path, role: Role
) -> None:
    """A stream whose worker died: another one is given its tokens so far with no KV, computes
    prompt and outputs again (as after a preemption) and samples what the first would have."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, frequency_penalty=0.5)
    first = engine(tiny_llama, Role.MIXED)
    first.add_request("r", PROMPTS[3], params)
    expected = run_to_end(first)["r"]
    resumed = engine(tiny_llama, role)
    resumed.add_request("r", PROMPTS[3], params, output_token_ids=expected[:5], kv_elsewhere=False)
    assert resumed.stats().queued_prompt_tokens == len(PROMPTS[3]) + 5
    got = run_to_end(resumed)["r"]
    if role is Role.PREFILL:  # one token, then its blocks are held for a decode worker
        assert got == expected[5:6]
        assert resumed.stats().num_held == 1
    else:
        assert got == expected[5:]
        assert resumed.stats().kv_blocks_used == 0


def test_a_short_prompt_runs_between_two_layers_of_a_long_prefill_step(tiny_llama: Path) -> None:
    # A prefill engine on CPU lets a short prompt that arrives during a long prompt's step run
    # between two of its layers when it is shorter than what the long prompt has left (shortest
    # remaining first); each gets the token it would get alone.
    long_prompt, short_prompt, other_short = list(range(10, 90)), list(range(200, 212)), list(range(100, 160))
    alone = engine(tiny_llama, Role.PREFILL, chunk_size=64)
    for rid, prompt in (("long", long_prompt), ("short", short_prompt), ("other", other_short)):
        alone.add_request(rid, prompt, GREEDY)
    expected = run_to_end(alone)

    core = engine(tiny_llama, Role.PREFILL, chunk_size=64)
    assert core.interrupts_steps
    layers = core.limits.num_layers
    core.add_request("long", long_prompt, GREEDY)
    nested: list[list[tuple[str, list[int], bool]]] = []

    def between_layers() -> None:
        if not nested:  # both arrive while the first layer of the 64-token chunk runs
            core.add_request("short", short_prompt, GREEDY)
            core.add_request("other", other_short, GREEDY)
        outputs = core.step_between_layers()
        nested.append([(out.request_id, out.new_token_ids, out.finished) for out in outputs])

    assert core.step(between_layers) == []  # the long prompt's first chunk: 16 tokens left
    assert len(nested) == layers - 1
    # After one layer the long prompt has 16 + 64 x (1 - 1/layers) tokens left: more than the
    # short prompt's 12, so it runs at once; fewer than 12 + 60, so the other one waits.
    assert nested[0] == [("short", expected["short"], True)] and all(ids == [] for ids in nested[1:])
    assert core.steps_between_layers == 1
    step = core.last_step
    assert step is not None and step.num_prefill_tokens == 64
    assert run_to_end(core) == {"other": expected["other"], "long": expected["long"]}
    assert core.stats().num_held == 3

    # When the prompts of the running step have less left than a waiting prompt, it waits.
    late = engine(tiny_llama, Role.PREFILL, chunk_size=64)
    late.add_request("long", long_prompt, GREEDY)
    late.step()  # 64 of 80 tokens: its last step has 16, and 12 > 16 x (1 - 1/layers) for 3 layers
    ran: list[str] = []

    def arrives() -> None:
        if "short" not in [r.request_id for r in late.scheduler.waiting]:
            late.add_request("short", short_prompt, GREEDY)
        ran.extend(out.request_id for out in late.step_between_layers())

    assert [o.request_id for o in late.step(arrives)] == ["long"]
    assert ran == ([] if 16 * (layers - 1) / layers <= 12 else ["short"])
    with pytest.raises(RuntimeError):
        late.step_between_layers()  # only from inside a step


def test_the_triton_attention_is_refused_where_it_cannot_run(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="attention_backend must be one of"):
        EngineConfig(model="m", attention_backend="flash")
    with pytest.raises(ValueError, match="runs on CUDA GPUs only"):
        LLM(str(tiny_llama), dtype="float32", device="cpu", attention_backend="triton", num_kv_blocks=8)
