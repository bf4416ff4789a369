"""The engine's GPU kernels (issue 31's room per device): Triton attention over the paged KV cache.
CPU kernels live beside the engine's core for now (engine/cpu_*.py, *.cpp)."""
