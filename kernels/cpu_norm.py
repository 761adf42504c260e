"""RMSNorm on CPUs: `norm.rms_norm_ref`'s signature, as one C++ pass per row (`cpu_norm.cpp`,
through `torch.ops.qrun.rms_norm` / `add_rms_norm`).

torch's `rms_norm` on one decode row is several ops (upcast, square, mean, rsqrt, two products,
casts), each a dispatch and an allocation: in a native profile of a batch-1 SmolLM2 decode step
the norms took 10-15% of the step. The kernel adds the residual, sums the squares and scales in
one pass, and rounds where torch's rms_norm (the reference) rounds: the sum to the rows' dtype,
then the scaled row once. Its results differ from the reference in the last bit where the
reduction order does, so the eager layers and the C++ model both take it (the kernel
table's `rms_norm` on the CPU), and stay equal.
"""

from __future__ import annotations

import torch

from qrun.kernels.norm import rms_norm_ref


def rms_norm_cpu(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`norm.rms_norm_ref` through the C++ kernel where it takes the tensors (contiguous float32
    or bfloat16 rows, the weight in the same dtype, no gradient wanted: the converter
    differentiates through the final norm), else through the reference."""
    tensors = (x, weight) if residual is None else (x, weight, residual)
    wants_gradient = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    takes = (not wants_gradient and x.device.type == "cpu" and x.dtype in (torch.float32, torch.bfloat16)
             and weight.dtype == x.dtype and x.is_contiguous() and weight.is_contiguous()
             and (residual is None or (residual.dtype == x.dtype and residual.is_contiguous()
                                       and residual.shape == x.shape)))
    if not takes:
        return rms_norm_ref(x, weight, eps, residual)
    if residual is None:
        return torch.ops.qrun.rms_norm(x, weight, eps), x
    return torch.ops.qrun.add_rms_norm(x, residual, weight, eps)
