"""The router <-> worker protocol: typed, versioned, and strict about what it accepts."""

import msgspec
import pytest

from pdserve import wire
from pdserve.errors import InvalidRequestError
from pdserve.sampling_params import SamplingParams


def test_every_message_round_trips() -> None:
    params = wire.WireSamplingParams.from_params(
        SamplingParams(max_tokens=7, temperature=0.5, top_p=0.9, seed=3, stop_token_ids=[2], logprobs=1)
    )
    handle = wire.KVHandle("p0", "shm", "pdserve-kv-1", [3, 4], 30, 30.0, "r2")
    messages: list[wire.Message] = [
        wire.AddRequest("r1", [1, 2, 3], params),
        wire.AddRequest("r2", [1, 2], params, output_token_ids=[9], kv=handle),
        wire.AddRequest("r3.2", [1, 2], params, output_token_ids=[9, 8, 7], kv=handle, sampler_state=b"\x01"),
        wire.Migrate(["r1", "r3"]),
        wire.Migrated("r3", [9, 8, 7], handle, b"\x01\x02"),
        wire.Migrated("r4", []),
        wire.Abort("r1"),
        wire.Release("r2"),
        wire.Shutdown(),
        wire.Ready(
            "p0", "prefill", "smollm2-135m", 8192, 49152, "shm", "pdserve-kv-1", "tcp://127.0.0.1:5555"
        ),
        wire.Tokens("r1", [5], "prefilled", kv=handle, logprobs=[(5, -0.1, {5: -0.1})]),
        wire.Tokens("r1", [], "error", error="KV transfer timed out"),
        wire.Load("p0", 1, 2, 300, 10, 90, 1, 12.5),
        wire.Load("d0", 4, 0, 0, 40, 60, 0, 30.0, [wire.StepSample(0.03, 0, 0, 4, 1200)], 100, 16),
        wire.Ready("d0", "decode", "m", 2048, 320, "tcp", "h:1", "tcp://h:2", 512, 2048, 64),
    ]
    for message in messages:
        assert wire.decode(wire.encode(message)) == message


def test_sampling_params_survive_the_trip_and_are_validated_again() -> None:
    original = SamplingParams(
        max_tokens=5, temperature=0.7, top_k=20, min_p=0.1, repetition_penalty=1.2, seed=11
    )
    back = wire.WireSamplingParams.from_params(original).to_params()
    for field in ("max_tokens", "temperature", "top_k", "min_p", "repetition_penalty", "seed"):
        assert getattr(back, field) == getattr(original, field)
    forged = wire.WireSamplingParams(max_tokens=0)  # a peer can send anything
    with pytest.raises(InvalidRequestError, match="max_tokens"):
        forged.to_params()


def test_garbage_wrong_types_and_other_versions_are_rejected() -> None:
    with pytest.raises(wire.WireError):
        wire.decode(b"\x00garbage")
    bad_types = msgspec.msgpack.encode([wire.PROTOCOL_VERSION, {"type": "abort", "request_id": 5}])
    with pytest.raises(wire.WireError):
        wire.decode(bad_types)
    unknown = msgspec.msgpack.encode([wire.PROTOCOL_VERSION, {"type": "format_disk"}])
    with pytest.raises(wire.WireError):
        wire.decode(unknown)
    newer = msgspec.msgpack.encode([wire.PROTOCOL_VERSION + 1, {"type": "abort", "request_id": "r"}])
    with pytest.raises(wire.WireError, match="protocol"):
        wire.decode(newer)


def test_wire_never_imports_torch() -> None:
    import subprocess
    import sys

    code = "import sys, pdserve.wire; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
