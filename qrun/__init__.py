"""qrun: quantized LLM inference with a paged KV cache and continuous batching.

The public names load on first use, so `import qrun.cli` (and `qrun --help`) need not import
torch and Triton.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {"LLM": "qrun.llm", "EngineConfig": "qrun.llm_engine", "LLMEngine": "qrun.llm_engine",
            "SamplingParams": "qrun.sampling_params", "RequestOutput": "qrun.sequence",
            "CompletionOutput": "qrun.sequence", "QrunPredictor": "qrun.ray_batch"}

if TYPE_CHECKING:
    from qrun.llm import LLM
    from qrun.llm_engine import EngineConfig, LLMEngine
    from qrun.ray_batch import QrunPredictor
    from qrun.sampling_params import SamplingParams
    from qrun.sequence import CompletionOutput, RequestOutput


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qrun' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


__all__ = list(_EXPORTS)
