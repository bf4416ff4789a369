"""Loads a script of benchmarks/ as a module, for the tests of its functions (the scripts are run
by path, not installed): `benchmark("sim_fidelity")`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark(name: str, module_name: str | None = None) -> ModuleType:
    """benchmarks/`name`.py, executed afresh, registered as `module_name` (default `name`) in
    sys.modules: its dataclasses and pickling look their module up there."""
    spec = importlib.util.spec_from_file_location(module_name or name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
