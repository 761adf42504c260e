"""Sampling's draw on CPUs: `draw.draw_ref`'s signature, a few passes over each row
(`cpu_draw.cpp`, through `torch.ops.qrun.draw`).

torch's ops (a softmax, a top-k of the nucleus's candidates, a float64 cumulative sum, a search)
took 218 us for one row of SmolLM2's 49,152 logits at temperature 1, 769 us with top_p 0.9, 624
with top_k 40, against 37, 56 and 71 us here (2-core Xeon, real logits in cache: one-off probe),
beside a 4.0-bpw decode step of ~2.5 ms at batch 1. The kernel draws the same
distribution (its e^x is the library's, to ~2 ulp, so a uniform within ~1e-7 of a token's
boundary may fall the other way), and the C++ model draws with it inside runs of decode steps
(`qrun/cpu_model.py`), so on the CPU a sampled token is the same whether its step ran alone or
in a run.
"""

from __future__ import annotations

import torch

from qrun.kernels.draw import draw_ref


def draw_cpu(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
             min_p: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """`draw.draw_ref` through the C++ kernel for float32 logits on the CPU, else the reference."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2 or logits.shape[1] == 0:
        return draw_ref(logits, temperature, top_k, top_p, min_p, uniforms)
    return torch.ops.qrun.draw(logits if logits.stride(-1) == 1 else logits.contiguous(),
                               temperature.float().contiguous(), top_k.long().contiguous(),
                               top_p.float().contiguous(), min_p.float().contiguous(),
                               uniforms.double().contiguous())
