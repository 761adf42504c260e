"""The C++ RMSNorm equals kernels/norm.py's reference to rounding: its float32 sums run in another order."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from qrun.kernels import cpu_library
from qrun.kernels.cpu_norm import rms_norm_cpu
from qrun.kernels.norm import rms_norm_ref

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the C++ kernels need a C++ compiler")


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 70), hidden=st.integers(1, 1100), with_residual=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), scale=st.sampled_from([1e-3, 1.0, 300.0]),
       seed=st.integers(0, 2**16))
def test_cpu_rms_norm_matches_the_reference(rows, hidden, with_residual, dtype, scale, seed):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, hidden, generator=gen) * scale).to(dtype)
    residual = (torch.randn(rows, hidden, generator=gen) * scale).to(dtype) if with_residual else None
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(dtype)
    got, got_sum = rms_norm_cpu(x, weight, 1e-5, residual)
    expected, expected_sum = rms_norm_ref(x, weight, 1e-5, residual)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert torch.equal(got_sum, expected_sum)  # the add rounds as torch's
    if dtype == torch.bfloat16:  # float32 sums of squares in another order: one bfloat16 step at most, rarely
        torch.testing.assert_close(got.float(), expected.float(), rtol=2 ** -7, atol=0)
        assert (got != expected).sum() <= 0.01 * got.numel()
    else:
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-7)


def test_cpu_rms_norm_keeps_leading_dimensions_and_the_input():
    x, residual, weight = torch.randn(2, 3, 64), torch.randn(2, 3, 64), torch.rand(64)
    before = x.clone()
    got, summed = rms_norm_cpu(x, weight, 1e-6, residual)
    expected, expected_sum = rms_norm_ref(x, weight, 1e-6, residual)
    torch.testing.assert_close(got, expected)
    assert torch.equal(summed, expected_sum) and torch.equal(x, before)
    assert rms_norm_cpu(x, weight, 1e-6)[1] is x  # no residual: x is the new residual, as the reference's


def test_cpu_rms_norm_leaves_what_it_does_not_take_to_the_reference():
    x, weight = torch.randn(4, 32, dtype=torch.bfloat16), torch.rand(32)  # a float32 weight promotes the output
    assert rms_norm_cpu(x, weight, 1e-6)[0].dtype == torch.float32
    strided, weight = torch.randn(32, 4).T, torch.rand(32)
    assert torch.equal(rms_norm_cpu(strided, weight, 1e-6)[0], rms_norm_ref(strided, weight, 1e-6)[0])
    weight = torch.rand(32, requires_grad=True)
    x = torch.randn(4, 32, requires_grad=True)
    rms_norm_cpu(x, weight, 1e-6)[0].sum().backward()  # the converter differentiates through the norm
    assert x.grad is not None and weight.grad is not None


def test_cpu_rms_norm_names_a_mismatched_weight():
    with pytest.raises(RuntimeError, match=r"weight must be Float \[16\]"):
        torch.ops.qrun.rms_norm(torch.randn(2, 16), torch.randn(15), 1e-6)
