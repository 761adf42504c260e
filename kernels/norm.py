"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, new_residual) where new_residual = x + residual (or x).

    The statistics are taken in float32 and the result is cast back before the weight
    multiplies it, as the reference implementations of these models do.
    """
    if residual is not None:
        x = x + residual
    variance = x.float().pow(2).mean(-1, keepdim=True)
    normed = (x.float() * torch.rsqrt(variance + eps)).to(x.dtype)
    return weight * normed, x
