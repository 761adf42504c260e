"""The C++ paged attention (kernels/cpu_attention.py) against the torch reference, over
cache dtypes, GQA ratios, head dims, block sizes, context lengths and steps that mix decode
rows with prefill chunks; and the kernel table's choice of it."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

import qrun.kernels as kernels
from qrun.kernels import cpu_attention, cpu_library, cpu_norm
from qrun.kernels.kv_quant import kv_group_size, quantize_kv_ref
from qrun.kernels.paged_attention import paged_attention_ref

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the C++ kernels need a C++ compiler")

CACHES = ["float32", "bfloat16", "float16", "int8", "int4"]


def paged_step(cache: str, query_lens: list[int], context_lens: list[int], kv_heads: int, group: int, dim: int,
               block_size: int, seed: int = 0) -> tuple:
    """Arguments of a paged attention call: each sequence's blocks scattered over the pool, its
    context = cached tokens + this step's queries."""
    g = torch.Generator().manual_seed(seed)
    widths = [-(-n // block_size) for n in context_lens]
    pool = sum(widths) + 3
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(cache, torch.float32)
    k_cache, v_cache = (torch.randn(pool, block_size, kv_heads, dim, generator=g).to(dtype) for _ in range(2))
    k_scales = v_scales = None
    if cache.startswith("int"):  # the same values, stored quantized
        bits = int(cache[3:])
        (k_cache, k_scales), (v_cache, v_scales) = (quantize_kv_ref(c, bits, kv_group_size(dim, bits))
                                                    for c in (k_cache, v_cache))
    order = torch.randperm(pool, generator=g).tolist()
    tables = []
    for width in widths:
        tables.append(order[:width] + [0] * (max(widths) - width))
        order = order[width:]
    starts = [0]
    for n in query_lens:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], kv_heads * group, dim, generator=g).to(dtype)
    return (q, k_cache, v_cache, torch.tensor(tables, dtype=torch.int32), torch.tensor(context_lens, dtype=torch.int32),
            torch.tensor(starts, dtype=torch.int32), max(query_lens), max(context_lens), dim ** -0.5, None,
            k_scales, v_scales)


def assert_matches_reference(args: tuple) -> None:
    expected = paged_attention_ref(*args)
    got = cpu_attention.paged_attention_cpu(*args)
    # The same float32 math in another summation order; half-precision queries round the output once. A bfloat16
    # cache's prefill tile on CPUs with AVX512-BF16 also rounds the scaled queries and the softmax weights to bfloat16
    # (as a GPU's flash attention does): a sharp softmax over a few keys then moves an output by up to ~1e-2 (the
    # example below: -0.0894 where float64 gives -0.0990, as the same roundings in float64 give -0.0894).
    tolerance = {torch.float32: 1e-5, torch.float16: 8e-3, torch.bfloat16: 2e-2}[args[0].dtype]
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("dim", [64, 128])
def test_decode_rows_equal_the_reference(cache, dim):
    assert_matches_reference(paged_step(cache, [1] * 5, [1, 17, 64, 200, 33], kv_heads=2, group=3, dim=dim,
                                        block_size=16))


@pytest.mark.parametrize("cache", CACHES)
def test_rows_longer_than_a_chunk_merge_their_chunks_as_the_reference(cache):
    """A work item is up to 128 tokens of a sequence, 512 where it holds more than 128 a core (cpu_attention.cpp's
    chunk_tokens): longer ones merge their softmaxes."""
    assert_matches_reference(paged_step(cache, [1] * 7, [127, 128, 129, 300, 700, 1300, 5], kv_heads=3, group=3,
                                        dim=64, block_size=16))


@settings(max_examples=40, deadline=None)
@given(cache=st.sampled_from(CACHES), kv_heads=st.integers(1, 4), group=st.sampled_from([1, 2, 3, 4, 8]),
       dim=st.sampled_from(cpu_attention.HEAD_DIMS), block_size=st.sampled_from([1, 4, 16, 32]),
       sequences=st.lists(st.tuples(st.one_of(st.just(1), st.integers(2, 40)), st.integers(0, 150)), min_size=1,
                          max_size=6),
       seed=st.integers(0, 2**16))
@example(cache="bfloat16", kv_heads=1, group=3, dim=128, block_size=16,
         sequences=[(1, 32), (1, 80), (1, 128), (32, 97), (37, 140), (16, 1)], seed=91)
def test_any_mix_of_decode_rows_and_prefill_chunks_equals_the_reference(cache, kv_heads, group, dim, block_size,
                                                                         sequences, seed):
    """sequences: (query length, cached tokens before it) per sequence; query length 1 decodes."""
    query_lens = [n for n, _ in sequences]
    context_lens = [n + cached for n, cached in sequences]
    assert_matches_reference(paged_step(cache, query_lens, context_lens, kv_heads, group, dim, block_size, seed))


def test_a_head_dim_without_an_instantiation_runs_the_reference():
    args = paged_step("bfloat16", [1, 1], [5, 40], kv_heads=2, group=2, dim=48, block_size=16)
    assert 48 not in cpu_attention.HEAD_DIMS
    torch.testing.assert_close(cpu_attention.paged_attention_cpu(*args), paged_attention_ref(*args))


def test_out_receives_every_row():
    args = paged_step("float32", [1, 7, 1], [30, 7, 12], kv_heads=1, group=4, dim=64, block_size=8)
    out = torch.full_like(args[0], float("nan"))
    returned = cpu_attention.paged_attention_cpu(*args[:9], out, *args[10:])
    assert returned is out
    torch.testing.assert_close(out, paged_attention_ref(*args), rtol=1e-5, atol=1e-5)


def test_the_cpu_table_runs_the_kernel_by_default_and_the_references_on_request(monkeypatch):
    cpu = torch.device("cpu")
    monkeypatch.delenv("QRUN_KERNELS", raising=False)
    ops = kernels.ops_for(cpu)
    assert ops.paged_attention is cpu_attention.paged_attention_cpu
    assert ops.rms_norm is cpu_norm.rms_norm_cpu
    assert ops.dequant_matmul is kernels.IMPLEMENTATIONS["dequant_matmul"]["torch"]  # no C++ kernel: the reference
    monkeypatch.setenv("QRUN_KERNELS", "torch")
    assert kernels.ops_for(cpu).paged_attention is paged_attention_ref


def test_without_a_compiler_the_table_keeps_the_references(monkeypatch):
    monkeypatch.delenv("QRUN_KERNELS", raising=False)
    monkeypatch.setattr(cpu_library, "available", lambda: False)
    assert kernels.ops_for(torch.device("cpu")).paged_attention is paged_attention_ref
    monkeypatch.setenv("QRUN_KERNELS", "cpu")
    with pytest.raises(RuntimeError, match="did not build"):
        kernels.ops_for(torch.device("cpu"))


@pytest.mark.parametrize("cache", CACHES)
@pytest.mark.parametrize("group, dim", [(1, 64), (3, 64), (4, 128), (8, 80), (7, 256)])
def test_long_prefill_chunks_after_cached_context_equal_the_reference(cache, group, dim):
    """Chunks spanning several work items (cpu_attention.cpp's rows_per_item) and key tiles, some after cached
    tokens, beside decode rows."""
    assert_matches_reference(paged_step(cache, [100, 1, 37, 53], [100, 64, 37 + 150, 53 + 9], kv_heads=2, group=group,
                                        dim=dim, block_size=16))


@pytest.mark.parametrize("cache", ["float32", "bfloat16", "int4"])
def test_a_prompts_attention_is_the_same_bits_however_it_is_cut_into_chunks(cache):
    """Each query's keys pass in the same tiles from the sequence's first whatever the chunk: chunked prefill attends
    exactly as the whole prompt does (a chunk of one token is a decode row, the decode kernel's)."""
    length = 150
    whole = paged_step(cache, [length], [length], kv_heads=3, group=3, dim=64, block_size=16, seed=5)
    expected = cpu_attention.paged_attention_cpu(*whole)
    q, k_cache, v_cache, tables = whole[:4]
    for cut in (2, 16, 47, 100, 148):
        for begin, end in ((0, cut), (cut, length)):
            part = (q[begin:end], k_cache, v_cache, tables, torch.tensor([end], dtype=torch.int32),
                    torch.tensor([0, end - begin], dtype=torch.int32), end - begin, end, *whole[8:])
            assert torch.equal(cpu_attention.paged_attention_cpu(*part), expected[begin:end]), (cut, begin)


def scattered(tokens: torch.Tensor, block_size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [n, kv_heads, dim] as a paged cache of `block_size`-token blocks in random places, and its block table."""
    n = tokens.shape[0]
    width = -(-n // block_size)
    places = torch.randperm(width + 2, generator=torch.Generator().manual_seed(seed))[:width]
    cache = torch.zeros(width + 2, block_size, *tokens.shape[1:], dtype=tokens.dtype)
    padded = torch.cat([tokens, tokens.new_zeros(width * block_size - n, *tokens.shape[1:])])
    cache[places] = padded.view(width, block_size, *tokens.shape[1:])
    return cache, places.to(torch.int32)[None]


@pytest.mark.parametrize("cache", ["float32", "bfloat16"])
def test_a_steps_attention_is_the_same_bits_whatever_the_block_size(cache):
    """Keys pass in tiles of 16 from the sequence's first, read in place where a tile's keys are one block's (the
    AMX tile's keys) or gathered where blocks are smaller: the same bits either way, decode row and prefill chunk."""
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[cache]
    g = torch.Generator().manual_seed(3)
    length, queries = 83, 40
    keys, values = (torch.randn(length, 2, 64, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(queries + 1, 6, 64, generator=g).to(dtype)
    results = []
    for block_size in (1, 4, 16, 32):
        (k_cache, table), (v_cache, _) = scattered(keys, block_size, 7), scattered(values, block_size, 7)
        args = (q, k_cache, v_cache, table.repeat(2, 1), torch.tensor([length, length - 1], dtype=torch.int32),
                torch.tensor([0, queries, queries + 1], dtype=torch.int32), queries, length, 0.125, None, None, None)
        results.append(cpu_attention.paged_attention_cpu(*args))
    assert all(torch.equal(results[0], other) for other in results[1:])


@pytest.mark.parametrize("amx", [True, False])
def test_a_bfloat16_models_prefill_chunks_run_the_kernel_even_where_sdpa_has_amx(monkeypatch, amx):
    """torch's SDPA multiplies bfloat16 on AMX's tile unit, as the kernel does there, but its bits depend on where a
    prompt was cut into chunks (cpu_attention.py): every row runs the kernel, whatever the CPU."""
    monkeypatch.setattr(cpu_library, "has_amx", lambda: amx)
    seen = []
    real_sdpa = torch.nn.functional.scaled_dot_product_attention

    def sdpa(q, k, v, **kwargs):
        seen.append((q.dtype, k.dtype))
        return real_sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", sdpa)
    args = paged_step("bfloat16", [5, 1], [9, 20], kv_heads=2, group=2, dim=64, block_size=16)
    got = cpu_attention.paged_attention_cpu(*args)
    assert seen == []
    torch.testing.assert_close(got, paged_attention_ref(*args), rtol=8e-3, atol=8e-3)
