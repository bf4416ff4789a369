"""The engine's GPU kernels (issue 31's room per device): Triton attention over the paged KV cache.
The CPU's are in ops/cpu/."""
