#!/usr/bin/env bash
# Starts `pdserve serve` with the real model (SmolLM2-135M-Instruct) disaggregated into one prefill
# and one decode worker, sends it one chat request through the OpenAI API, prints the answer and
# stops the server (which stops its workers and removes its shared-memory segments).
# Usage: scripts/demo.sh ["your question"]   (PORT=8000 by default)
set -euo pipefail
cd "$(dirname "$0")/.."
PORT="${PORT:-8000}"
QUESTION="${1:-What is the capital of France? Answer in one sentence.}"

LOG=$(mktemp -t pdserve-demo.XXXXXX)
# The server writes to $LOG (whose last error line is quoted if it exits), which `tail` shows here.
PYTHONUNBUFFERED=1 .venv/bin/pdserve serve --model smollm2-135m --prefill 1 --decode 1 --port "$PORT" \
  > "$LOG" 2>&1 &
SERVER=$!
tail -n +1 -f --pid="$SERVER" "$LOG" &
TAIL=$!
trap 'kill -INT "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; wait "$TAIL" 2>/dev/null || true; rm -f "$LOG"' EXIT

status=0
.venv/bin/python - "$PORT" "$QUESTION" "$SERVER" <<'PY' || status=$?
import os, sys, time, httpx, openai

port, question, server = sys.argv[1], sys.argv[2], int(sys.argv[3])


def server_exited() -> bool:
    # An exited child stays a zombie (state Z) until the shell reaps it.
    try:
        with open(f"/proc/{server}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        if os.path.isdir("/proc"):
            return True  # gone
    except (OSError, IndexError):
        pass
    try:  # no /proc (not Linux): only a reaped process is seen as gone
        os.kill(server, 0)
    except ProcessLookupError:
        return True
    return False


deadline = time.monotonic() + 300  # the first start builds the tokenizer cache and the CPU kernel
while True:
    try:
        if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
            break
    except httpx.TransportError:
        pass
    if server_exited():
        sys.exit(3)  # the shell says why, with the server's exit code
    if time.monotonic() > deadline:
        sys.exit("pdserve serve did not become ready within 300 s")
    time.sleep(0.5)

client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
print(f"\n>>> {question}\n", flush=True)
stream = client.chat.completions.create(
    model="smollm2-135m", messages=[{"role": "user", "content": question}],
    max_tokens=64, temperature=0, stream=True,
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print("\n")
PY
if [ "$status" -eq 3 ]; then
  code=0
  wait "$SERVER" || code=$?
  wait "$TAIL" 2>/dev/null || true
  trap 'rm -f "$LOG"' EXIT
  last=$(grep -E "ERROR|Error|error" "$LOG" | tail -n 1 || true)
  echo "demo: pdserve serve exited with code $code before it was ready${last:+; its last error: $last}" >&2
  exit 1
fi
exit "$status"
