"""Rotary position embedding in the half-split layout of Hugging Face checkpoints."""

from __future__ import annotations

import torch


def rotary_cos_sin(inv_freq: list[float], max_positions: int, device: torch.device | str) -> torch.Tensor:
    """[max_positions, D] table: cos in the first D/2 columns, sin in the last D/2 (float32)."""
    positions = torch.arange(max_positions, dtype=torch.float32, device=device)
    angles = torch.outer(positions, torch.tensor(inv_freq, dtype=torch.float32, device=device))
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D], positions: [T]. Returns rotated (q, k) in their dtype."""
    cos, sin = cos_sin[positions.long()].unsqueeze(1).chunk(2, dim=-1)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x.float().chunk(2, dim=-1)
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(q), rotate(k)
