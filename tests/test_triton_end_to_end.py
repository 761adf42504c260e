"""The whole model through the Triton kernels (in the interpreter on a CPU) equals the torch path."""

from __future__ import annotations

import os

import pytest

from qrun import LLM, SamplingParams

PROMPTS = ["The capital of France is", "2 + 2 =", "Hello, my name is", "Water boils at"]


def greedy(model, backend, monkeypatch, prompts, max_tokens, max_num_batched_tokens=64):
    monkeypatch.setenv("QRUN_KERNELS", backend)  # read once, when the model picks its kernels
    llm = LLM(str(model), dtype="float32", kv_cache_memory=20_000_000, max_num_batched_tokens=max_num_batched_tokens,
              max_num_seqs=4)
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


@needs_interpreter
def test_mixed_bit_model_through_triton_kernels_equals_the_references(tiny_llama_dir, calib_file, tmp_path,
                                                                      monkeypatch):
    """Quantized linears on every dequant_matmul path: a 90-token prompt's first chunk (the weight
    dequantized for torch's matmul), chunks of 5-64 rows beside decode rows (tiled, split-K), and
    decode steps of 1-4 rows (GEMV, split-K); the references dequantize and multiply in float32."""
    from qrun.convert.main import convert
    from qrun.kernels import dequant_matmul

    converted = tmp_path / "llama-q"
    convert(tiny_llama_dir, converted, bits=3.5, preset="fast", calib_rows=8, calib_len=64, calib=[calib_file])
    monkeypatch.setenv("QRUN_QUANT_CPU", "ref")  # the torch side dequantizes too, instead of torch's int4 kernel
    rows = []
    launches = dequant_matmul.dequant_matmul_launches
    monkeypatch.setattr(dequant_matmul, "dequant_matmul_launches", lambda x, *a, **k: rows.append(len(x)) or launches(
        x, *a, **k))
    prompts = [list(range(3, 93)), [9] * 17, [200, 100], list(range(40, 0, -1))]
    got = greedy(converted, "triton", monkeypatch, prompts, 6, max_num_batched_tokens=128)
    assert max(rows) > dequant_matmul.TILED_MAX_M and min(rows) <= dequant_matmul.GEMV_MAX_M
    assert any(dequant_matmul.GEMV_MAX_M < m <= dequant_matmul.TILED_MAX_M for m in rows)
    assert got == greedy(converted, "torch", monkeypatch, prompts, 6, max_num_batched_tokens=128)


@pytest.mark.slow
@needs_interpreter
def test_smollm2_through_triton_kernels_equals_torch(smollm2_gguf, monkeypatch):
    assert greedy(smollm2_gguf, "triton", monkeypatch, PROMPTS, 4) == greedy(
        smollm2_gguf, "torch", monkeypatch, PROMPTS, 4)
