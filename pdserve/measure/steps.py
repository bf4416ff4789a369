"""Measures the engine's step time on this machine (torch): the real engine, its real scheduler,
driven through a designed sweep of steps, timed as the engine times every step it serves.

The sweep, each part on one engine (the mixed role, so that one engine runs every kind of step):
- prompts alone: prompts of 16 .. 2048 tokens (and one chunked past its first chunk, for the
  attention of a chunk that starts deep in its prompt);
- decode batches: B streams (1 .. 48) at contexts of 128 and 1024 tokens, a dozen steps each;
- mixed steps: a prompt arriving while B streams decode (what a colocated worker, or a decode
  worker prefilling a short prompt itself, runs).
The first steps after the model loads (kernel builds, caches) are run and thrown away.

The step time of each pool role is then fitted (`costmodel.fit_step_time`, on the relative
error) to the steps that role runs: the prefill role to prompt-only steps, the decode and
colocated roles to all of them. The fit's error on its own samples is kept with it.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

from pdserve.config import EngineConfig, Role
from pdserve.costmodel import Step
from pdserve.engine.factory import build_engine
from pdserve.errors import PdserveError
from pdserve.measure import neighbour
from pdserve.ops.cpu.linear import PackedLinear
from pdserve.sampling_params import SamplingParams
from pdserve.sim.step_time import LinearStep, StreamPasses

logger = logging.getLogger("pdserve.measure")


@dataclass(frozen=True)
class Sample:
    step: Step
    seconds: float


@dataclass(frozen=True)
class Sweep:
    prompts: tuple[int, ...] = (16, 64, 128, 256, 512, 1024, 2048)
    chunked_prompt: int = 3072  # in chunks of `chunk`: chunks that start deep in their prompt
    batches: tuple[int, ...] = (1, 4, 16, 48)
    contexts: tuple[int, ...] = (128, 1024)
    max_context_tokens: int = 16384  # a decode batch's prompts in all (B x context), at most
    decode_steps: int = 12
    mixed_batches: tuple[int, ...] = (4, 16)
    mixed_prompts: tuple[int, ...] = (64, 256, 1024)
    repeats: int = 2
    chunk: int = 1024
    warmup_steps: int = 8


# A GPU's steps are milliseconds where a CPU's are tens of them: longer prompts (each one chunk of
# 2048, the chunked one deep in its prompt) and batches up to 256 streams, where a decode step turns
# from reading the weights to computing (pdserve/sim/roofline.py's bend).
GPU = Sweep(
    prompts=(128, 256, 512, 1024, 2048),
    chunked_prompt=6144,
    batches=(1, 8, 32, 64, 128, 256),
    contexts=(512, 2048),
    max_context_tokens=262144,
    decode_steps=12,
    mixed_batches=(8, 64),
    mixed_prompts=(256, 1024, 2048),
    repeats=2,
    chunk=2048,
    warmup_steps=8,
)


QUICK = Sweep(
    prompts=(16, 64, 256),
    chunked_prompt=512,
    batches=(1, 4),
    contexts=(32, 128),
    decode_steps=4,
    mixed_batches=(2,),
    mixed_prompts=(32, 128),
    repeats=1,
    chunk=256,
    warmup_steps=2,
)


# The speed check (pdserve/sim/speed.py, plan "check-1"): a few seconds of the same steps every
# time, to say how fast this host runs now against when a profile was measured. Do not change
# it without renaming the plan there: checks pair their steps by what they compute. Every prompt
# fits one chunk of any engine's (>= 256 tokens), so the steps are the same whatever the chunk.
CHECK_PROMPTS = (16, 64, 128)  # prompts alone
CHECK_BATCHES = (1, 4, 8)  # streams of CHECK_CONTEXT-token prompts, decoding CHECK_DECODE_STEPS steps
CHECK_CONTEXT = 32
CHECK_DECODE_STEPS = 8
CHECK_MIXED = (4, 64)  # a prompt of 64 tokens beside 4 decoding streams
CHECK_ROUNDS = 3  # the check's steps are run this many times; each step's median is kept


class StepProbe:
    """An engine built as a worker's would be, stepped by hand."""

    def __init__(
        self,
        model: str,
        dtype: str,
        threads: int | None,
        chunk: int,
        kv_gib: float | None,
        device: str = "cpu",
    ) -> None:
        config = EngineConfig(
            model=model,
            device=device,
            dtype=dtype,
            role=Role.MIXED,
            threads=threads,
            chunk_size=chunk,
            max_num_batched_tokens=max(chunk, 2048) + 64,
            max_num_seqs=256,
            kv_cache_memory_gib=kv_gib,
        )
        self.engine, _ = build_engine(config, eos_token_ids=(0,))
        self.num_blocks = self.engine.stats().kv_blocks_free
        self.block_size = config.block_size
        self.vocab = self.engine.limits.vocab_size
        self._serial = 0
        self.samples: list[Sample] = []

    def prompt(self, tokens: int) -> list[int]:
        self._serial += 1
        return [(self._serial * 7919 + i) % (self.vocab - 2) + 1 for i in range(tokens)]

    def add(self, prompt_tokens: int, max_tokens: int) -> str:
        request_id = f"p{self._serial}"
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        self.engine.add_request(request_id, self.prompt(prompt_tokens), params)
        return request_id

    def steps(self) -> Iterator[None]:
        """Steps until the engine is idle, recording each."""
        while self.engine.has_unfinished:
            self.engine.step()
            stats = self.engine.last_step
            if stats is not None and stats.num_batched_tokens:
                self.samples.append(
                    Sample(
                        Step(
                            stats.num_prefill_tokens,
                            stats.prefill_attention,
                            stats.num_decode_tokens,
                            stats.decode_context,
                        ),
                        stats.step_seconds,
                    )
                )
            yield

    def run_all(self) -> None:
        for _ in self.steps():
            pass


def sweep(probe: StepProbe, plan: Sweep, budget_s: float | None = None) -> list[Sample]:
    """Runs the sweep; returns its samples (the warm-up's left out). `budget_s`: stop adding parts
    once this much time went (what was measured is kept)."""
    started = time.perf_counter()

    def over() -> bool:
        return budget_s is not None and time.perf_counter() - started > budget_s

    probe.add(64, plan.warmup_steps)
    probe.run_all()
    probe.samples.clear()
    for _ in range(plan.repeats):
        for tokens in plan.prompts:  # one prompt, one chunk per step
            probe.add(tokens, 1)
            probe.run_all()
        probe.add(plan.chunked_prompt, 1)
        probe.run_all()
    logger.info("prompt steps measured: %d", len(probe.samples))
    for context in plan.contexts:
        for batch in plan.batches:
            if batch * context > plan.max_context_tokens or over():
                continue
            for _ in range(batch):
                probe.add(context, plan.decode_steps + 1)
            probe.run_all()
    logger.info("with decode batches: %d", len(probe.samples))
    for batch in plan.mixed_batches:
        for tokens in plan.mixed_prompts:
            if over():
                break
            for _ in range(batch):
                probe.add(128, 4 * plan.decode_steps)
            stepping = probe.steps()
            for _ in range(plan.decode_steps):  # the streams decode, then a prompt comes
                next(stepping, None)
            probe.add(tokens, 1)
            for _ in stepping:
                pass
    logger.info("with mixed steps: %d", len(probe.samples))
    return list(probe.samples)


def speed_check(probe: StepProbe, rounds: int = CHECK_ROUNDS) -> list[tuple[Step, float]]:
    """The speed check's steps on `probe`'s engine, each with its median time over `rounds` runs:
    what this host's engine takes for them now (a few seconds for SmolLM2 on a CPU)."""
    times: dict[Step, list[float]] = {}
    for _ in range(rounds):
        probe.add(16, 4)  # a warm-up, not kept
        probe.run_all()
        probe.samples.clear()
        for tokens in CHECK_PROMPTS:
            probe.add(tokens, 1)
            probe.run_all()
        for batch in CHECK_BATCHES:
            for _ in range(batch):
                probe.add(CHECK_CONTEXT, CHECK_DECODE_STEPS + 1)
            probe.run_all()
        streams, prompt = CHECK_MIXED
        for _ in range(streams):
            probe.add(CHECK_CONTEXT, 3 * CHECK_DECODE_STEPS)
        stepping = probe.steps()
        for _ in range(CHECK_DECODE_STEPS):  # the streams decode, then a prompt comes
            next(stepping, None)
        probe.add(prompt, 1)
        for _ in stepping:
            pass
        for sample in probe.samples:
            times.setdefault(sample.step, []).append(sample.seconds)
        probe.samples.clear()
    return [(step, statistics.median(seconds)) for step, seconds in times.items()]


def stream_passes(probe: StepProbe) -> StreamPasses | None:
    """The probe's engine's stream GEMV (None: its linear layers have none: a GPU, bf16 without
    AVX512-BF16, PDSERVE_STREAM_GEMV=0)."""
    model = probe.engine.runner.model
    streams = [m for m in model.layers.modules() if isinstance(m, PackedLinear) and m.stream is not None]
    if not streams:
        return None
    logits = model.packed_logits
    logits_rows = logits.stream_rows if logits is not None and logits.stream is not None else 0
    return StreamPasses(streams[0].rows_per_pass, streams[0].stream_rows, logits_rows)


def fit(samples: list[Sample]) -> LinearStep:
    return LinearStep.fitted([(s.step, s.seconds) for s in samples])


def fit_roles(samples: list[Sample]) -> dict[str, LinearStep]:
    """Each pool role's step time, from the steps it runs: one line each. (The stream GEMV's
    terms, `stream_passes`, are left to a served fit: the sweep's prompts jump from 16 tokens to
    64, and a fit with them put 0.2 s on the GEMM's step from that gap.)"""
    prompt_only = [s for s in samples if s.step.decode_streams == 0 and s.step.prefill_tokens > 0]
    everything = fit(samples)
    return {"prefill": fit(prompt_only), "decode": everything, "colocated": everything}


@contextlib.contextmanager
def busy_neighbour(model: str, dtype: str, cpu: int, kind: str = "decode") -> Iterator[subprocess.Popen[str]]:
    """A second engine working without end on `cpu` meanwhile, decoding unless `kind` says
    otherwise (pdserve/measure/neighbour.py); yields its process."""
    if (error := neighbour.kind_error(kind)) is not None:
        raise PdserveError(error)
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve.measure.neighbour", model, str(cpu), dtype, kind],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        if process.stdout.readline().strip() != "ready":  # it loads a model: a readline, no timeout race
            raise PdserveError(
                f"the busy neighbour exited with {process.wait(timeout=30)} before it was ready"
            )
        yield process
    finally:
        if process.stdin is not None:
            process.stdin.close()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)
        if process.stdout is not None:
            process.stdout.close()
