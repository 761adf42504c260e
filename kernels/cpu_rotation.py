"""The input rotation of mixed-bit models and of quantized KV caches on CPUs: `kernels/rotation.py`'s
`rotate`, `unrotate` and `reflect`, same signatures, as one C++ call each (`cpu_rotation.cpp`,
through `torch.ops.qrun.rotate`, `unrotate` and `reflect`).

F's power-of-two factors multiply to one Sylvester-Hadamard matrix, so the kernel runs it as a fast
Walsh-Hadamard transform and contracts only the odd factor as a matrix. At one to a few rows this
is 2-5x faster than torch's one small matmul per factor (each a BLAS call with its own thread
start-up); from ~256 rows on (prefill chunks) torch's batched matmuls are as fast. Results equal
the reference's to float32 rounding (a different summation order), so a model rotates through one
of the two everywhere: the kernel table's choice (`kernels/__init__.py`).
"""

from __future__ import annotations

import torch

from qrun.kernels.rotation import reflect, rotate, rotation_factors, unrotate


def rotate_cpu(x: torch.Tensor, signs: torch.Tensor, factors: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """`rotation.rotate` through the C++ kernel where it takes x (float32 or bfloat16 rows),
    else through the reference."""
    return _through_kernel(torch.ops.qrun.rotate, rotate, x, signs, factors)


def unrotate_cpu(x: torch.Tensor, signs: torch.Tensor, factors: tuple[torch.Tensor, ...] | None = None) -> torch.Tensor:
    """`rotation.unrotate`, as `rotate_cpu` is `rotation.rotate`."""
    return _through_kernel(torch.ops.qrun.unrotate, unrotate, x, signs, factors)


def reflect_cpu(x: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """`rotation.reflect` through the C++ kernel where it takes x (float32 or bfloat16 [rows, H, D]),
    else through the reference."""
    if x.dtype not in (torch.float32, torch.bfloat16) or u.dtype != torch.float32 or x.device.type != "cpu":
        return reflect(x, u)
    return torch.ops.qrun.reflect(x.reshape(-1, *x.shape[-2:]), u).view(x.shape)


def _through_kernel(kernel, reference, x: torch.Tensor, signs: torch.Tensor,
                    factors: tuple[torch.Tensor, ...] | None) -> torch.Tensor:
    if x.dtype not in (torch.float32, torch.bfloat16) or signs.dtype != torch.float32 or x.device.type != "cpu":
        return reference(x, signs, factors)
    k = x.shape[-1]
    rows = x.reshape(-1, k)
    odd = odd_factor(factors if factors is not None else rotation_factors(k, x.device))
    return kernel(rows if rows.stride(-1) == 1 else rows.contiguous(), signs, odd).view(x.shape)


def odd_factor(factors: tuple[torch.Tensor, ...]) -> torch.Tensor | None:
    """The kernel's matrix among `rotation_factors`: the one for K's odd part (the outermost), or
    None when K is a power of two (the kernel runs the rest as one Walsh-Hadamard transform)."""
    return factors[0] if factors and factors[0].shape[0] % 2 == 1 else None
