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


# ---------------------------------------------------------------------------------------------
# Triton implementation: one program per token copies its K and V rows (all KV heads) into the
# token's slot, casting to the cache dtype on the way; K and V share the launch and the slot load.
# ---------------------------------------------------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from qrun.kernels.launch import Launch  # noqa: E402


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr, DIM_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: no slot
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kct + heads * stride_kch + dims
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vct + heads * stride_vch + dims
    tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def store_kv_launches(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> list[Launch]:
    """The launch `store_kv_triton` runs: one program per token."""
    num_tokens, num_heads, head_dim = k.shape
    return [Launch(
        _store_kv_kernel, (num_tokens,),
        (k, v, k_cache, v_cache, slot_mapping,
         k.stride(0), k.stride(1), v.stride(0), v.stride(1),
         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
         v_cache.stride(0), v_cache.stride(1), v_cache.stride(2)),
        dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_heads),
             DIM_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[1]),
    )]


def store_kv_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Same contract as `store_kv_ref`; a negative slot (padding) is skipped."""
    if k.shape[0] == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    for launch in store_kv_launches(k, v, k_cache, v_cache, slot_mapping):
        launch.run()
