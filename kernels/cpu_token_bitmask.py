"""Structured outputs' token masks on CPUs: `token_bitmask.mask_logits_ref`'s signature, one pass
over each row (`cpu_token_bitmask.cpp`, through `torch.ops.qrun.mask_logits`), where the
reference's eager ops make four passes and a [R, V] mask."""

from __future__ import annotations

import torch

from qrun.kernels.token_bitmask import mask_logits_ref


def mask_logits_cpu(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """`token_bitmask.mask_logits_ref` through the C++ kernel for float32 logits with contiguous
    rows on the CPU, else the reference."""
    if (logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
            or logits.stride(-1) != 1 or bitmask.dtype != torch.int32 or bitmask.dim() != 2):
        return mask_logits_ref(logits, bitmask)
    torch.ops.qrun.mask_logits(logits, bitmask.contiguous())
