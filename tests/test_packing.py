"""Packing of mixed-bit weights: round trips, the documented bit layout, and the reference matmul."""

from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

from qrun.format import (BIT_WIDTHS, MatrixLayout, dequantize_groups, pack_matrix,
                                  pack_run, unpack_matrix)
from qrun.kernels import dequant_matmul
from qrun.kernels.dequant_matmul import (MIN_LEVELS, SCALE_LEVELS, dequant_matmul_ref, dequantize_ref, group_values,
                                         unpack_rows)


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from(BIT_WIDTHS), chunks=st.integers(1, 4), n=st.integers(1, 9), seed=st.integers(0, 2**31))
def test_pack_unpack_round_trips_for_every_width(bits, chunks, n, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (chunks * 32, n), generator=g)
    words = pack_run(q, bits)
    assert words.dtype == torch.int32 and words.shape == (chunks * bits, n)
    assert torch.equal(unpack_rows(words, bits), q)


@settings(max_examples=30, deadline=None)
@given(bits=st.sampled_from(BIT_WIDTHS), chunks=st.integers(2, 7), n=st.integers(1, 9), per_slice=st.integers(1, 3),
       seed=st.integers(0, 2**31))
def test_unpacking_in_slices_gives_every_chunk_once(bits, chunks, n, per_slice, seed):
    q = torch.randint(0, 1 << bits, (chunks * 32, n), generator=torch.Generator().manual_seed(seed))
    with mock.patch.object(dequant_matmul, "UNPACK_SLICE_CODES", per_slice * 32 * n):  # slices of 1-3 chunks
        codes = unpack_rows(pack_run(q, bits), bits)
    assert codes.dtype == torch.uint8 and torch.equal(codes, q)


@settings(max_examples=40, deadline=None)
@given(group_size=st.sampled_from([32, 64, 96, 128]), groups=st.integers(1, 5), n=st.integers(1, 7),
       widths=st.lists(st.sampled_from(BIT_WIDTHS), min_size=5, max_size=5), asym=st.booleans(),
       seed=st.integers(0, 2**31))
def test_mixed_width_matrix_round_trips_and_reference_matmul_agrees(group_size, groups, n, widths, asym, seed):
    gen = torch.Generator().manual_seed(seed)
    bits = tuple(sorted(widths[:groups], reverse=True))
    layout = MatrixLayout(group_size * groups, n, group_size, bits, asym)
    q = torch.cat([torch.randint(0, 1 << b, (group_size, n), generator=gen) for b in bits])
    qweight = pack_matrix(q, layout)
    assert qweight.shape == (layout.qweight_rows, n)
    assert torch.equal(unpack_matrix(qweight, layout), q)
    scales = torch.randint(1, SCALE_LEVELS + 1, (groups, n), generator=gen).to(torch.uint8)
    scale_max = (torch.rand(n, generator=gen) + 0.1).half()
    mins = torch.randint(-MIN_LEVELS, MIN_LEVELS + 1, (groups, n), generator=gen).to(torch.int8) if asym else None
    min_absmax = (torch.rand(n, generator=gen) + 0.1).half() if asym else None
    w = dequantize_groups(q, torch.tensor(bits), group_size, group_values(scales, scale_max, SCALE_LEVELS),
                          None if mins is None else group_values(mins, min_absmax, MIN_LEVELS))
    packed = (qweight, layout.qgroups(), scales, scale_max, mins, min_absmax)
    assert torch.equal(dequantize_ref(*packed, group_size), w)
    perm = torch.randperm(layout.in_features, generator=gen).to(layout.perm_dtype)
    x = torch.randn(3, layout.in_features, generator=gen)
    dense = torch.empty(n, layout.in_features)
    dense[:, perm.long()] = w.T  # original column perm[i] holds permuted row i
    y = dequant_matmul_ref(x, *packed, perm, group_size)
    # float32 sums of large 8-bit terms cancel: the tolerance follows the terms' size, not the result's
    atol = 1e-6 * (x.abs() @ dense.abs().T).max().item()
    torch.testing.assert_close(y, x @ dense.T, rtol=1e-4, atol=atol)


def test_four_bit_layout_is_nibbles_in_row_order():
    q = torch.arange(32).remainder(16).reshape(32, 1)
    words = pack_run(q, 4)
    assert words[0, 0].item() == 0x76543210
    assert (words[1, 0].item() & 0xFFFFFFFF) == 0xFEDCBA98


def test_three_bit_value_straddling_words_is_split_low_bits_first():
    q = torch.zeros(32, 1, dtype=torch.int64)
    q[10] = 0b101  # bit offset 30: low two bits end word 0, the high bit starts word 1
    words = pack_run(q, 3)
    assert (words[0, 0].item() & 0xFFFFFFFF) == 0b01 << 30
    assert words[1, 0].item() == 0b1


def test_storage_bits_counts_every_tensor():
    layout = MatrixLayout(576, 1536, 32, (4,) * 18, True)
    # codes: 4-bit weights, 8-bit scale and min per group; float16 scale_max and min_absmax per column
    expected = 576 * 1536 * 4 + 2 * 18 * 1536 * 8 + 2 * 1536 * 16 + 18 * 2 * 32 + 576 * 16
    assert layout.storage_bits() == expected
    assert layout.bpw() == pytest.approx(4.5 + 32 / 576, abs=0.02)


def test_layout_rejects_impossible_groupings():
    with pytest.raises(ValueError):
        MatrixLayout(576, 8, 128, (4,) * 4, False)
    with pytest.raises(ValueError):
        MatrixLayout(64, 8, 32, (7, 4), False)
    with pytest.raises(ValueError):
        pack_run(torch.full((32, 1), 8), 3)
