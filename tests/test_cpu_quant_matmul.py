"""The VNNI int4 matmul (kernels/cpu_quant_matmul.cpp) against its torch reference: packing is
lossless, the product is the reference's within int8 input rounding, and each row's result does
not depend on the other rows (batched = sequential)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from qrun.kernels import cpu_quant_matmul as cqm

pytestmark = pytest.mark.skipif(not cqm.available(), reason="no AVX512-VNNI kernel on this machine")


@st.composite
def weights(draw):
    group = 32 * draw(st.integers(1, 4))
    k = group * draw(st.integers(1, 4))
    n = 16 * draw(st.integers(1, 4))
    k_high = group * draw(st.integers(0, k // group))
    seed = draw(st.integers(0, 2**31 - 1))
    return n, k, group, k_high, seed


def planes(n: int, k: int, group: int, k_high: int, seed: int):
    g = torch.Generator().manual_seed(seed)

    def plane(width):
        if width == 0:
            return None, None, None, None
        codes = torch.randint(0, 16, (n, width), generator=g)
        scales = torch.rand(n, width // group, generator=g) * 0.1 + 0.01
        return cqm.pack(codes, scales, torch.randn(n, width // group, generator=g) * 0.1)

    return plane(k), plane(k_high)


@settings(max_examples=40, deadline=None)
@given(weights(), st.integers(1, 20), st.sampled_from([1, 2]))
def test_kernel_matches_the_reference_within_its_input_rounding(shape, rows, digits):
    n, k, group, k_high, seed = shape
    low, high = planes(n, k, group, k_high, seed)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    got = cqm.quant_matmul(x, *low, group, n, *high, k_high, digits)
    ref = cqm.quant_matmul_ref(x, *low, group, n, *high, k_high, digits)
    assert got.shape == (rows, n) and got.dtype == x.dtype
    assert ((got - ref).norm() / ref.norm()) < (3e-2 if digits == 1 else 1e-4)


@settings(max_examples=20, deadline=None)
@given(weights(), st.integers(2, 20), st.sampled_from([1, 2]))
def test_each_row_is_computed_as_if_alone(shape, rows, digits):
    n, k, group, k_high, seed = shape
    low, high = planes(n, k, group, k_high, seed)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
    batched = cqm.quant_matmul(x, *low, group, n, *high, k_high, digits)
    for i in range(rows):
        assert torch.equal(batched[i:i + 1], cqm.quant_matmul(x[i:i + 1], *low, group, n, *high, k_high, digits))


@settings(deadline=None)
@given(weights())
def test_pack_then_unpack_gives_the_weight(shape):
    n, k, group, _, seed = shape
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 16, (n, k), generator=g)
    scales, zeros = torch.rand(n, k // group, generator=g), torch.randn(n, k // group, generator=g)
    expected = (codes.float() - 8).view(n, -1, group) * scales[..., None] + zeros[..., None]
    unpacked = cqm.unpack(*cqm.pack(codes, scales, zeros), group, n)
    torch.testing.assert_close(unpacked, expected.view(n, k), rtol=2e-3, atol=2e-3)  # float16 scales and zeros


def test_a_weight_of_the_wrong_shape_is_rejected_with_its_shapes():
    low, _ = planes(32, 64, 32, 0, 0)
    with pytest.raises(RuntimeError, match=r"\[32, 128\]"):
        cqm.quant_matmul(torch.randn(2, 128), *low, 32, 32, None, None, None, None, 0, 1)


def test_layout_limits():
    assert cqm.takes(48, 96, 32) and cqm.takes(16, 192, 96)
    assert not cqm.takes(40, 96, 32)  # channels come in tiles of 16
    assert not cqm.takes(16, 96, 48)  # groups of whole 32-input blocks
    assert not cqm.takes(16, 96, 64)  # groups tile K


def test_bfloat16_inputs_give_the_float_result_rounded_as_torch_rounds():
    low, _ = planes(48, 96, 32, 0, 3)
    x = torch.randn(5, 96).to(torch.bfloat16)
    got = cqm.quant_matmul(x, *low, 32, 48, None, None, None, None, 0, 1)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, cqm.quant_matmul(x.float(), *low, 32, 48, None, None, None, None, 0, 1).to(torch.bfloat16))


@settings(max_examples=20, deadline=None)
@given(weights())
def test_dequantize_planes_gives_the_unpacked_weight_rounded_once(shape):
    n, k, group, k_high, seed = shape
    low, high = planes(n, k, group, k_high, seed)
    expected = cqm.unpack(*low, group, n)
    if k_high:
        expected[:, :k_high] += cqm.unpack(*high, group, n)
    assert torch.equal(cqm.dequantize_planes(*low, group, n, *high, k_high), expected.to(torch.bfloat16))


def test_from_dequantize_rows_on_bfloat16_rows_multiply_the_dequantized_weight(monkeypatch):
    """The choice made on CPUs with AMX (oneDNN's bfloat16 matmul on the tile unit), forced here."""
    monkeypatch.setattr(cqm, "dequantize_rows", lambda: 4)
    low, high = planes(32, 128, 64, 64, 3)
    weight = cqm.dequantize_planes(*low, 64, 32, *high, 64)
    x = torch.randn(6, 128).to(torch.bfloat16)
    assert torch.equal(cqm.quant_matmul(x, *low, 64, 32, *high, 64, 1), torch.nn.functional.linear(x, weight))
    few = x[:3]  # fewer rows, or float32 rows: the kernel
    assert torch.equal(cqm.quant_matmul(few, *low, 64, 32, *high, 64, 1),
                       torch.ops.qrun.quant_matmul(few, *low, 64, 32, *high, 64, 1, 0))
    assert torch.equal(cqm.quant_matmul(x.float(), *low, 64, 32, *high, 64, 1),
                       torch.ops.qrun.quant_matmul(x.float(), *low, 64, 32, *high, 64, 1, 0))
