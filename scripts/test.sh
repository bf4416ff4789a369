#!/usr/bin/env bash
# Lint, type-check, check the layers' imports (lint-imports) and run the whole test suite, then
# (when run without arguments, as CI does) the serving smoke under the AVX2 cap
# (tests/smoke_isa_cap.py): on a better CPU it runs the paths of an AVX2-only one. Expects
# scripts/setup.sh to have run. Arguments go to the suite's pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
export PYTHONFAULTHANDLER=1  # a native crash (SIGSEGV, SIGABRT) prints every thread's Python stack
.venv/bin/ruff check pdserve tests benchmarks
.venv/bin/ruff format --check pdserve tests benchmarks
.venv/bin/mypy pdserve
.venv/bin/lint-imports --no-cache --no-logo  # DESIGN's layers (pyproject.toml, [tool.importlinter])
.venv/bin/python -m pytest "$@"
if [ "$#" -eq 0 ]; then
  PDSERVE_CPU_ISA=avx2 .venv/bin/python -m pytest tests/smoke_isa_cap.py
fi
