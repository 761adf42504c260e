"""The input rotation of incoherence processing: exact, invertible, and worth its bits."""

import pytest
import torch

from qrun.convert.gptq import Candidate, HessianAccumulator, gptq_quantize, output_error
from qrun.kernels.rotation import factor_sizes, pack_signs, random_signs, rotate, unpack_signs, unrotate


def dense_rotation(k: int, signs: torch.Tensor) -> torch.Tensor:
    return rotate(torch.eye(k, dtype=torch.float64), signs.double())


@pytest.mark.parametrize("k", [64, 96, 576, 896, 1536])
def test_rotation_is_orthogonal_with_flat_entries(k):
    r = dense_rotation(k, random_signs(k))
    torch.testing.assert_close(r @ r.T, torch.eye(k, dtype=torch.float64), rtol=0, atol=1e-12)
    assert r.abs().max() * k ** 0.5 < 1.5  # an outlier input is spread over all inputs
    assert all(s <= 64 for s in factor_sizes(k) if s & (s - 1) == 0)  # applied as small factors


def test_unrotate_inverts_rotate_and_matches_the_dense_matrix():
    k = 576
    signs = random_signs(k, seed=3)
    x = torch.randn(7, k, dtype=torch.float64)
    r = dense_rotation(k, signs)
    torch.testing.assert_close(rotate(x, signs), x @ r)
    torch.testing.assert_close(unrotate(rotate(x, signs), signs), x)


def test_signs_pack_to_one_bit_each_and_back():
    signs = random_signs(256, seed=1)
    packed = pack_signs(signs)
    assert packed.dtype == torch.uint8 and packed.shape == (32,)
    torch.testing.assert_close(unpack_signs(packed), signs)


def test_rotated_gptq_loses_less_on_weights_with_outlier_inputs():
    g = torch.Generator().manual_seed(0)
    k, n = 512, 128
    w = torch.randn(n, k, generator=g)
    w[:, torch.randperm(k, generator=g)[:8]] *= 12  # a few input channels with huge weights
    acc = HessianAccumulator(k)
    acc.add(torch.randn(4096, k, generator=g))
    h = acc.hessian()
    plain = Candidate(128, ((3, 1.0),), asym=True, act_order=False)
    rotated = Candidate(128, ((3, 1.0),), asym=True, act_order=False, rotate=True)
    plain_err = output_error(w, gptq_quantize(w, h, plain).dequantized(), h)
    rotated_result = gptq_quantize(w, h, rotated)
    assert rotated_result.layout.rotated and "rotation" in rotated_result.tensors()
    assert output_error(w, rotated_result.dequantized(), h) < 0.7 * plain_err
