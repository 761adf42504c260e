"""Log probabilities for `SamplingParams.logprobs`: each sampled token's, and each row's likeliest
tokens'."""

from __future__ import annotations

import torch

from qrun.kernels.draw import at_infinity


def top_logprobs_ref(logits: torch.Tensor, tokens: torch.Tensor, top_n: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                      torch.Tensor]:
    """Of each row's log-softmax over float32 `logits` [B, V] (a row that reaches +inf at its limit,
    `at_infinity`): float32 [B] its value at the row's token of `tokens` [B] (int64, in [0, V)),
    and its `top_n` largest values (float32 [B, top_n], largest first) with their tokens (int64
    [B, top_n]). A row holding NaN, or only -inf, is NaN throughout. Which of equal values come
    first is the implementation's (the C++ kernel: the lower token)."""
    logprobs = at_infinity(logits).log_softmax(dim=-1)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    values, ids = logprobs.topk(top_n, dim=-1)
    return chosen, values, ids
