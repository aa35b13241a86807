"""tp_runtime: a tensor-parallel multiprocess LLM inference runtime."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tp_runtime.engine.args import EngineArgs
    from tp_runtime.engine.llm import LLM, run_torchrun_worker
    from tp_runtime.inputs import TextPrompt, TokensPrompt
    from tp_runtime.outputs import CompletionOutput, Logprob, RequestOutput
    from tp_runtime.sampling_params import SamplingParams, StructuredOutputsParams

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "Logprob",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "TextPrompt",
    "TokensPrompt",
    "run_torchrun_worker",
]
__version__ = "0.1.0"

# Imported on first use: `import tp_runtime.cli` (the `tp-runtime` command, torchrun's ranks) then does
# not load torch before its main() runs, so `--help`, argument errors and a Ctrl-C during start-up are
# handled there, in one line.
_EXPORTS = {
    "LLM": "tp_runtime.engine.llm",
    "run_torchrun_worker": "tp_runtime.engine.llm",
    "EngineArgs": "tp_runtime.engine.args",
    "CompletionOutput": "tp_runtime.outputs",
    "Logprob": "tp_runtime.outputs",
    "RequestOutput": "tp_runtime.outputs",
    "SamplingParams": "tp_runtime.sampling_params",
    "StructuredOutputsParams": "tp_runtime.sampling_params",
    "TextPrompt": "tp_runtime.inputs",
    "TokensPrompt": "tp_runtime.inputs",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'tp_runtime' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
