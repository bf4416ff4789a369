#!/usr/bin/env bash
# Issue 10's measurements on SmolLM2-135M (docs/performance.md, "The planner and the path choice"):
#
#   benchmarks/planner.sh OUT STEP...     STEP: paths paths-m2 paths-tight interrupt interrupt-m2 interrupt-m3 quiet quiet-m3 step
#
# paths / paths-m2: steady short chats plus long prompts that keep the one prefill worker busy most
#   of the time (two mixes; BUSY, PREFILL_TOK_S below), colocated chunked prefill (2 workers) against DPD 1+1 with each
#   request's path chosen by the cost model and DPD with the old fixed threshold.
# paths-tight: paths' workload on DPD with the server's ITL SLO at ITL_TIGHT ms (default 45).
# interrupt / interrupt-m2: paths' and paths-m2's workloads; colocated, DPD at the ITL SLO of 250 and
#   of ITL_TIGHT (45) ms with short prompts prefilled between two layers of a document's step (the
#   default), and DPD at 250 without (--no-prefill-interrupts). interrupt-m3: a third mix (W_CHAT3,
#   W_DOCS3 below), one run.
# quiet / quiet-m3: the chats of paths / interrupt-m3 alone on DPD, at both ITL SLOs (the ITL baseline).
# step: a chat rate that steps x3 for 60 s, static pools against --planner slo (budget 3).
# Run on a quiet machine; configurations never share it (bench compare runs them in turn).
set -euo pipefail
OUT=${1:?usage: $0 OUT STEP...}
shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
REPEATS=${REPEATS:-2}
PDSERVE="$ROOT/.venv/bin/python -m pdserve.cli"

# The documents keep the one prefill worker BUSY (default 0.8) of the time, whatever this machine's
# speed: their rate follows from one worker's prefill throughput (prompt tokens/s, 256-token chunks,
# one thread as a serving worker has), measured here unless PREFILL_TOK_S gives it.
BUSY=${BUSY:-0.8}
if [[ -z ${PREFILL_TOK_S:-} ]]; then
    PREFILL_TOK_S=$("$ROOT/.venv/bin/python" - <<'PY'
import time

import torch

torch.set_num_threads(1)
from pdserve import LLM, SamplingParams

llm = LLM("smollm2-135m", chunk_size=256, num_kv_blocks=256)
params = SamplingParams(max_tokens=1, ignore_eos=True)
prompt = [1000 + (7 * i) % 40000 for i in range(2000)]
llm.generate([prompt[:300]], params)  # warm-up
times = []
for _ in range(3):
    started = time.perf_counter()
    llm.generate([prompt], params)
    times.append(time.perf_counter() - started)
print(round(2000 / sorted(times)[1]))
PY
    )
fi
rate() { python3 -c "print(round($BUSY * $PREFILL_TOK_S / $1, 3))"; }  # $1: mean prompt tokens
echo "prefill: $PREFILL_TOK_S prompt tokens/s on one worker; documents keep it $BUSY busy" >&2
W_CHAT="chat: poisson(rate=0.5) prompt=lognormal(96,0.4,32,256) output=uniform(24,48)"
W_DOCS="docs: constant(rate=$(rate 2000)) prompt=fixed(2000) output=fixed(8)"
W_DOCS2="docs: poisson(rate=$(rate 1000)) prompt=uniform(600,1400) output=fixed(8)" # shorter, random
# A third mix: twice the chats, longer and more varied (some longer than a prefill chunk, which never
# run inside another step), and longer documents at half of BUSY (the chats take ~a third).
W_CHAT3="chat: poisson(rate=1.0) prompt=lognormal(160,0.5,32,600) output=uniform(16,64)"
W_DOCS3="docs: poisson(rate=$(python3 -c "print(round($BUSY / 2 * $PREFILL_TOK_S / 2250, 3))")) prompt=uniform(1500,3000) output=fixed(16)"
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
    paths-tight) # the path choice held to an ITL SLO near the chats' quiet ITL p99 (ITL_TIGHT ms)
        $PDSERVE bench compare "${COMMON[@]}" --workload "$W_CHAT; $W_DOCS" --repeats "$REPEATS" \
        --config "dpd-cost-itl${ITL_TIGHT:-45}=--prefill 1 --decode 1 --slo ttft=2000,itl=${ITL_TIGHT:-45}" \
        --out "$OUT/paths-tight" ;;
    interrupt|interrupt-m2|interrupt-m3) # short prompts between two layers of a document's step, on and off
        chat=$W_CHAT; docs=$W_DOCS; repeats=$REPEATS
        if [[ $step == interrupt-m2 ]]; then docs=$W_DOCS2; repeats=1; fi
        if [[ $step == interrupt-m3 ]]; then chat=$W_CHAT3; docs=$W_DOCS3; repeats=1; fi
        $PDSERVE bench compare "${COMMON[@]}" --workload "$chat; $docs" --repeats "$repeats" \
        --config "colocated=--colocated 2" \
        --config "dpd-cost=--prefill 1 --decode 1 --slo $SLO" \
        --config "dpd-cost-itl${ITL_TIGHT:-45}=--prefill 1 --decode 1 --slo ttft=2000,itl=${ITL_TIGHT:-45}" \
        --config "dpd-cost-no-interrupt=--prefill 1 --decode 1 --slo $SLO --no-prefill-interrupts" \
        --out "$OUT/$step" ;;
    quiet|quiet-m3) chat=$W_CHAT; repeats=$REPEATS
        if [[ $step == quiet-m3 ]]; then chat=$W_CHAT3; repeats=1; fi
        $PDSERVE bench compare "${COMMON[@]}" --config "dpd-cost=--prefill 1 --decode 1 --slo $SLO" \
        --config "dpd-cost-itl${ITL_TIGHT:-45}=--prefill 1 --decode 1 --slo ttft=2000,itl=${ITL_TIGHT:-45}" \
        --workload "$chat" --repeats "$repeats" --out "$OUT/$step" ;;
    step) $PDSERVE bench compare --model smollm2-135m --duration 180 --slo $SLO \
        --workload "chat: poisson(rate=0.4) step(60, 60, 3) prompt=lognormal(160,0.4,32,512) output=uniform(24,48)" \
        --config "static-1p1d=--prefill 1 --decode 1 --slo $SLO" \
        --config "static-2p1d=--prefill 2 --decode 1 --slo $SLO" \
        --config "planner=--prefill 1 --decode 1 --planner slo --slo $SLO --max-workers 3" \
        --repeats 1 --out "$OUT/step" ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
