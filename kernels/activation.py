"""The gated activation of Llama-style MLPs: silu(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate and up of one shape and dtype (the halves of a fused gate/up
    projection's output, or two projections'), in their dtype: the SiLU rounded to it, then the
    product."""
    return F.silu(gate) * up
