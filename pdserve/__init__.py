"""pdserve: LLM serving with disaggregated prefill and decode.

`LLM` is imported lazily so that the layers that must never load torch (router, bench, planner)
can import `pdserve.*` freely.
"""

from typing import TYPE_CHECKING, Any

from pdserve.ops.cpu.isa import apply_torch_caps
from pdserve.outputs import CompletionOutput, RequestOutput
from pdserve.sampling_params import SamplingParams

# Under PDSERVE_CPU_ISA, cap torch's own dispatch (ATen, oneDNN, MKL) before torch reads its knobs
# (none of the imports above loads torch).
apply_torch_caps()

if TYPE_CHECKING:
    from pdserve.llm import LLM

__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"


def __getattr__(name: str) -> Any:
    if name == "LLM":
        from pdserve.llm import LLM

        return LLM
    raise AttributeError(f"module 'pdserve' has no attribute {name!r}")
