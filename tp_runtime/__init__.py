"""tp_runtime: a tensor-parallel multiprocess LLM inference runtime."""

from tp_runtime.engine import LLM
from tp_runtime.outputs import CompletionOutput, Logprob, RequestOutput
from tp_runtime.sampling_params import SamplingParams

__all__ = ["LLM", "CompletionOutput", "Logprob", "RequestOutput", "SamplingParams"]
__version__ = "0.1.0"
