#!/usr/bin/env bash
# Issue 10's measurements on SmolLM2-135M (docs/performance.md, "The planner and the path choice"):
#
#   benchmarks/planner.sh OUT STEP...     STEP: paths paths-m2 quiet step
#
# paths / paths-m2: steady short chats plus long prompts that keep the one prefill worker busy most
#   of the time (two mixes), colocated chunked prefill (2 workers) against DPD 1+1 with each
#   request's path chosen by the cost model and DPD with the old fixed threshold.
# quiet: the same chats alone on DPD (the ITL baseline).
# step: a chat rate that steps x3 for 60 s, static pools against --planner slo (budget 3).
# Run on a quiet machine; configurations never share it (bench compare runs them in turn).
set -euo pipefail
OUT=${1:?usage: $0 OUT STEP...}
shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REPEATS=${REPEATS:-2}
PDSERVE="$ROOT/.venv/bin/python -m pdserve.cli"

W_CHAT="chat: poisson(rate=0.5) prompt=lognormal(96,0.4,32,256) output=uniform(24,48)"
W_DOCS="docs: constant(rate=0.08) prompt=fixed(2000) output=fixed(8)"    # ~85% of a prefill worker
W_DOCS2="docs: poisson(rate=0.2) prompt=uniform(600,1400) output=fixed(8)" # shorter, random, more often
SLO=ttft=2000,itl=250
COMMON=(--model smollm2-135m --duration 120 --slo $SLO --pool-sample-interval 0)
PATHS=(--config "colocated=--colocated 2"
       --config "dpd-cost=--prefill 1 --decode 1 --slo $SLO"
       --config "dpd-threshold=--prefill 1 --decode 1 --slo $SLO --path-choice threshold")

for step in "$@"; do
    echo "== $step $(date -u +%H:%M:%S)" >&2
    case $step in
    paths) $PDSERVE bench compare "${COMMON[@]}" "${PATHS[@]}" --workload "$W_CHAT; $W_DOCS" \
        --repeats "$REPEATS" --out "$OUT/paths" ;;
    paths-m2) $PDSERVE bench compare "${COMMON[@]}" "${PATHS[@]}" --workload "$W_CHAT; $W_DOCS2" \
        --repeats 1 --out "$OUT/paths-m2" ;;
    quiet) $PDSERVE bench compare "${COMMON[@]}" --config "dpd-cost=--prefill 1 --decode 1 --slo $SLO" \
        --workload "$W_CHAT" --repeats "$REPEATS" --out "$OUT/quiet" ;;
    step) $PDSERVE bench compare --model smollm2-135m --duration 180 --slo $SLO \
        --workload "chat: poisson(rate=0.4) step(60, 60, 3) prompt=lognormal(160,0.4,32,512) output=uniform(24,48)" \
        --config "static-1p1d=--prefill 1 --decode 1 --slo $SLO" \
        --config "static-2p1d=--prefill 2 --decode 1 --slo $SLO" \
        --config "planner=--prefill 1 --decode 1 --planner slo --slo $SLO --max-workers 3" \
        --repeats 1 --out "$OUT/step" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
