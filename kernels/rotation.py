"""Input rotation for incoherence processing (QuIP#-style): x -> (x * signs) @ F.

F is a fixed orthogonal K x K matrix with entries of magnitude about 1/sqrt(K): the Kronecker
product of Sylvester-Hadamard factors (the power-of-two part of K, in factors of at most 64)
and, for the odd part of K, a discrete Hartley matrix. `signs` (random +-1 per input, stored
with the matrix) makes the rotation random. A matrix quantized in the rotated basis,
W' = W R with R = diag(signs) F, has its outlier inputs spread over all inputs, so wide groups
and low widths lose less; at run time its input is rotated the same way (y = x W^T = (x R) W'^T).

F is applied factor by factor (K * sum of factor sizes multiply-adds per row, a few percent of
the matmul it precedes), never as a dense K x K matrix. This is the torch reference; CPUs run
`kernels/cpu_rotation.py`'s C++ kernel (the kernel table's choice), GPUs these small matmuls.
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch

from qrun.kernels.dtype import cast

MAX_FACTOR = 64


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)])
    return h / math.sqrt(n)


def _hartley(n: int) -> torch.Tensor:
    """The orthonormal discrete Hartley transform (symmetric, its own inverse)."""
    angle = 2 * math.pi * torch.outer(torch.arange(n, dtype=torch.float64), torch.arange(n, dtype=torch.float64)) / n
    return (angle.cos() + angle.sin()) / math.sqrt(n)


def factor_sizes(k: int) -> list[int]:
    """Sizes of F's Kronecker factors, outermost first: the odd part of K, then powers of two <= 64."""
    odd, power = k, 1
    while odd % 2 == 0:
        odd //= 2
        power *= 2
    sizes = [odd] if odd > 1 else []
    while power > 1:
        step = min(power, MAX_FACTOR)
        sizes.append(step)
        power //= step
    return sizes


@lru_cache(maxsize=None)
def rotation_factors(k: int, device: torch.device, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    """F's Kronecker factors for K inputs (cached). A module that rotates inside a compiled graph
    holds them and passes them to `rotate`: Dynamo traces through the cache, so a graph that
    looked them up would rebuild every factor on every call (~0.1 ms per rotation)."""
    sizes = factor_sizes(k)
    made = [_sylvester(s) if s & (s - 1) == 0 else _hartley(s) for s in sizes]
    return tuple(f.to(device=device, dtype=dtype) for f in made)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _apply_f(y: torch.Tensor, factors: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    """y @ F over the last dimension (F symmetric and orthogonal: F = F^T = F^-1), y float32 or 64.

    Y viewed as [rows, d1, d2, ...]: the factor of axis i contracts it in place as one matmul on
    a view, [rows * d1..d(i-1), d_i, rest] left-multiplied by the factor (the last axis:
    [-1, d_last] @ factor), so nothing is copied between factors. On CPU this beat a
    transpose-copy and GEMM per factor by 1.1x at one row and 3-5x at 32-512 rows (K = 576)."""
    shape, k = y.shape, y.shape[-1]
    rows = y.numel() // k
    before = 1
    for f in factors if factors is not None else rotation_factors(k, y.device, y.dtype):
        size = f.shape[0]
        after = k // (before * size)
        if after == 1:
            y = y.reshape(-1, size) @ f
        else:
            y = torch.matmul(f, y.reshape(rows * before, size, after))
        before *= size
    return y.view(shape)


def rotate(x: torch.Tensor, signs: torch.Tensor, factors: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """x [..., K] -> x R with R = diag(signs) F (signs: +-1 per input, any float or int dtype;
    `factors`: `rotation_factors` in x's compute dtype, looked up when not given)."""
    dtype = _compute_dtype(x)
    return cast(_apply_f(cast(x, dtype) * cast(signs, dtype), factors), x.dtype)


def unrotate(x: torch.Tensor, signs: torch.Tensor, factors: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """The inverse: x R^T = (x F) * signs (arguments as `rotate`'s)."""
    dtype = _compute_dtype(x)
    return cast(_apply_f(cast(x, dtype), factors) * cast(signs, dtype), x.dtype)


def reflect(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """x [..., H, D] -> each head's row reflected in the hyperplane orthogonal to its KV head's unit
    vector (u: [Hkv, D], H a multiple of Hkv; query heads h share u[h // (H / Hkv)]): x - 2 (x . u) u,
    in float32 (float64 stays). Orthogonal and its own inverse, so reflecting queries and keys
    alike keeps every q . k."""
    dtype = _compute_dtype(x)
    normals = cast(u, dtype).repeat_interleave(x.shape[-2] // u.shape[0], 0)
    rows = cast(x, dtype)
    return cast(rows - 2 * (rows * normals).sum(-1, keepdim=True) * normals, x.dtype)


def random_signs(k: int, seed: int = 0) -> torch.Tensor:
    """+-1 float32 [K], reproducible from the seed."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 2, (k,), generator=gen).float().mul_(2).sub_(1)


def pack_signs(signs: torch.Tensor) -> torch.Tensor:
    """+-1 [K] (K a multiple of 8) -> uint8 [K/8], bit j of byte i set where input 8i+j is negative."""
    bits = (signs < 0).to(torch.int32).reshape(-1, 8)
    return (bits << torch.arange(8, dtype=torch.int32, device=signs.device)).sum(1).to(torch.uint8)


def unpack_signs(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [K/8] -> +-1 float32 [K]."""
    bits = (packed.to(torch.int32)[:, None] >> torch.arange(8, dtype=torch.int32, device=packed.device)) & 1
    return (1 - 2 * bits).reshape(-1).float()
