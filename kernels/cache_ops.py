"""Writing a step's new keys and values into their slots of the paged cache."""

from __future__ import annotations

import torch


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [T, Hkv, D]; slot_mapping: [T] slot = block * block_size + offset."""
    slots = slot_mapping.long()
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v.to(v_cache.dtype))
