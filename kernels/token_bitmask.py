"""Structured outputs' token masks applied to logits: every token a row's grammar forbids set to
-inf before sampling."""

from __future__ import annotations

import torch


def mask_logits_ref(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf at each token of float32 `logits` [R, V] that its row of `bitmask` [R, words]
    (int32, llguidance's layout: token t allowed where bit t % 32 of word t // 32 is set) does not
    allow; tokens past its 32 x words bits are not allowed either. Eager ops: llguidance's own
    kernel is compiled by Inductor, whose code for CPUs where torch dispatches AVX2 kernels
    (`ATEN_CPU_CAPABILITY=avx2` on an AVX-512 CPU shows it) allowed tokens the mask forbids
    (torch 2.13: a row allowing tokens 3, 40 and 77 of 100 came out allowing 8-15, 24-31, ...)."""
    vocab = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()
    logits[:, :allowed.shape[1]].masked_fill_(~allowed, float("-inf"))
    logits[:, allowed.shape[1]:] = float("-inf")
