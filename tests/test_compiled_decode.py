"""Compiled CPU decode steps (torch.compile): the same tokens as eager mode, and a way back to
eager when the compiler fails."""

from __future__ import annotations

import pytest
import torch

import qrun.compiled_decode as compiled_decode
from qrun import LLM, SamplingParams
from qrun.convert.main import convert
from qrun.kernels.kv_quant import kv_group_size, quantize_kv_ref
from qrun.kernels.paged_attention import padded_decode_attention, paged_attention_ref

GREEDY = dict(temperature=0, ignore_eos=True)


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "int8", "int4"])
def test_padded_decode_attention_equals_the_paged_reference(cache):
    g = torch.Generator().manual_seed(0)
    block_size, heads, kv_heads, dim = 4, 6, 2, 64
    dtype = torch.bfloat16 if cache == "bfloat16" else torch.float32
    lens = [1, 9, 4, 13]
    k_cache, v_cache = (torch.randn(20, block_size, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    k_scales = v_scales = None
    if cache.startswith("int"):  # the same values, stored quantized
        bits = int(cache[3:])
        (k_cache, k_scales), (v_cache, v_scales) = (quantize_kv_ref(c, bits, kv_group_size(dim, bits))
                                                    for c in (k_cache, v_cache))
    # each sequence's blocks scattered over the pool; tables padded with block 0 to one width
    order = torch.randperm(20, generator=g).tolist()
    widths = [-(-n // block_size) for n in lens]
    tables = []
    for width in widths:
        tables.append(order[:width] + [0] * (max(widths) - width))
        order = order[width:]
    block_tables = torch.tensor(tables, dtype=torch.int32)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    q = torch.randn(len(lens), heads, dim, generator=g).to(dtype)
    query_start_loc = torch.arange(len(lens) + 1, dtype=torch.int32)
    expected = paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, 1, max(lens), 0.25,
                                   k_scales=k_scales, v_scales=v_scales)
    got = padded_decode_attention(q, k_cache, v_cache, block_tables, seq_lens, 0.25, k_scales, v_scales)
    # the same float32 computation over keys in another grouping: summation order only (bfloat16:
    # one rounding of the output)
    tolerance = 8e-3 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


needs_compiler = pytest.mark.skipif(not compiled_decode.has_cpp_compiler(),
                                    reason="torch.compile on the CPU needs a C++ compiler")


def tiny_prompts(n):
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (int(torch.randint(1, 40, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def compiled_engine(path, monkeypatch, **options):
    """An engine whose decode steps all run the compiled layer, compiled before it returns."""
    monkeypatch.setattr(compiled_decode, "MAX_DECODE_PADDING", float("inf"))
    llm = LLM(str(path), enforce_eager=False, **{"kv_cache_memory": 4_000_000, "max_num_seqs": 8, **options})
    llm.engine.runner.compiled.compile_now()
    return llm


@needs_compiler
@pytest.mark.parametrize("dtype, kv_cache_dtype", [("float32", "auto"), ("bfloat16", "auto"), ("float32", "int8"),
                                                   ("bfloat16", "int4")])
def test_compiled_decode_generates_the_eager_tokens(tiny_llama_dir, dtype, kv_cache_dtype, monkeypatch):
    prompts = tiny_prompts(6)
    params = [SamplingParams(max_tokens=4 + 5 * i, **GREEDY) for i in range(6)]
    options = dict(dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=4_000_000, max_num_seqs=8)
    eager = LLM(str(tiny_llama_dir), enforce_eager=True, **options)
    compiled = compiled_engine(tiny_llama_dir, monkeypatch, **options)
    layer = compiled.engine.runner.compiled.layer
    calls = []
    compiled.engine.runner.compiled.layer = lambda *args: calls.append(1) or layer(*args)
    expected = [out.outputs[0].token_ids for out in eager.generate(prompts, params, progress=False)]
    got = [out.outputs[0].token_ids for out in compiled.generate(prompts, params, progress=False)]
    assert layer is not None and calls  # decode steps ran compiled
    assert got == expected


@needs_compiler
def test_a_mixed_bit_model_decodes_compiled_with_the_eager_tokens(tiny_llama_dir, calib_file, tmp_path, monkeypatch):
    converted = tmp_path / "llama-q"
    convert(tiny_llama_dir, converted, bits=3.5, preset="fast", calib_rows=8, calib_len=64, calib=[calib_file])
    prompts = tiny_prompts(4)
    params = [SamplingParams(max_tokens=6 + 4 * i, **GREEDY) for i in range(4)]
    eager = LLM(str(converted), dtype="float32", enforce_eager=True, kv_cache_memory=4_000_000, max_num_seqs=8)
    compiled = compiled_engine(converted, monkeypatch, dtype="float32")
    layer = compiled.engine.runner.compiled.layer
    calls = []
    compiled.engine.runner.compiled.layer = lambda *args: calls.append(1) or layer(*args)
    expected = [out.outputs[0].token_ids for out in eager.generate(prompts, params, progress=False)]
    got = [out.outputs[0].token_ids for out in compiled.generate(prompts, params, progress=False)]
    assert layer is not None and calls
    assert got == expected


@needs_compiler
def test_an_engine_compiles_only_after_many_decode_steps(tiny_llama_dir, monkeypatch):
    monkeypatch.setattr(compiled_decode, "COMPILE_AFTER_DECODE_STEPS", 20)
    started = []
    monkeypatch.setattr(compiled_decode.CompiledDecode, "_compile", lambda self: started.append(self.decode_steps))
    llm = LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=False, kv_cache_memory=4_000_000)
    llm.generate(tiny_prompts(1), SamplingParams(max_tokens=15, **GREEDY), progress=False)
    assert started == []
    llm.generate(tiny_prompts(1), SamplingParams(max_tokens=15, **GREEDY), progress=False)
    assert started == [21]


@needs_compiler
def test_a_failing_compiled_step_falls_back_to_eager(tiny_llama_dir, monkeypatch):
    def broken(*args):
        raise RuntimeError("no C++ compiler after all")

    monkeypatch.setattr(compiled_decode.CompiledDecode, "_compile", lambda self: setattr(self, "layer", broken))
    prompts = tiny_prompts(3)
    params = SamplingParams(max_tokens=6, **GREEDY)
    eager = LLM(str(tiny_llama_dir), dtype="float32", enforce_eager=True, kv_cache_memory=4_000_000)
    compiled = compiled_engine(tiny_llama_dir, monkeypatch, dtype="float32")
    expected = [out.outputs[0].token_ids for out in eager.generate(prompts, params, progress=False)]
    assert [out.outputs[0].token_ids for out in compiled.generate(prompts, params, progress=False)] == expected
    assert compiled.engine.runner.compiled.layer is None
