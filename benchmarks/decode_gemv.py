"""A decode step's linear layers: oneDNN's prepacked `_linear_pointwise` against the engine's stream
GEMV (`torch.ops.pdserve.stream_linear`, cpu_gemv.cpp; AVX512-BF16 builds only), bf16; or, with
`--dtype float32`, MKL's fp32 `F.linear` over bf16-rounded weights against the fp32 stream GEMV over
the same weights stored in bf16 (`torch.ops.pdserve.stream_linear_f32`, cpu_gemv_f32.cpp; AVX2 builds).

A b1 decode step reads every weight once, from memory: SmolLM2's 30 layers' four projections are
212 MB in bf16, far more than the last-level cache, and this loop cycles over all of them as a
step does. Rows (M) are a step's decode streams; the engine uses the stream GEMV up to the row
count its per-machine measurement chose (`pdserve info`).

    .venv/bin/python benchmarks/decode_gemv.py --threads 1 2 --rows 1 2 4 8 16 32 64 --rounds 9
    .venv/bin/python benchmarks/decode_gemv.py --dtype float32 --threads 1 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from pdserve.ops.cpu.linear import (
    STREAM_F32_COLS,
    pack_weight,
    packed_linear,
    stream_linear,
    stream_linear_available,
    stream_linear_f32,
    stream_linear_f32_available,
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
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = p.parse_args()
    fp32 = args.dtype == "float32"
    if not (stream_linear_f32_available() if fp32 else stream_linear_available()):
        raise SystemExit(
            f"the C++ kernels are unavailable or were built without {'AVX2' if fp32 else 'AVX512-BF16'}"
        )
    torch.manual_seed(0)
    weights = [
        [torch.randn(n, k, dtype=torch.bfloat16) * 0.05 for n, k in SHAPES] for _ in range(args.layers)
    ]
    if fp32:  # bf16-stored for the stream; their exact fp32 widening for MKL
        streams = [[stream_pack(w, STREAM_F32_COLS) for w in layer] for layer in weights]
        weights = [[w.float() for w in layer] for layer in weights]
        baseline = weights
    else:
        streams = [[stream_pack(w) for w in layer] for layer in weights]
        baseline = [[pack_weight(w) for w in layer] for layer in weights]
    kernel = stream_linear_f32 if fp32 else stream_linear
    total = sum(w.numel() * w.element_size() for layer in weights for w in layer)
    print(
        f"{total / 1e6:.0f} MB of {args.dtype} weights per pass ({args.layers} layers; the stream reads "
        f"{'half' if fp32 else 'as many'}); medians of {args.rounds}, interleaved"
    )
    for rows in args.rows:
        xs = {k: torch.randn(rows, k).to(weights[0][0].dtype) for k in {k for _, k in SHAPES}}

        def run_stream(xs: dict[int, torch.Tensor] = xs) -> None:
            for layer, packed in zip(weights, streams, strict=True):
                for w, pw in zip(layer, packed, strict=True):
                    kernel(xs[w.shape[1]], pw, w.shape[0], None)

        def run_onednn(xs: dict[int, torch.Tensor] = xs) -> None:
            for layer, packed in zip(weights, baseline, strict=True):
                for w, pw in zip(layer, packed, strict=True):
                    if fp32:
                        F.linear(xs[w.shape[1]], pw)
                    else:
                        packed_linear(xs[w.shape[1]], pw, None)

        for threads in args.threads:
            torch.set_num_threads(threads)
            times: dict[str, list[float]] = {"stream GEMV": [], "baseline": []}
            for _ in range(args.rounds):
                for name, fn in (("stream GEMV", run_stream), ("baseline", run_onednn)):
                    started = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - started)
            med = {name: statistics.median(v) for name, v in times.items()}
            name = "MKL F.linear" if fp32 else "oneDNN"
            stream_bytes = total / 2 if fp32 else total
            print(
                f"M={rows} threads {threads}: stream GEMV {med['stream GEMV'] * 1000:6.2f} ms "
                f"({stream_bytes / med['stream GEMV'] / 1e9:4.1f} GB/s), {name} {med['baseline'] * 1000:6.2f} ms "
                f"({total / med['baseline'] / 1e9:4.1f} GB/s): {name} / stream {med['baseline'] / med['stream GEMV']:.2f}x",
                flush=True,
            )


if __name__ == "__main__":
    main()
