"""Attention of a flat batch of queries against a paged KV cache.

Layout shared by every implementation:
- q: [T, Hq, D], the new tokens of all sequences back to back;
  sequence s owns rows query_start_loc[s] : query_start_loc[s + 1].
- k_cache, v_cache: [num_blocks, block_size, Hkv, D]; Hq is a multiple of Hkv (GQA).
- block_tables: [S, max_blocks] int32; row s lists the pool blocks of sequence s in order.
  Entries past a sequence's last block are ignored.
- seq_lens: [S] int32, each sequence's context length including this step's tokens, whose
  K/V are already in the cache. Query row i of a sequence with n new tokens sits at position
  seq_len - n + i and attends causally to keys 0 .. seq_len - n + i.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """K or V of one or more sequences as [..., length, Hkv, D], read through their block tables."""
    block_size = cache.shape[1]
    num_blocks = -(-length // block_size)
    blocks = cache[block_table[..., :num_blocks].clamp(min=0).long()]
    return blocks.flatten(-4, -3)[..., :length, :, :]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: decodes batched in one masked SDPA call, prefill chunks one by one."""
    if out is None:
        out = torch.empty_like(q)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    decodes = [s for s, n in enumerate(query_lens) if n == 1]
    # Decodes dominate a busy step: one gather and one SDPA call for all of them. Rows past a
    # sequence's length are masked out, never read as real keys.
    if decodes:
        index = torch.tensor(decodes, dtype=torch.long, device=q.device)
        longest = max(lens[s] for s in decodes)
        k = _gather_context(k_cache, block_tables[index], longest).transpose(1, 2)
        v = _gather_context(v_cache, block_tables[index], longest).transpose(1, 2)
        rows = query_start_loc[index].long()
        positions = torch.arange(longest, device=q.device)
        mask = positions[None, :] < seq_lens[index][:, None]
        attended = F.scaled_dot_product_attention(
            q[rows].unsqueeze(2), k, v, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True
        )
        out[rows] = attended.squeeze(2)
    for s, n in enumerate(query_lens):
        if n <= 1:
            continue
        length = lens[s]
        k = _gather_context(k_cache, block_tables[s], length).transpose(0, 1)
        v = _gather_context(v_cache, block_tables[s], length).transpose(0, 1)
        query_pos = torch.arange(length - n, length, device=q.device)
        mask = torch.arange(length, device=q.device)[None, :] <= query_pos[:, None]
        rows = slice(starts[s], starts[s + 1])
        out[rows] = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k, v, attn_mask=mask, scale=scale, enable_gqa=True
        ).transpose(0, 1)
    return out
