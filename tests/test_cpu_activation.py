"""The C++ SiLU-gated activation against kernels/activation.py's reference: the same rounding steps
(the SiLU to the rows' dtype, then the product), its exp within a few float ulp of torch's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

import qrun.kernels as kernels
from qrun.kernels import cpu_library
from qrun.kernels.activation import silu_and_mul_ref
from qrun.kernels.cpu_activation import silu_and_mul_cpu

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the C++ kernels need a C++ compiler")


# The kernel's e^x is 0 below -87 (e^-87 is near float32's smallest normal), so SiLU's products there
# (~1e-36) are 0 where torch keeps them: an absolute difference far below anything a layer resolves.
TINY = 1e-30


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 70), width=st.integers(1, 300), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       fused=st.booleans(), scale=st.sampled_from([0.1, 3.0, 30.0]), seed=st.integers(0, 2**16))
def test_cpu_silu_and_mul_matches_the_reference(rows, width, dtype, fused, scale, seed):
    """fused: gate and up are the halves of one gate/up projection's rows, as the model passes them."""
    gen = torch.Generator().manual_seed(seed)
    if fused:
        gate, up = (torch.randn(rows, 2 * width, generator=gen) * scale).to(dtype).chunk(2, dim=-1)
    else:
        gate, up = ((torch.randn(rows, width, generator=gen) * scale).to(dtype) for _ in range(2))
    got, expected = silu_and_mul_cpu(gate, up), silu_and_mul_ref(gate, up)
    assert got.dtype == dtype and got.shape == expected.shape and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=4e-6, atol=TINY)
    elif got.numel():  # a float SiLU a few ulp from a rounding boundary may round the other way: one step, rarely
        error = (got.float() - expected.float()).abs()
        assert (error <= expected.float().abs() * 2**-7 + TINY).all()
        assert (error > TINY).float().mean() <= 0.01


def test_cpu_silu_and_mul_keeps_the_reference_at_the_extremes():
    gate = torch.tensor([[0.0, -0.0, 1e-30, -1e-30, 88.0, -88.0, 1e4, -1e4, float("inf"), float("-inf"),
                          float("nan"), 3e38, -3e38]])
    up = torch.full_like(gate, 2.0)
    for dtype in (torch.float32, torch.bfloat16):
        g, u = gate.to(dtype), up.to(dtype)
        torch.testing.assert_close(silu_and_mul_cpu(g, u), silu_and_mul_ref(g, u), equal_nan=True, rtol=4e-6,
                                   atol=TINY)


def test_cpu_silu_and_mul_leaves_what_it_does_not_take_to_the_reference():
    gate, up = torch.randn(3, 8, dtype=torch.float16), torch.randn(3, 8, dtype=torch.float16)
    assert torch.equal(silu_and_mul_cpu(gate, up), silu_and_mul_ref(gate, up))
    gate = torch.randn(3, 8, requires_grad=True)  # the converter differentiates through the layers
    silu_and_mul_cpu(gate, torch.randn(3, 8)).sum().backward()
    assert gate.grad is not None


def test_cpu_silu_and_mul_names_what_it_cannot_take():
    with pytest.raises(RuntimeError, match=r"gate and up must be float32 or bfloat16 \[rows, width\]"):
        torch.ops.qrun.silu_and_mul(torch.randn(2, 8), torch.randn(2, 8, dtype=torch.bfloat16))


def test_the_cpu_table_runs_the_activation_kernel():
    assert kernels.ops_for(torch.device("cpu")).silu_and_mul is silu_and_mul_cpu
