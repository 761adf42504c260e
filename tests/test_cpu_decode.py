"""Decode steps through the C++ decoder layer (qrun/cpu_decode.py): bit for bit the torch layers'
result, for every linear path it covers, and the torch layers wherever it does not cover a model."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from qrun import LLM, SamplingParams
from qrun.convert.main import convert
from qrun.cpu_decode import DecodeLayers
from qrun.cpu_linear import bfloat16_only
from qrun.kernels import cpu_library, cpu_quant_matmul
from qrun.model import AttentionMetadata

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the C++ kernels need a C++ compiler")

GREEDY = dict(temperature=0, ignore_eos=True)


def engine(path, **options) -> LLM:
    return LLM(str(path), **{"kv_cache_memory": 4_000_000, "max_num_seqs": 8, **options})


def decode_step_both_ways(llm: LLM, batch: int, half_gemv: bool = True):
    """One decode step of `batch` sequences at different context lengths, through the torch layers
    and through the C++ ones: (hidden, cache) of each."""
    runner = llm.engine.runner
    model, cache, block_size = runner.model, runner.kv_cache, runner.block_size
    g = torch.Generator().manual_seed(batch)
    lengths = torch.randint(1, 3 * block_size, (batch,), generator=g).tolist()
    width = -(-max(lengths) // block_size)
    tables = [[1 + s * width + i for i in range(width)] for s in range(batch)]
    meta = AttentionMetadata.build([(n - 1, n) for n in lengths], tables, block_size)
    ids = torch.randint(0, model.config.vocab_size, (batch,), generator=g)
    positions = torch.tensor([n - 1 for n in lengths])
    with torch.inference_mode():
        for tensor in cache.tensors():  # earlier tokens' keys and values (and their scales)
            if tensor.dtype == torch.int8:
                tensor.random_(-127, 128, generator=g)
            elif tensor.dtype == torch.uint8:
                tensor.random_(0, 256, generator=g)
            elif tensor.dtype == torch.float16:
                tensor.uniform_(0.01, 0.1, generator=g)
            else:
                tensor.normal_(generator=g)
        results = []
        for layers in (None, runner.decode_layers.layers_forward(half_gemv)):
            hidden = model(ids, positions, meta, cache, layers)
            results.append((hidden, [t.clone() for t in cache.tensors()]))
    return results


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 2, 5])
def test_cpu_decode_layers_equal_the_torch_layers_bit_for_bit(tiny_llama64_dir, dtype, batch):
    """bfloat16 covers dense linears' float16 GEMV (up to two rows) and oneDNN (more)."""
    llm = engine(tiny_llama64_dir, dtype=dtype)
    assert llm.engine.runner.decode_layers is not None
    (torch_hidden, torch_cache), (cpp_hidden, cpp_cache) = decode_step_both_ways(llm, batch)
    assert torch.equal(cpp_hidden, torch_hidden)
    assert all(torch.equal(a, b) for a, b in zip(cpp_cache, torch_cache))


@functools.cache
def engine_kept_across_examples(path) -> LLM:
    return engine(path, dtype="bfloat16")


@settings(max_examples=8, deadline=None)
@example(batches=[5, 5, 2, 1, 1, 5])
@given(batches=st.lists(st.integers(1, 5), min_size=2, max_size=5))
def test_cpu_decode_layers_stay_exact_as_their_kept_buffers_change_size(tiny_llama64_dir, batches):
    """The stack keeps its buffers between steps (one engine across examples) and reallocates them
    when the rows change: a stale or shared buffer would show as a difference, and what a step
    returned stays as it was after the next."""
    llm = engine_kept_across_examples(tiny_llama64_dir)
    runner = llm.engine.runner
    kept = None
    for batch in batches:
        (torch_hidden, torch_cache), (cpp_hidden, cpp_cache) = decode_step_both_ways(llm, batch)
        assert torch.equal(cpp_hidden, torch_hidden)
        assert all(torch.equal(a, b) for a, b in zip(cpp_cache, torch_cache))
        meta = AttentionMetadata.build([(3, 4)] * batch, [[1 + s] for s in range(batch)], runner.block_size)
        x = torch.randn(batch, runner.model.config.hidden_size, dtype=torch.bfloat16)
        with torch.inference_mode():
            outputs = runner.decode_layers.layers_forward()(x, torch.zeros_like(x), torch.full((batch,), 3), meta,
                                                            runner.kv_cache)
        if kept is not None:
            assert all(torch.equal(t, copy) for t, copy in kept)  # the last step's outputs, untouched
        kept = [(t, t.clone()) for t in outputs]


def test_cpu_decode_layers_follow_bfloat16_only(tiny_llama64_dir):
    """The rerun of a step whose float16 GEMV overflowed: bfloat16 matmuls at one row too."""
    llm = engine(tiny_llama64_dir, dtype="bfloat16")
    with bfloat16_only(llm.engine.runner.model):
        (torch_hidden, _), (cpp_hidden, _) = decode_step_both_ways(llm, 1, half_gemv=False)
    assert torch.equal(cpp_hidden, torch_hidden)


@pytest.mark.skipif(not cpu_quant_matmul.available(), reason="the 4-bit C++ matmul needs AVX512-VNNI")
@pytest.mark.parametrize("batch, tile_rows, tile_dequantize_rows, dequantize_rows",
                         [(1, 0, 0, 0), (5, 0, 0, 0), (5, 4, 0, 0), (5, 4, 4, 0), (5, 0, 0, 4)])
def test_cpu_decode_layers_run_a_mixed_bit_model_as_the_torch_layers(tiny_llama64_dir, calib_file, tmp_path,
                                                                     monkeypatch, batch, tile_rows,
                                                                     tile_dequantize_rows, dequantize_rows):
    """Rotated inputs (shared and per linear), act-order permutations, 5-8-bit groups' high digits;
    and on AMX CPUs the tile kernel (codes or weights mode) or oneDNN on the dequantized weights, by
    the rows (forced here)."""
    if tile_rows and not cpu_quant_matmul.tile_rows():
        pytest.skip("no AMX kernel on this machine")
    monkeypatch.setattr(cpu_quant_matmul, "tile_rows", lambda: tile_rows)
    monkeypatch.setattr(cpu_quant_matmul, "tile_dequantize_rows", lambda group, high_plane: tile_dequantize_rows)
    monkeypatch.setattr(cpu_quant_matmul, "dequantize_rows", lambda: dequantize_rows)
    converted = tmp_path / "llama-q"
    convert(tiny_llama64_dir, converted, bits=5.0, preset="fast", calib_rows=8, calib_len=64, calib=[calib_file])
    llm = engine(converted, dtype="bfloat16")
    assert llm.engine.runner.decode_layers is not None
    (torch_hidden, torch_cache), (cpp_hidden, cpp_cache) = decode_step_both_ways(llm, batch)
    assert torch.equal(cpp_hidden, torch_hidden)
    assert all(torch.equal(a, b) for a, b in zip(cpp_cache, torch_cache))


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("batch", [1, 5])
def test_cpu_decode_layers_store_and_read_a_quantized_cache_as_the_torch_layers(tiny_llama64_dir, kv_cache_dtype,
                                                                                 dtype, batch):
    """Keys centred and rotated, K and V quantized into the cache (same bytes, same scales)."""
    llm = engine(tiny_llama64_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype)
    assert llm.engine.runner.decode_layers is not None
    assert llm.engine.runner.kv_cache.layers[0].k_mean is not None
    (torch_hidden, torch_cache), (cpp_hidden, cpp_cache) = decode_step_both_ways(llm, batch)
    assert torch.equal(cpp_hidden, torch_hidden)
    assert all(torch.equal(a, b) for a, b in zip(cpp_cache, torch_cache))


def test_heads_without_a_cpp_attention_keep_the_torch_layers(tiny_llama_dir):
    assert engine(tiny_llama_dir).engine.runner.decode_layers is None  # heads of 16


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int4"])
def test_an_engine_on_cpu_decode_layers_generates_the_torch_layers_tokens(tiny_llama64_dir, monkeypatch,
                                                                          kv_cache_dtype):
    """Prefill, chunked prefill and decode steps interleaved over many sequences."""
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (int(n),), generator=g).tolist() for n in torch.randint(1, 60, (7,), generator=g)]
    params = [SamplingParams(max_tokens=3 + 4 * i, **GREEDY) for i in range(7)]
    options = dict(dtype="bfloat16", max_num_batched_tokens=64, kv_cache_dtype=kv_cache_dtype)
    cpp = engine(tiny_llama64_dir, **options)
    got = [out.outputs[0].token_ids for out in cpp.generate(prompts, params, progress=False)]
    monkeypatch.setattr(DecodeLayers, "build", classmethod(lambda cls, model, kv_cache: None))
    expected = [out.outputs[0].token_ids for out in engine(tiny_llama64_dir, **options).generate(
        prompts, params, progress=False)]
    assert got == expected
