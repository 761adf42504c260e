"""Logprobs on CPUs: `logprobs.top_logprobs_ref`'s signature, two passes over each row
(`cpu_logprobs.cpp`, through `torch.ops.qrun.top_logprobs`); the C++ model runs the same kernel
inside runs of decode steps (`qrun/cpu_model.py`), so a sequence asking for logprobs decodes in
runs as others do.
"""

from __future__ import annotations

import torch

from qrun.kernels.logprobs import top_logprobs_ref


def top_logprobs_cpu(logits: torch.Tensor, tokens: torch.Tensor, top_n: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                      torch.Tensor]:
    """`logprobs.top_logprobs_ref` through the C++ kernel for float32 logits on the CPU, else the reference."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] == 0:
        return top_logprobs_ref(logits, tokens, top_n)
    return torch.ops.qrun.top_logprobs(logits if logits.stride(-1) == 1 else logits.contiguous(),
                                       tokens.long().contiguous(), top_n)
