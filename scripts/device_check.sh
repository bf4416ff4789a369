#!/usr/bin/env bash
# The GPU checks of the engine in one prepared run, for a session lent a device machine (an NVIDIA
# GPU whose python3 has a CUDA torch and transformers; no network there). From the repository root:
#
#     bash scripts/device_check.sh            # results under $OUT (the device tool's), else /tmp
#
# 1. tests/test_cuda.py (greedy against transformers on the GPU, CUDA graphs against eager steps,
#    the GPU's step budget) and tests/test_decode_graphs.py;
# 2. benchmarks/engine_gpu.py on the SmolLM2-135M and Llama 3.2 1B shapes: pdserve with CUDA
#    graphs, without them (pdserve-eager) and transformers, in one run each.
# Each part has its own time limit, so one that hangs leaves the others their time: about 9 minutes
# in all. Copy the tables into docs/performance.md with the machine and the date printed here.
set -uo pipefail
out=${OUT:-/tmp/pdserve-device-check}
mkdir -p "$out"
export PYTHONPATH=. PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
{
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)'
} 2>&1 | tee "$out/machine.txt"

timeout 150 python3 -m pytest -q -x tests/test_cuda.py tests/test_decode_graphs.py 2>&1 | tee "$out/tests.log"
echo "tests: exit ${PIPESTATUS[0]}" | tee -a "$out/tests.log"

for shape in smollm2-135m llama-1b; do
    timeout 180 python3 benchmarks/engine_gpu.py --shape "$shape" --repeats 3 \
        --out "$out/engine_gpu_$shape.json" 2>&1 | tee "$out/engine_gpu_$shape.log"
    echo "engine_gpu $shape: exit ${PIPESTATUS[0]}" | tee -a "$out/engine_gpu_$shape.log"
done
date -u | tee -a "$out/machine.txt"
