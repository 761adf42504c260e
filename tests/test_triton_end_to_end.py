"""The whole model through the Triton kernels (in the interpreter on a CPU) equals the torch path."""

from __future__ import annotations

import os

import pytest

from qrun import LLM, SamplingParams

PROMPTS = ["The capital of France is", "2 + 2 =", "Hello, my name is", "Water boils at"]


def greedy(model, backend, monkeypatch, prompts, max_tokens):
    monkeypatch.setenv("QRUN_KERNELS", backend)  # read once, when the model picks its kernels
    llm = LLM(str(model), dtype="float32", kv_cache_memory=20_000_000, max_num_batched_tokens=64, max_num_seqs=4)
    return [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                       ignore_eos=True), progress=False)]


needs_interpreter = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1" and not __import__("torch").cuda.is_available(),
    reason="no GPU and TRITON_INTERPRET is not set")


@needs_interpreter
def test_tiny_model_through_triton_kernels_equals_torch(tiny_llama_dir, monkeypatch):
    prompts = [[1, 2, 3], list(range(40)), [9] * 17, [200, 100]]
    assert greedy(tiny_llama_dir, "triton", monkeypatch, prompts, 6) == greedy(
        tiny_llama_dir, "torch", monkeypatch, prompts, 6)


@pytest.mark.slow
@needs_interpreter
def test_smollm2_through_triton_kernels_equals_torch(smollm2_gguf, monkeypatch):
    assert greedy(smollm2_gguf, "triton", monkeypatch, PROMPTS, 4) == greedy(
        smollm2_gguf, "torch", monkeypatch, PROMPTS, 4)
