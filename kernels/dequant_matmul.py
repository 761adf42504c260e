"""Matmul against mixed-bit packed weights (layout: docs/FORMAT.md, "Packed linear").

`dequant_matmul_ref` is the plain reference: unpack every group, dequantize to float32, undo
nothing (the activations are gathered into permuted order instead), one matmul. A GPU kernel
takes the same arguments and returns the same result.
"""

from __future__ import annotations

import torch

CHUNK = 32


def _unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [chunks*bits, N] -> int64 [chunks*32, N]: row j of a 32-row chunk sits at bit j*bits."""
    total, n = words.shape
    chunks = total // bits
    w64 = words.to(torch.int64).reshape(chunks, bits, n) & 0xFFFFFFFF
    mask = (1 << bits) - 1
    out = torch.empty(chunks, CHUNK, n, dtype=torch.int64, device=words.device)
    for j in range(CHUNK):
        w, s = divmod(j * bits, 32)
        value = w64[:, w] >> s
        if s + bits > 32:
            value = value | (w64[:, w + 1] << (32 - s))
        out[:, j] = value & mask
    return out.reshape(chunks * CHUNK, n)


def dequantize_ref(qweight: torch.Tensor, qgroups: torch.Tensor, scales: torch.Tensor,
                   mins: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """Packed weights -> float32 [K, N] in permuted input order.

    qweight int32 [R, N]; qgroups int32 [G, 2] = (bits, first qweight row) per group;
    scales [G, N]; mins [G, N] or None. Asymmetric groups: w = q*scale + min; symmetric:
    w = (q - 2^(bits-1)) * scale.
    """
    groups = qgroups.tolist()
    n = qweight.shape[1]
    out = torch.empty(len(groups) * group_size, n, dtype=torch.float32, device=qweight.device)
    g = 0
    while g < len(groups):  # runs of equal width unpack together
        bits, row = groups[g]
        end = g
        while end < len(groups) and groups[end][0] == bits:
            end += 1
        words = (end - g) * group_size * bits // CHUNK
        q = _unpack_rows(qweight[row:row + words], bits).float()
        s = scales[g:end].float().repeat_interleave(group_size, 0)
        if mins is not None:
            w = q * s + mins[g:end].float().repeat_interleave(group_size, 0)
        else:
            w = (q - float(1 << (bits - 1))) * s
        out[g * group_size:end * group_size] = w
        g = end
    return out


def dequant_matmul_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qgroups: torch.Tensor,
    scales: torch.Tensor,
    mins: torch.Tensor | None,
    perm: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[M, N] = x[M, K] @ W.T (+ bias), W given packed; computed in float32, returned in x.dtype.

    perm [K] (int16/int32): packed row i multiplies input column perm[i].
    """
    w = dequantize_ref(qweight, qgroups, scales, mins, group_size)
    y = x[:, perm.long()].float() @ w
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
