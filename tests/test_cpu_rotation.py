"""The C++ rotation, its inverse and the per-head reflection equal kernels/rotation.py's to float32 rounding,
whatever the shape."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from qrun.kernels import cpu_library
from qrun.kernels.cpu_rotation import reflect_cpu, rotate_cpu, unrotate_cpu
from qrun.kernels.rotation import random_signs, reflect, rotate, rotation_factors, unrotate

pytestmark = pytest.mark.skipif(not cpu_library.available(), reason="the C++ kernels need a C++ compiler")


@settings(max_examples=40, deadline=None)
@given(odd=st.sampled_from([1, 3, 5, 9]), power=st.integers(0, 9), rows=st.integers(1, 40),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), padding=st.sampled_from([0, 7]),
       seed=st.integers(0, 2**16), inverse=st.booleans())
def test_cpu_rotation_matches_the_reference(odd, power, rows, dtype, padding, seed, inverse):
    k = odd << power
    signs = random_signs(k, seed=seed).float()
    wide = torch.randn(rows, k + padding, generator=torch.Generator().manual_seed(seed)).to(dtype)
    x = wide[:, :k]  # rows further apart than k: the kernel reads them in place
    reference, kernel = (unrotate, unrotate_cpu) if inverse else (rotate, rotate_cpu)
    expected = reference(x.float(), signs)  # in float32, rounded once below, as both round
    got = kernel(x, signs, rotation_factors(k, x.device))
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:  # one bfloat16 rounding step at most, where float32 sums differ in the last bits
        torch.testing.assert_close(got.float(), expected, rtol=2 ** -7, atol=1e-5)


def test_cpu_rotation_keeps_leading_dimensions_and_unrotate_inverts_it():
    x = torch.randn(2, 3, 96)
    signs = random_signs(96).float()
    torch.testing.assert_close(rotate_cpu(x, signs), rotate(x, signs), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(unrotate_cpu(rotate_cpu(x, signs), signs), x, rtol=1e-5, atol=1e-5)


def test_cpu_rotation_names_an_input_size_it_cannot_split():
    x = torch.randn(2, 576)
    with pytest.raises(RuntimeError, match="576 inputs are not 5 times a power of two"):
        torch.ops.qrun.rotate(x, random_signs(576).float(), torch.eye(5))


def _unit_vectors(kv_heads: int, dim: int, generator: torch.Generator) -> torch.Tensor:
    u = torch.randn(kv_heads, dim, generator=generator)
    return u / u.norm(dim=-1, keepdim=True)


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), kv_heads=st.integers(1, 4), group=st.sampled_from([1, 2, 3, 8]),
       dim=st.sampled_from([32, 64, 80, 128]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_cpu_reflection_matches_the_reference(rows, kv_heads, group, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, kv_heads * group, dim, generator=g).to(dtype)
    u = _unit_vectors(kv_heads, dim, g)
    got, expected = reflect_cpu(x, u), reflect(x.float(), u)
    assert got.dtype == dtype and got.shape == x.shape
    if dtype == torch.float32:
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(got.float(), expected, rtol=2 ** -7, atol=1e-5)


def test_reflection_is_its_own_inverse_and_keeps_each_query_key_product():
    g = torch.Generator().manual_seed(3)
    queries, keys = torch.randn(6, 8, 64, generator=g, dtype=torch.float64), torch.randn(6, 2, 64, generator=g,
                                                                                          dtype=torch.float64)
    u = _unit_vectors(2, 64, g).double()
    u = u / u.norm(dim=-1, keepdim=True)  # unit in float64 too
    for kernel in (reflect, reflect_cpu):
        x = queries.float()
        torch.testing.assert_close(kernel(kernel(x, u.float()), u.float()), x, rtol=1e-5, atol=1e-5)
    scores = torch.einsum("nhgd,mhd->nhgm", queries.unflatten(1, (2, 4)), keys)
    reflected = torch.einsum("nhgd,mhd->nhgm", reflect(queries, u).unflatten(1, (2, 4)), reflect(keys, u))
    torch.testing.assert_close(reflected, scores, rtol=1e-12, atol=1e-12)


def test_cpu_reflection_names_kv_heads_that_do_not_divide_the_heads():
    with pytest.raises(RuntimeError, match="kv_heads dividing 3 heads"):
        torch.ops.qrun.reflect(torch.randn(2, 3, 64), torch.randn(2, 64))
