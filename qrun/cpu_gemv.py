"""Dense bfloat16 linears on x86 CPUs decode through torch's float16 GEMV.

At one or two rows a linear is a matrix-vector product bound by reading the weight. torch's
float16 GEMV on x86 (vectorised, float32 accumulation) reads at close to memory speed, while
its bfloat16 matmul at one row does not: on an AVX512-BF16 EPYC a 3072 x 576 weight took 151 us
in float16 and 321 us in bfloat16, and a SmolLM2 decode step fell from 32 to 21 ms. At three
rows and more bfloat16 wins by far (float16 has no hardware GEMM there: 3.0 ms vs 0.5 ms at 32
rows), so each linear keeps both copies: the float16 one costs as much memory as the bfloat16
one (together what a float32 model costs).

float16 holds 3 more mantissa bits than bfloat16 but overflows past 65504: a forward whose
output is not finite runs again in bfloat16 (`ModelRunner.execute`, via `bfloat16_only`), one
check per step rather than one per linear.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch
import torch.nn.functional as F
from torch import nn

GEMV_ROWS = 2


def half_gemv_applies(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether dense linears of this dtype on this device decode through float16 GEMV."""
    return (device.type == "cpu" and dtype == torch.bfloat16
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


class HalfGemvLinear(nn.Module):
    """y = x W^T + b, through a float16 copy of W at <= GEMV_ROWS rows, W itself otherwise."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.weight, self.bias = linear.weight, linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_f16 = linear.weight.detach().to(torch.float16)
        self.bias_f16 = None if linear.bias is None else linear.bias.detach().to(torch.float16)
        self.enabled = True  # False inside bfloat16_only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled and x.shape[0] <= GEMV_ROWS and x.dim() == 2:
            return F.linear(x.to(torch.float16), self.weight_f16, self.bias_f16).to(x.dtype)
        return F.linear(x, self.weight, self.bias)


@contextmanager
def bfloat16_only(model: nn.Module) -> Iterator[None]:
    """Run `model`'s HalfGemvLinears on their bfloat16 weights inside the block."""
    linears = [m for m in model.modules() if isinstance(m, HalfGemvLinear)]
    for lin in linears:
        lin.enabled = False
    try:
        yield
    finally:
        for lin in linears:
            lin.enabled = True


def uses_half_gemv(model: nn.Module) -> bool:
    return any(isinstance(m, HalfGemvLinear) for m in model.modules())


def use_half_gemv(model: nn.Module) -> None:
    """Swap every dense nn.Linear of `model` for a HalfGemvLinear (the caller checks it applies)."""
    for module in list(model.modules()):  # the loop replaces submodules
        for name, child in module.named_children():
            if type(child) is nn.Linear:
                setattr(module, name, HalfGemvLinear(child))
