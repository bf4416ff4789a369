"""Messages between the router and the workers: typed, versioned msgpack (msgspec). No torch.

Every frame is one `Frame` (a protocol version and one message). Nothing is ever pickled: a frame
from a peer is decoded into these types or rejected with `WireError`.
"""

from __future__ import annotations

import msgspec

from pdserve.errors import PdserveError
from pdserve.sampling_params import SamplingParams

PROTOCOL_VERSION = 4


class WireError(PdserveError):
    """A frame that is not a valid message of this protocol version."""


class WireSamplingParams(msgspec.Struct, frozen=True):
    """What a worker needs of `SamplingParams`. Stop strings stay with the router, which owns the
    text; stop token ids, EOS and max_tokens are checked by the engine."""

    max_tokens: int
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: int | None = None
    logit_bias: dict[int, float] = {}

    @classmethod
    def from_params(cls, p: SamplingParams) -> WireSamplingParams:
        # Every field here has the same name in SamplingParams.
        fields = {name: getattr(p, name) for name in cls.__struct_fields__}
        fields["stop_token_ids"] = list(p.stop_token_ids)
        fields["logit_bias"] = dict(p.logit_bias)
        return cls(**fields)

    def to_params(self) -> SamplingParams:
        """Validated again on this side: a peer's frame is input like any other."""
        fields = msgspec.structs.asdict(self)
        fields["stop_token_ids"] = list(self.stop_token_ids)
        return SamplingParams(**fields)


class KVHandle(msgspec.Struct, frozen=True):
    """Where a request's KV blocks are (a prefilled prompt, or a stream that moves), and until when
    the worker that holds them keeps them."""

    worker_id: str
    transport: str  # "shm" | "tcp" | "nixl"
    address: str  # shm segment name, host:port, or a NIXL agent name
    block_ids: list[int]
    num_tokens: int  # tokens of KV in those blocks: every token of the request but its last
    # Seconds the holder keeps the blocks from when it made this handle: a duration, so that no
    # two hosts' clocks need agree. The puller counts it from when the handle reached it (the
    # milliseconds in transit come off the margin it keeps).
    lease_seconds: float
    lease_id: str  # the request id the holder keeps them under: a pull names it
    # Hex of the unguessable token the holder made for this lease: a pull must show it (tcp, nixl).
    # Only the router and the worker it hands this handle to see it.
    lease_token: str = ""
    # Hex XXH3-128 of each block as the holder leased it (transfer/checksum.py kv_block_digests),
    # one per block so that a pull of only the blocks the puller lacks (a delta) is checked too;
    # the puller checks what landed against them. Empty: the holder does not digest (a GPU cache
    # by default).
    kv_block_digests: list[str] = []
    # time.monotonic() on the holder's host when the lease ends: exact for a puller on the same
    # host (CLOCK_MONOTONIC is one clock per host), so shm pulls, which always are, go by it.
    lease_ends_monotonic: float = 0.0
    # The node the holder runs on, and its shared-memory segment when it has one besides
    # `address` (a tcp or nixl worker with same-node shm): a puller on the same node copies from
    # the segment instead, whatever `transport` says.
    node_id: str = ""
    shm_address: str = ""


# -- router -> worker --------------------------------------------------------------------------------
class AddRequest(msgspec.Struct, frozen=True, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    params: WireSamplingParams
    # The tokens already sampled elsewhere (the prefill worker's first token, or all of a moving
    # stream's tokens so far). With `kv`, the KV of the prompt and all of them but the last is
    # there; without, the worker computes it again (a stream resumed after its worker died).
    output_token_ids: list[int] = []
    kv: KVHandle | None = None
    sampler_state: bytes | None = None  # a moving stream's sampling generator, where it stopped
    # At most this many prompt tokens per step (0: the engine's chunk): a prompt prefilled on a
    # decode worker in chunks that keep its steps within the ITL budget.
    max_chunk_tokens: int = 0
    # ... and, when the worker's own step model is ready, each chunk sized step by step so that its
    # streams keep this ITL budget (seconds; 0: none) at this percentile of its step-time errors.
    max_step_seconds: float = 0.0
    step_percentile: float = 0.9


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    request_id: str


class Release(msgspec.Struct, frozen=True, tag="release"):
    """The worker that pulled this held request's KV has it (or gave up on it): free the blocks."""

    request_id: str


class Migrate(msgspec.Struct, frozen=True, tag="migrate"):
    """Stop these requests here so they continue on another worker: each is answered with
    `Migrated` once it is between two tokens (after its prompt, after its KV has arrived)."""

    request_ids: list[str]


class Forget(msgspec.Struct, frozen=True, tag="forget"):
    """The worker whose KV was at `kv_address` is gone: drop what is kept to read from it (a
    shared-memory mapping, which would otherwise keep its memory alive; pooled connections)."""

    kv_address: str


class Shutdown(msgspec.Struct, frozen=True, tag="shutdown"):
    pass


# -- worker -> router --------------------------------------------------------------------------------
class Ready(msgspec.Struct, frozen=True, tag="ready"):
    """A worker's greeting. Also what it reports to its cluster backend once it serves."""

    worker_id: str
    role: str
    model: str
    max_model_len: int
    vocab_size: int
    kv_transport: str
    kv_address: str
    rpc_address: str  # the ZeroMQ address the worker bound
    # Its engine's scheduling limits: the router's cost model steps them forward (0: not said).
    chunk_size: int = 0
    max_num_batched_tokens: int = 0
    max_num_seqs: int = 0
    # Its CURVE public key (Z85): the router connects only to the worker that holds its secret half.
    rpc_public_key: str = ""
    node_id: str = ""  # the node it runs on (WorkerConfig.node_id)
    kv_shm_address: str = ""  # its KV segment besides `kv_address` (same-node shm), or ""
    # Prefill role: a prompt of at most one chunk that arrives during a step runs between two of
    # its layers when it is shorter than what that step's prompts have left (it waits for no step).
    prefill_interrupts: bool = False
    # Its prefix cache's salt (blockkeys.py): with the tokens, what its block keys hash; "" when
    # prefix caching is off. Its load reports say which keys it stores and evicts.
    prefix_salt: str = ""


class Tokens(msgspec.Struct, frozen=True, tag="tokens"):
    """New tokens of one request; `finish_reason` set on the last message of the request.

    A prefill worker's answer carries the first token, finish_reason "prefilled" and `kv`.
    finish_reason "error" comes with `error`: the request failed on this worker (a KV transfer
    that did not arrive, say) and the router decides whether to retry it; `invalid` says the
    worker refused the request itself (bad parameters), which another attempt would not mend."""

    request_id: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | None = None
    logprobs: list[tuple[int, float, dict[int, float]]] | None = None
    kv: KVHandle | None = None
    error: str | None = None
    queue_seconds: float | None = None  # how long the request waited on this worker to start
    invalid: bool = False


class KVPulled(msgspec.Struct, frozen=True, tag="kv_pulled"):
    """Decode worker: the prompt KV of a request arrived (ok) or did not. The router then releases
    the prefill side's blocks, and counts the transfer's bytes and time in its metrics."""

    request_id: str
    ok: bool
    nbytes: int
    seconds: float
    error: str | None = None
    checksum_failed: bool = False  # the blocks arrived but did not match the holder's digest
    transport: str = ""  # the one the pull went over (a tcp deployment pulls over shm on one node)


class Migrated(msgspec.Struct, frozen=True, tag="migrated"):
    """A request asked to move has stopped here. With `kv`, its blocks are held under that lease
    until Release (or expiry) and the router continues it elsewhere from `output_token_ids` (every
    output of this leg so far, in order, those it came here with included); without, nothing of
    it was computed here (it was queued)."""

    request_id: str
    output_token_ids: list[int]
    kv: KVHandle | None = None
    sampler_state: bytes | None = None


class StepSample(msgspec.Struct, frozen=True, array_like=True):
    """One engine step: what it computed and how long it took (the cost model's data)."""

    seconds: float
    prefill_tokens: int
    prefill_attention: int  # sum over prompt chunks of tokens x mean attended positions
    decode_streams: int
    decode_context: int  # sum of the decode streams' context lengths
    # The worker loop's own time around the step while it had work: sending the step's outputs,
    # and the messages, hand-overs and KV pulls it waited on since the step before (0 after an
    # idle wait). A stream's gap is the step plus this (pdserve profile --from-trace fits both).
    loop_seconds: float = 0.0
    # The part of loop_seconds the loop waited on KV pulls (up to kv_join_wait): a simulation
    # models the pulls apart, so a fit of the loop's own work leaves this out.
    pull_wait_seconds: float = 0.0
    # The KV blocks of the pulls the loop started (and waited on) since the step before: a served
    # pull's wait is fitted against them (pdserve/sim/calibrate.py).
    pull_blocks: int = 0
    # With pull_blocks: the seconds the pulls done since the step before took to copy (each its
    # KVDone's own time), the part of the wait that was not the hand-over around them.
    pull_seconds: float = 0.0


MAX_STEP_SAMPLES = 64  # per load report; a worker drops older ones (reports come every 0.1 s)


class Load(msgspec.Struct, frozen=True, tag="load"):
    worker_id: str
    num_running: int
    num_waiting: int
    queued_prompt_tokens: int
    kv_blocks_used: int
    kv_blocks_free: int
    num_held: int  # requests whose KV blocks are held for another worker to pull
    last_step_ms: float
    steps: list[StepSample] = []  # the steps since the last report, oldest first
    kv_blocks_total: int = 0
    block_size: int = 0
    # Since the worker started: connections refused at the RPC handshake (no key, a wrong key, not
    # CURVE) and frames from accepted peers that were dropped (not our protocol).
    rpc_refused: int = 0
    rpc_dropped: int = 0
    # Since the worker started (prefill role): steps of short prompts run between two layers of
    # another step (wire.Ready.prefill_interrupts).
    steps_between_layers: int = 0
    # Since the worker started, in tokens: looked up in its prefix cache as it admitted requests,
    # and found there; and the blocks cached now.
    prefix_queries: int = 0
    prefix_hits: int = 0
    prefix_cached_blocks: int = 0
    # Block keys (blockkeys.py) cached, and no longer cached, since the last report.
    prefix_stored: list[bytes] = []
    prefix_evicted: list[bytes] = []


Message = (
    AddRequest | Abort | Release | Migrate | Forget | Shutdown | Ready | Tokens | KVPulled | Migrated | Load
)


class Frame(msgspec.Struct, frozen=True, array_like=True):
    version: int
    message: Message


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Frame)


def encode(message: Message) -> bytes:
    return _encoder.encode(Frame(PROTOCOL_VERSION, message))


def decode(data: bytes) -> Message:
    try:
        frame = _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        # A frame of another version may not even parse: say which version we speak.
        raise WireError(f"bad frame (this side speaks protocol {PROTOCOL_VERSION}): {exc}") from exc
    if frame.version != PROTOCOL_VERSION:
        raise WireError(f"peer speaks protocol {frame.version}, this side {PROTOCOL_VERSION}")
    return frame.message
