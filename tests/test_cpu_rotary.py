"""The C++ rotary equals kernels/rotary.py's reference bit for bit: the same float32 arithmetic,
rounded once, read in place from the fused projection's strided views."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import qrun.kernels as kernels
from qrun.kernels import cpu_library
from qrun.kernels.cpu_rotary import apply_rotary_cpu
from qrun.kernels.rotary import apply_rotary_ref, rotary_cos_sin

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the C++ kernels need a C++ compiler")


def cos_sin_table(dim: int, positions: int = 3000) -> torch.Tensor:
    return rotary_cos_sin([10000 ** (-2 * i / dim) for i in range(dim // 2)], positions, "cpu")


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(0, 40), heads=st.integers(1, 9), kv_heads=st.integers(1, 4),
       dim=st.sampled_from([2, 8, 64, 80, 128]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       fused=st.booleans(), seed=st.integers(0, 2**16))
def test_cpu_rotary_equals_the_reference(tokens, heads, kv_heads, dim, dtype, fused, seed):
    """fused: q and k are views into one q/k/v projection's rows, as the model passes them."""
    gen = torch.Generator().manual_seed(seed)
    table = cos_sin_table(dim)
    if fused:
        qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=gen) * 3).to(dtype)
        q, k, _ = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
        q, k = q.unflatten(-1, (heads, dim)), k.unflatten(-1, (kv_heads, dim))
    else:
        q = (torch.randn(tokens, heads, dim, generator=gen) * 3).to(dtype)
        k = (torch.randn(tokens, kv_heads, dim, generator=gen) * 3).to(dtype)
    positions = torch.randint(0, table.shape[0], (tokens,), generator=gen)
    got, expected = apply_rotary_cpu(q, k, positions, table), apply_rotary_ref(q, k, positions, table)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and a.is_contiguous() and torch.equal(a, b)


def test_cpu_rotary_leaves_what_it_does_not_take_to_the_reference():
    table, positions = cos_sin_table(64), torch.tensor([3, 7])
    q, k = torch.randn(2, 4, 64, dtype=torch.float16), torch.randn(2, 2, 64, dtype=torch.float16)
    assert all(torch.equal(a, b) for a, b in zip(apply_rotary_cpu(q, k, positions, table),
                                                 apply_rotary_ref(q, k, positions, table)))
    q = torch.randn(2, 4, 64, requires_grad=True)  # the converter differentiates through the layers
    apply_rotary_cpu(q, torch.randn(2, 2, 64), positions, table)[0].sum().backward()
    assert q.grad is not None


def test_cpu_rotary_names_what_it_cannot_rotate():
    table, positions = cos_sin_table(64), torch.tensor([0, 1])
    with pytest.raises(RuntimeError, match=r"q and k must be float32 or bfloat16 \[2, heads, 64\]"):
        torch.ops.qrun.apply_rotary(torch.randn(2, 4, 32), torch.randn(2, 2, 64), positions, table)


def test_the_cpu_table_runs_the_kernel_and_the_torch_table_the_reference(monkeypatch):
    assert kernels.ops_for(torch.device("cpu")).apply_rotary is apply_rotary_cpu
    monkeypatch.setenv("QRUN_KERNELS", "torch")
    assert kernels.ops_for(torch.device("cpu")).apply_rotary is apply_rotary_ref
