"""A decode step's linear layers: oneDNN's prepacked `_linear_pointwise` against the engine's stream
GEMV (`torch.ops.pdserve.stream_linear`, cpu_gemv.cpp; AVX512-BF16 builds only), bf16.

A b1 decode step reads every weight once, from memory: SmolLM2's 30 layers' four projections are
212 MB in bf16, far more than the last-level cache, and this loop cycles over all of them as a
step does. Rows (M) are a step's decode streams; the engine uses the stream GEMV up to the row
count its per-machine measurement chose (`pdserve info`).

    .venv/bin/python benchmarks/decode_gemv.py --threads 1 2 --rows 1 2 4 8 16 32 64 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from pdserve.engine.cpu_linear import (
    pack_weight,
    packed_linear,
    stream_linear,
    stream_linear_available,
    stream_pack,
)

# SmolLM2-135M's projections per layer: qkv, o, gate_up, down ([out, in]).
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--layers", type=int, default=30)
    args = p.parse_args()
    if not stream_linear_available():
        raise SystemExit("the C++ kernels are unavailable or were built without AVX512-BF16")
    torch.manual_seed(0)
    weights = [
        [torch.randn(n, k, dtype=torch.bfloat16) * 0.05 for n, k in SHAPES] for _ in range(args.layers)
    ]
    streams = [[stream_pack(w) for w in layer] for layer in weights]
    onednn = [[pack_weight(w) for w in layer] for layer in weights]
    total = sum(w.numel() * w.element_size() for layer in weights for w in layer)
    print(
        f"{total / 1e6:.0f} MB of bf16 weights per pass ({args.layers} layers); medians of {args.rounds}, interleaved"
    )
    for rows in args.rows:
        xs = {k: torch.randn(rows, k, dtype=torch.bfloat16) for k in {k for _, k in SHAPES}}

        def run_stream(xs: dict[int, torch.Tensor] = xs) -> None:
            for layer, packed in zip(weights, streams, strict=True):
                for w, pw in zip(layer, packed, strict=True):
                    stream_linear(xs[w.shape[1]], pw, w.shape[0], None)

        def run_onednn(xs: dict[int, torch.Tensor] = xs) -> None:
            for layer, packed in zip(weights, onednn, strict=True):
                for w, pw in zip(layer, packed, strict=True):
                    packed_linear(xs[w.shape[1]], pw, None)

        for threads in args.threads:
            torch.set_num_threads(threads)
            times: dict[str, list[float]] = {"stream GEMV": [], "oneDNN": []}
            for _ in range(args.rounds):
                for name, fn in (("stream GEMV", run_stream), ("oneDNN", run_onednn)):
                    started = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - started)
            med = {name: statistics.median(v) for name, v in times.items()}
            print(
                f"M={rows} threads {threads}: stream GEMV {med['stream GEMV'] * 1000:6.2f} ms "
                f"({total / med['stream GEMV'] / 1e9:4.1f} GB/s), oneDNN {med['oneDNN'] * 1000:6.2f} ms "
                f"({total / med['oneDNN'] / 1e9:4.1f} GB/s): oneDNN / stream {med['oneDNN'] / med['stream GEMV']:.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
