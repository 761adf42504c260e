"""qrun: quantized LLM inference with a paged KV cache and continuous batching."""

import os

# OpenMP worker threads that spin while the engine runs Python (scheduling, sampling) steal the
# core that Python needs; on a busy 2-core machine spinning made steps 10-40x slower. Set before
# torch loads its OpenMP runtime; a user's own setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from qrun.llm import LLM  # noqa: E402
from qrun.llm_engine import EngineConfig, LLMEngine
from qrun.sampling_params import SamplingParams
from qrun.sequence import CompletionOutput, RequestOutput

__all__ = ["LLM", "EngineConfig", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
