"""The C++ float16 GEMV: as accurate as torch's (its reference) for every shape it takes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from qrun.kernels import cpu_library
from qrun.kernels.cpu_half_gemv import MAX_ROWS, half_gemv, half_gemv_ref
from qrun.kernels.read_streams import READ_STREAMS

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the C++ kernels need a C++ compiler")


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, MAX_ROWS), n=st.integers(1, 70), k=st.integers(1, 200),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_cpu_half_gemv_is_as_accurate_as_torch(rows, n, k, dtype, bias, seed):
    g = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=g) / k ** 0.5).half()
    b = torch.randn(n, generator=g).half() if bias else None
    x = torch.randn(rows, k, generator=g).to(dtype)
    got = half_gemv(x, weight, b)
    assert got.dtype == dtype and got.shape == (rows, n)
    exact = x.double() @ weight.double().T + (b.double() if bias else 0)
    reference_error = (half_gemv_ref(x, weight, b).double() - exact).abs().max().item()
    # inputs kept in float32 (the reference rounds them to float16) and one output rounding, not two
    assert (got.double() - exact).abs().max().item() <= reference_error + 1e-4


def test_cpu_half_gemv_reads_rows_in_place_and_leaves_more_rows_to_torch():
    weight = torch.randn(40, 32).half()
    wide = torch.randn(MAX_ROWS + 2, 48)
    x = wide[:, :32]  # rows 48 apart
    torch.testing.assert_close(half_gemv(x[:2], weight), x[:2] @ weight.float().T, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(half_gemv(x, weight), half_gemv_ref(x, weight), rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 2, 3, 6, 8])
def test_every_read_stream_count_gives_the_same_product(rows):
    """Past four rows the kernel reads at most two streams side by side, whatever the count asked."""
    g = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(203, 96, generator=g).half(), torch.randn(203, generator=g).half()
    x = torch.randn(rows, 96, generator=g).to(torch.bfloat16)
    products = [half_gemv(x, weight, bias, streams) for streams in READ_STREAMS]
    assert all(torch.equal(product, products[0]) for product in products)


def test_a_read_stream_count_the_gemv_lacks_is_rejected_naming_the_choices():
    with pytest.raises(RuntimeError, match="read_streams must be 1, 2 or 4, got 3"):
        half_gemv(torch.randn(1, 32), torch.randn(16, 32).half(), None, 3)
