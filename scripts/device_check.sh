#!/usr/bin/env bash
# The GPU checks of the engine, prepared for a session lent a device machine (an NVIDIA GPU whose
# python3 has a CUDA torch and transformers; no network there). From the repository root:
#
#     bash scripts/device_check.sh tests smollm2-135m     # one device call (~7 minutes)
#     bash scripts/device_check.sh llama-1b               # a second one (~4 minutes)
#
# Parts (all of them when none is named; results under $OUT, the device tool's, else /tmp):
#   tests         tests/test_cuda.py (greedy against transformers on the GPU, CUDA graphs against
#                 eager steps, the GPU's step budget) and tests/test_decode_graphs.py
#   SHAPE         benchmarks/engine_gpu.py --shape SHAPE (smollm2-135m, llama-1b): pdserve with CUDA
#                 graphs, without them (pdserve-eager) and transformers, in one run
# Each part has its own time limit, so one that hangs leaves the others their time. Copy the tables
# into docs/performance.md with the machine and the date printed here.
set -uo pipefail
out=${OUT:-/tmp/pdserve-device-check}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
} 2>&1 | tee "$out/machine.txt"

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests smollm2-135m llama-1b)
for part in "${parts[@]}"; do
    if [ "$part" = tests ]; then
        timeout 300 python3 -m pytest -q tests/test_cuda.py tests/test_decode_graphs.py 2>&1 | tee "$out/tests.log"
        echo "tests: exit ${PIPESTATUS[0]}" | tee -a "$out/tests.log"
    else
        timeout 270 python3 benchmarks/engine_gpu.py --shape "$part" --repeats 3 \
            --out "$out/engine_gpu_$part.json" 2>&1 | tee "$out/engine_gpu_$part.log"
        echo "engine_gpu $part: exit ${PIPESTATUS[0]}" | tee -a "$out/engine_gpu_$part.log"
    fi
done
date -u | tee -a "$out/machine.txt"
