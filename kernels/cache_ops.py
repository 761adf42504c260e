"""Writing a step's new keys and values into their slots of the paged cache."""

from __future__ import annotations

import torch

from qrun.kernels.dtype import cast
from qrun.kernels.kv_quant import bits_of, quantize_kv_ref


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """k, v: [T, Hkv, D]; slot_mapping: [T] slot = block * block_size + offset; with scales, quantized on the way
    (`kernels/kv_quant.py`). Written by (block, offset) into the cache, not a flat view: compiled, still in place."""
    where = torch.unravel_index(cast(slot_mapping, torch.int64), k_cache.shape[:2])
    if k_scales is None:
        k_cache.index_put_(where, cast(k, k_cache.dtype))
        v_cache.index_put_(where, cast(v, v_cache.dtype))
        return
    heads = k.shape[1]  # K and V quantized as one tensor: half the ops
    data, scales = quantize_kv_ref(torch.cat([k, v], dim=1), bits_of(k_cache), k.shape[-1] // k_scales.shape[-2])
    for cache, cache_scales, part in ((k_cache, k_scales, slice(None, heads)), (v_cache, v_scales, slice(heads, None))):
        cache.index_put_(where, data[:, part])
        cache_scales.index_put_(where, scales[:, part])


# ---------------------------------------------------------------------------------------------
# Triton implementation: one program per token copies its K and V rows (all KV heads) into the
# token's slot, casting to the cache dtype on the way; K and V share the launch and the slot load.
# ---------------------------------------------------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from qrun.kernels.kv_quant import store_quantized  # noqa: E402
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


@triton.jit
def _store_kv_quantized_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kct, stride_kch,
    stride_vcb, stride_vct, stride_vch,
    stride_ksb, stride_kst, stride_ksh,
    stride_vsb, stride_vst, stride_vsh,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:  # padding token: no slot
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    store_quantized(k_ptr + token * stride_kt, stride_kh,
                    k_cache_ptr + block * stride_kcb + offset * stride_kct, stride_kch,
                    k_scales_ptr + block * stride_ksb + offset * stride_kst, stride_ksh, NUM_HEADS,
                    BITS, HEADS_PAD, HEAD_DIM, GROUP, GROUP_PAD)
    store_quantized(v_ptr + token * stride_vt, stride_vh,
                    v_cache_ptr + block * stride_vcb + offset * stride_vct, stride_vch,
                    v_scales_ptr + block * stride_vsb + offset * stride_vst, stride_vsh, NUM_HEADS,
                    BITS, HEADS_PAD, HEAD_DIM, GROUP, GROUP_PAD)


def store_kv_launches(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> list[Launch]:
    """The launch `store_kv_triton` runs: one program per token."""
    num_tokens, num_heads, head_dim = k.shape
    if k_scales is not None:
        bits = bits_of(k_cache)
        group = head_dim // k_scales.shape[-2]
        return [Launch(
            _store_kv_quantized_kernel, (num_tokens,),
            (k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping,
             k.stride(0), k.stride(1), v.stride(0), v.stride(1),
             k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
             v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
             k_scales.stride(0), k_scales.stride(1), k_scales.stride(2),
             v_scales.stride(0), v_scales.stride(1), v_scales.stride(2)),
            dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEADS_PAD=triton.next_power_of_2(num_heads),
                 BLOCK_SIZE=k_cache.shape[1], BITS=bits, GROUP=group,
                 GROUP_PAD=triton.next_power_of_2(group if bits == 8 else group // 2)),
        )]
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
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Same contract as `store_kv_ref`; a negative slot (padding) is skipped."""
    if k.shape[0] == 0:
        return
    assert k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    for launch in store_kv_launches(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales):
        launch.run()
