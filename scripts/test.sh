#!/usr/bin/env bash
# Lint, type-check and run the whole test suite. Expects scripts/setup.sh to have run.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
.venv/bin/ruff check pdserve tests benchmarks
.venv/bin/ruff format --check pdserve tests benchmarks
.venv/bin/mypy pdserve
.venv/bin/python -m pytest "$@"
