"""Rotary position embedding on CPUs: `rotary.apply_rotary_ref`'s signature as one C++ pass over
the query and key heads (`cpu_rotary.cpp`, through `torch.ops.qrun.apply_rotary`).

The reference is five ops per tensor (two products, a concatenation, an add, a cast), each
writing a new tensor: for a 512-token prefill chunk of SmolLM2 (9 query and 3 key heads of 64)
~0.46 ms a layer on a 2-core Xeon, 7% of the chunk's forward. The kernel reads q and k in place
(the q/k/v projection's strided views) and writes each rotated element once, computing as the
reference does (the product with cos rounded, the one with sin fused into the add: torch's
addcmul), so its results equal the reference's bit for bit, as the C++ model's rotary
(the same formula, `qrun_rotary_pair`) does.
"""

from __future__ import annotations

import torch

from qrun.kernels.rotary import apply_rotary_ref


def apply_rotary_cpu(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary.apply_rotary_ref` through the C++ kernel where it takes the tensors (float32 or
    bfloat16 [T, H, D] with each token's heads contiguous, a float32 table, no gradient wanted: the
    converter differentiates through the layers), else through the reference."""
    wants_gradient = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad)
    takes = (not wants_gradient and q.device.type == "cpu" and cos_sin.dtype == torch.float32
             and all(x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 3 and x.stride(2) == 1
                     and x.stride(1) == x.shape[2] for x in (q, k)))
    if not takes:
        return apply_rotary_ref(q, k, positions, cos_sin)
    return torch.ops.qrun.apply_rotary(q, k, positions, cos_sin)
