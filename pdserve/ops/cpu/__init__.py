"""The engine's CPU kernels and the per-machine choices around them (issue 31's room per device):
the instruction set and its cap (isa.py, torch-free), the measured plan (plan.py), the C++ library
built from the sources here (kernels.py), prepacked and streamed linear layers (linear.py), the
C++ layer ops (ops.py) and huge pages for the KV cache (huge_pages.py).

Torch-free itself: `pdserve` imports `isa` at start, before torch reads its dispatch settings."""
