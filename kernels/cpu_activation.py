"""The MLP's gated activation on CPUs: `activation.silu_and_mul_ref`'s signature as one C++ pass
(`cpu_activation.cpp`, through `torch.ops.qrun.silu_and_mul`).

The reference is two torch ops, each a pass over the rows into a new tensor; in the C++ decode
layer at one row (a SmolLM2 layer's 1536 values) they took ~6 us of a ~115 us layer, nearly all
dispatch. The kernel reads gate and up in place (the fused gate/up projection's halves), 16 values
a step with AVX512, computes SiLU as x / (1 + e^-x) from e^-|x| (no overflow; the exp within ~2
float ulp of torch's) and rounds as the reference does: the SiLU to the rows' dtype, then the
product. So a bfloat16 result differs from the reference only where the float SiLU lies within a
few ulp of a rounding boundary (one bfloat16 step, rarely), a float32 one by a few ulp; eager
layers and the C++ model both run this kernel, so they stay equal to each other bit for
bit. Through the op, 1536 values a row on a 2-core Xeon: 2.8 / 3.5 us (kernel / reference) at one
row, 18 / 21 at 16, 0.26 / 0.33 ms at 512 (microbenchmark). Where the C++ decode step multiplies
gate/up on the VNNI kernel, that kernel stores the activation as it stores the product, with the
same arithmetic (`qrun_gated16` in `cpu_kernels.h`), and this pass does not run.
"""

from __future__ import annotations

import torch

from qrun.kernels.activation import silu_and_mul_ref


def silu_and_mul_cpu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`activation.silu_and_mul_ref` through the C++ kernel where it takes the tensors (float32 or
    bfloat16, not empty, no gradient wanted), else through the reference. Rows are read in place
    where gate's and up's last dimensions are contiguous and their rows equally apart."""
    wants_gradient = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    takes = (not wants_gradient and gate.device.type == "cpu" and gate.dtype in (torch.float32, torch.bfloat16)
             and up.dtype == gate.dtype and up.shape == gate.shape and gate.dim() >= 1 and gate.numel() > 0)
    if not takes:
        return silu_and_mul_ref(gate, up)
    width = gate.shape[-1]
    gate_rows, up_rows = gate.reshape(-1, width), up.reshape(-1, width)
    if gate_rows.stride(-1) != 1 or up_rows.stride(-1) != 1 or gate_rows.stride(0) != up_rows.stride(0):
        gate_rows, up_rows = gate_rows.contiguous(), up_rows.contiguous()
    return torch.ops.qrun.silu_and_mul(gate_rows, up_rows).view(gate.shape)
