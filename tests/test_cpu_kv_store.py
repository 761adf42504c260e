"""The C++ store into a quantized KV cache writes kernels/cache_ops.py's reference bytes and scales."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import qrun.kernels as kernels
from qrun.kernels import cpu_library
from qrun.kernels.cache_ops import store_kv_ref
from qrun.kernels.cpu_kv_store import store_kv_cpu
from qrun.kernels.kv_quant import kv_group_size, storage_dtype

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the C++ kernels need a C++ compiler")


def empty_cache(blocks: int, block_size: int, heads: int, dim: int, bits: int) -> list[torch.Tensor]:
    group = kv_group_size(dim, bits)
    data = torch.zeros(blocks, block_size, heads, dim * bits // 8, dtype=storage_dtype(bits))
    scales = torch.zeros(blocks, block_size, heads, dim // group, 2, dtype=torch.float16)
    return [data, data.clone(), scales, scales.clone()]


@settings(max_examples=40, deadline=None)
@given(bits=st.sampled_from([8, 4]), dim=st.sampled_from([32, 64, 80, 128]), heads=st.integers(1, 4),
       tokens=st.integers(1, 20), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       scale=st.sampled_from([1e-6, 1.0, 1e5]), seed=st.integers(0, 2**16))
def test_cpu_kv_store_writes_the_references_bytes(bits, dim, heads, tokens, dtype, scale, seed):
    """Tiny groups (a step of 2^-24), values past float16's range (clamped), equal values."""
    gen = torch.Generator().manual_seed(seed)
    k = (torch.randn(tokens, heads, dim, generator=gen) * scale).to(dtype)
    v = (torch.randn(tokens, heads, dim, generator=gen) * scale).to(dtype)
    v[0, 0] = 1.5  # a group of one value
    slots = torch.randperm(4 * 8, generator=gen)[:tokens]
    expected, got = empty_cache(4, 8, heads, dim, bits), empty_cache(4, 8, heads, dim, bits)
    store_kv_ref(k, v, expected[0], expected[1], slots, expected[2], expected[3])
    store_kv_cpu(k, v, got[0], got[1], slots, got[2], got[3])
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_cpu_kv_store_leaves_float_caches_to_the_reference():
    k, v = torch.randn(3, 2, 64), torch.randn(3, 2, 64)
    cache, expected = torch.zeros(2, 4, 2, 64), torch.zeros(2, 4, 2, 64)
    store_kv_cpu(k, v, cache, cache.clone(), torch.tensor([0, 5, 7]))
    store_kv_ref(k, v, expected, expected.clone(), torch.tensor([0, 5, 7]))
    assert torch.equal(cache, expected)


def test_cpu_kv_store_names_a_cache_it_cannot_fill():
    data, _, scales, _ = empty_cache(2, 4, 2, 64, 8)
    with pytest.raises(RuntimeError, match="not an int8/int4 cache"):
        torch.ops.qrun.store_kv_quantized(torch.randn(1, 2, 64), torch.randn(1, 2, 64), data, data.clone(),
                                          torch.tensor([0]), scales.float(), scales.float())


def test_the_cpu_table_stores_through_the_kernel(monkeypatch):
    monkeypatch.delenv("QRUN_KERNELS", raising=False)
    assert kernels.ops_for(torch.device("cpu")).store_kv is store_kv_cpu
