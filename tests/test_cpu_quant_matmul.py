"""The 4-bit matmuls (kernels/cpu_quant_matmul.cpp, VNNI; cpu_quant_matmul_amx.cpp, AMX) against
their torch reference: packing is lossless, the product is the reference's within the input
rounding, each kernel computes a row as if it were alone (batched = sequential), and the op picks
its kernel by the rows."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings, strategies as st

from qrun.kernels import cpu_quant_matmul as cqm
from qrun.kernels.read_streams import DEFAULT_READ_STREAMS, READ_STREAMS

pytestmark = pytest.mark.skipif(not cqm.available(), reason="no AVX512-VNNI kernel on this machine")
needs_tiles = pytest.mark.skipif(not cqm.tile_rows(), reason="no AMX kernel on this machine")


def op(x, low, group, n, high, k_high, digits=1, tile_rows=0, dequantize_rows=0, tile_dequantize_rows=0,
       read_streams=DEFAULT_READ_STREAMS):
    """The op with its kernel chosen here rather than by the machine."""
    return torch.ops.qrun.quant_matmul(x, *low, group, n, *high, k_high, digits, tile_rows, tile_dequantize_rows,
                                       dequantize_rows, read_streams)


@st.composite
def weights(draw):
    group = 32 * draw(st.integers(1, 4))
    k = group * draw(st.integers(1, 4))
    n = 16 * draw(st.integers(1, 24))  # from 8 tiles each thread reads some side by side at one or two rows
    k_high = group * draw(st.integers(0, k // group))
    seed = draw(st.integers(0, 2**31 - 1))
    bits = draw(st.tuples(st.integers(1, 4), st.integers(1, 4)))  # the codes' widths: each plane's storage
    return n, k, group, k_high, seed, bits


def planes(n: int, k: int, group: int, k_high: int, seed: int, bits=(4, 4), high_scale: float = 16.0):
    """A low plane over k inputs and a high one over the first k_high: the upper digits of wide codes, whose scales
    are `high_scale` (16: as packed) times the low digits'. bits: the (low, high) codes' widths, 1-4."""
    g = torch.Generator().manual_seed(seed)

    def plane(scales, width):
        codes = torch.randint(0, 2**width, scales.shape[:1] + (scales.shape[1] * group,), generator=g)
        return cqm.pack(codes, scales, torch.randn(scales.shape, generator=g) * 0.1)

    scales = (torch.rand(n, k // group, generator=g) * 0.1 + 0.01).half().float()
    high = plane(high_scale * scales[:, :k_high // group], bits[1]) if k_high else (None,) * 4
    return plane(scales, bits[0]), high


def problem(shape, rows: int):
    """The planes of `shape` and `rows` bfloat16 inputs for them."""
    n, k, group, k_high, seed, bits = shape
    low, high = planes(n, k, group, k_high, seed, bits)
    return low, high, torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)


@settings(max_examples=40, deadline=None)
@given(weights(), st.integers(1, 20), st.sampled_from([1, 2]))
def test_kernel_matches_the_reference_within_its_input_rounding(shape, rows, digits):
    n, k, group, k_high, seed, bits = shape
    low, high = planes(n, k, group, k_high, seed, bits)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed))
    got = cqm.quant_matmul(x, *low, group, n, *high, k_high, digits)
    ref = cqm.quant_matmul_ref(x, *low, group, n, *high, k_high, digits)
    assert got.shape == (rows, n) and got.dtype == x.dtype
    assert ((got - ref).norm() / ref.norm()) < (3e-2 if digits == 1 else 1e-4)


@pytest.mark.parametrize("high_bits", [1, 2, 3, 4])
@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("digits", [1, 2])
def test_the_largest_codes_times_the_largest_inputs_do_not_overflow(high_bits, sign, digits):
    """Every code at its top (15 below 2^high_bits - 1 above) and every input at the largest digit, one sign: the
    kernel's integer sums at their widest (AVX2 multiplies codes up to 6 bits whole in int16)."""
    n, k, group = 32, 192, 96
    scales = torch.full((n, k // group), 0.01).half().float()
    zeros = torch.zeros(n, k // group)

    def plane(top, plane_scales):
        return cqm.pack(torch.full((n, k), top), plane_scales, zeros)

    low, high = plane(15, scales), plane(2**high_bits - 1, 16 * scales)
    for rows in (1, 2, 3, 5):
        x = torch.full((rows, k), sign)
        got = cqm.quant_matmul(x, *low, group, n, *high, k, digits)
        ref = cqm.quant_matmul_ref(x, *low, group, n, *high, k, digits)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tile_rows, tile_dequantize_rows", [(0, 0), pytest.param(1, 0, marks=needs_tiles),
                                                               pytest.param(1, 1, marks=needs_tiles)],
                         ids=["vnni", "amx-codes", "amx-weights"])
@settings(max_examples=20, deadline=None)
@example(shape=(64, 512, 128, 128, 1, (4, 4)), rows=40, digits=2)  # 20,480 inputs: quantized by both threads
@example(shape=(32, 512, 128, 128, 2, (3, 2)), rows=140, digits=1)  # past 126 rows: more than one block of rows
@given(weights(), st.integers(2, 70), st.sampled_from([1, 2]))
def test_each_kernel_computes_a_row_as_if_alone(tile_rows, tile_dequantize_rows, shape, rows, digits):
    """VNNI: rows in groups of 6 (4 with two digits), in blocks of 64 KB of inputs; AMX: rows 1-16, 17-32 and a
    zero-padded copy of those past the last 32. From 16,384 inputs the rows are quantized on every thread."""
    n, k, group, k_high = shape[:4]
    low, high, x = problem(shape, rows)
    kernel = dict(digits=digits, tile_rows=tile_rows, tile_dequantize_rows=tile_dequantize_rows)
    batched = op(x, low, group, n, high, k_high, **kernel)
    for i in range(rows):
        assert torch.equal(batched[i:i + 1], op(x[i:i + 1], low, group, n, high, k_high, **kernel))


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("digits", [1, 2])
def test_a_row_with_a_non_finite_input_gives_non_finite_outputs_and_leaves_the_others(poison, digits):
    low, high, x = problem((48, 256, 64, 64, 5, (4, 4)), 5)
    x = x.float()
    x[2, 70] = poison
    got = op(x, low, 64, 48, high, 64, digits=digits)
    assert not got[2].isfinite().any()
    clean = torch.cat([x[:2], x[3:]])
    assert torch.equal(torch.cat([got[:2], got[3:]]), op(clean, low, 64, 48, high, 64, digits=digits))


@needs_tiles
@settings(max_examples=40, deadline=None)
@given(weights(), st.integers(1, 70))
def test_tile_kernel_matches_the_reference_within_bfloat16_output_rounding(shape, rows):
    """x enters the tiles unrounded and the codes exactly: only float32 sums and the output's rounding."""
    n, k, group, k_high = shape[:4]
    low, high, x = problem(shape, rows)
    got = op(x, low, group, n, high, k_high, tile_rows=1)
    ref = cqm.quant_matmul_ref(x.float(), *low, group, n, *high, k_high, 1)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), ref, rtol=2**-8, atol=1e-5 * ref.abs().max().item())


@needs_tiles
@settings(max_examples=40, deadline=None)
@given(weights(), st.integers(1, 70))
def test_tile_kernel_in_weights_mode_multiplies_the_dequantized_weight(shape, rows):
    """Weights mode multiplies dequantize_planes' bfloat16 weight (both planes summed, rounded once) in float32 sums;
    only the output's bfloat16 rounding and the sums' float32 rounding separate it from that product."""
    n, k, group, k_high = shape[:4]
    low, high, x = problem(shape, rows)
    got = op(x, low, group, n, high, k_high, tile_rows=1, tile_dequantize_rows=1).double()
    weight = cqm.dequantize_planes(*low, group, n, *high, k_high).double()
    ref = x.double() @ weight.T
    magnitude = x.double().abs() @ weight.abs().T
    assert ((got - ref).abs() <= 2**-8 * ref.abs() + 1e-5 * magnitude + 1e-6).all()


@settings(deadline=None)
@given(weights())
def test_pack_then_unpack_gives_the_weight(shape):
    n, k, group, _, seed, (bits, _) = shape
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (n, k), generator=g)
    scales, zeros = torch.rand(n, k // group, generator=g), torch.randn(n, k // group, generator=g)
    packed = cqm.pack(codes, scales, zeros)
    assert packed[0].numel() == n * k * cqm.code_bits(codes) // 8  # each code in as few bits as the largest needs
    unpacked = cqm.unpack(*packed, group, n)
    centers = packed[3][::group // 32].float()  # each group's codes centred, its zero moved to match: as packed
    centred_zeros = (zeros + (centers - 8) * scales).half().float()
    expected = (codes.float().view(n, -1, group) - centers[:, None]) * scales.half().float()[..., None]
    torch.testing.assert_close(unpacked, (expected + centred_zeros[..., None]).view(n, k), rtol=1e-6, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(weights(), st.integers(1, 2), st.sampled_from([1, 2]))
def test_every_read_stream_count_gives_the_same_product(shape, rows, digits):
    """Streams only reorder which tiles a thread reads when; each channel's sums are the same."""
    low, high, x = problem(shape, rows)
    n, k, group, k_high = shape[:4]
    products = [op(x, low, group, n, high, k_high, digits, read_streams=streams) for streams in READ_STREAMS]
    assert all(torch.equal(product, products[0]) for product in products[1:])


def test_a_high_plane_that_is_not_the_upper_digits_is_refused_by_name():
    """The VNNI kernel multiplies both digits as one 8-bit code at the low plane's scale."""
    n, k, group = 32, 64, 32
    low, high = planes(n, k, group, 32, 0, high_scale=15.0)
    with pytest.raises(RuntimeError, match="high plane's scales must be 16x the low plane's"):
        op(torch.randn(2, k).to(torch.bfloat16), low, group, n, high, 32)


def test_a_read_stream_count_the_kernel_lacks_is_rejected_naming_the_choices():
    low, high, x = problem((32, 64, 32, 0, 0, (4, 4)), 1)
    with pytest.raises(RuntimeError, match="read_streams must be 1, 2 or 4"):
        op(x, low, 32, 32, high, 0, read_streams=3)


def test_a_weight_of_the_wrong_shape_is_rejected_with_its_shapes():
    low, _ = planes(32, 64, 32, 0, 0)
    with pytest.raises(RuntimeError, match=r"x \[2, 128\] does not match the packed \[32, 64\] weight"):
        cqm.quant_matmul(torch.randn(2, 128), *low, 32, 32, None, None, None, None, 0, 1)


def test_planes_whose_codes_fit_no_width_are_rejected_naming_the_shape():
    """A plane's code width follows from its codes' size: one that gives no width of 1-4 bits is a bad pack."""
    codes, scales, zeros, centers = planes(32, 64, 32, 0, 0)[0]
    with pytest.raises(RuntimeError, match=r"packed weights do not match \[32, 64\] in groups of 32"):
        cqm.dequantize_planes(codes[:-1].contiguous(), scales, zeros, centers, 32, 32, None, None, None, None, 0)
    with pytest.raises(RuntimeError, match=r"packed weights do not match \[32, 64\] in groups of 32"):
        op(torch.randn(1, 64).to(torch.bfloat16), (torch.cat([codes, codes]), scales, zeros, centers), 32, 32,
           (None,) * 4, 0)


def test_layout_limits():
    assert cqm.takes(48, 96, 32) and cqm.takes(16, 192, 96)
    assert not cqm.takes(40, 96, 32)  # channels come in tiles of 16
    assert not cqm.takes(16, 96, 48)  # groups of whole 32-input blocks
    assert not cqm.takes(16, 96, 64)  # groups tile K


def test_bfloat16_inputs_give_the_float_result_rounded_as_torch_rounds():
    low, high = planes(48, 96, 32, 0, 3)
    x = torch.randn(5, 96).to(torch.bfloat16)
    got = op(x, low, 32, 48, high, 0)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, op(x.float(), low, 32, 48, high, 0).to(torch.bfloat16))


@settings(max_examples=20, deadline=None)
@given(weights())
def test_dequantize_planes_gives_the_unpacked_weight_rounded_once(shape):
    n, k, group, k_high, seed, bits = shape
    low, high = planes(n, k, group, k_high, seed, bits)
    expected = cqm.unpack(*low, group, n)
    if k_high:
        expected[:, :k_high] += cqm.unpack(*high, group, n)
    assert torch.equal(cqm.dequantize_planes(*low, group, n, *high, k_high), expected.to(torch.bfloat16))


@needs_tiles
def test_the_op_picks_its_kernel_by_the_rows(monkeypatch):
    """bfloat16 rows: the VNNI kernel, from tile_rows() rows on the AMX kernel (in weights mode from
    tile_dequantize_rows()), from dequantize_rows()
    on oneDNN with the dequantized weight; float32 rows: the VNNI kernel (thresholds forced here)."""
    monkeypatch.setattr(cqm, "tile_rows", lambda: 2)
    monkeypatch.setattr(cqm, "dequantize_rows", lambda: 4)
    low, high = planes(32, 128, 64, 64, 3)
    x = torch.randn(5, 128).to(torch.bfloat16)
    assert torch.equal(cqm.quant_matmul(x[:1], *low, 64, 32, *high, 64, 1), op(x[:1], low, 64, 32, high, 64))
    assert torch.equal(cqm.quant_matmul(x[:3], *low, 64, 32, *high, 64, 1),
                       op(x[:3], low, 64, 32, high, 64, tile_rows=1))
    monkeypatch.setattr(cqm, "tile_dequantize_rows", lambda group, high_plane: 3)
    assert torch.equal(cqm.quant_matmul(x[:3], *low, 64, 32, *high, 64, 1),
                       op(x[:3], low, 64, 32, high, 64, tile_rows=1, tile_dequantize_rows=1))
    assert not torch.equal(op(x[:3], low, 64, 32, high, 64, tile_rows=1),
                           op(x[:3], low, 64, 32, high, 64, tile_rows=1, tile_dequantize_rows=1))
    weight = cqm.dequantize_planes(*low, 64, 32, *high, 64)
    assert torch.equal(cqm.quant_matmul(x, *low, 64, 32, *high, 64, 1), torch.nn.functional.linear(x, weight))
    assert torch.equal(cqm.quant_matmul(x.float(), *low, 64, 32, *high, 64, 1), op(x.float(), low, 64, 32, high, 64))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 40), st.integers(1, 200), st.integers(0, 300), st.sampled_from([torch.float32, torch.bfloat16]),
       st.integers(0, 2**16))
def test_gather_columns_equals_index_select(rows, k, columns, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k + 3, generator=g).to(dtype)[:, :k]  # rows k + 3 apart
    index = torch.randint(0, k, (columns,), generator=g)
    assert torch.equal(cqm.gather_columns(x, index), cqm.gather_columns_ref(x, index))


def test_gather_columns_rejects_an_index_outside_the_columns():
    with pytest.raises(RuntimeError, match=r"index values from 0 to 8 are not columns of a \[2, 8\] x"):
        cqm.gather_columns(torch.randn(2, 8), torch.tensor([0, 8]))
