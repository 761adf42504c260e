"""qrun: quantized LLM inference with a paged KV cache and continuous batching."""

from qrun.llm import LLM
from qrun.llm_engine import EngineConfig, LLMEngine
from qrun.sampling_params import SamplingParams
from qrun.sequence import CompletionOutput, RequestOutput

__all__ = ["LLM", "EngineConfig", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput"]
