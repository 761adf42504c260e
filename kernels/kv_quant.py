"""Quantized KV cache storage: int8 and int4 keys and values with a scale per group of head_dim.

A quantized cache keeps two tensors per layer and kind (K or V):
- data: [num_blocks, block_size, Hkv, packed] with packed = D for int8 (int8 values, symmetric:
  x = q * scale) and D / 2 for int4 (uint8 bytes, asymmetric: x = q * scale + zero, q in 0..15;
  byte j holds element j in its low nibble and element j + D/2 in its high one, so unpacking
  is two masks and a concatenation rather than an interleave);
- scales: [num_blocks, block_size, Hkv, D / group, 2] float16, (scale, zero) per group of
  `group` consecutive elements of head_dim (zero is 0 for int8; `kv_group_size`).
So a token of one head costs D + 4 * D / group bytes in int8 and D / 2 + 4 * D / group in
int4, against 2 * D in float16: 1.88x and 3.2x fewer at head_dim 64 (64- and 32-wide groups).

Values are quantized per token as they are stored: a token's scale never changes, so prefix
caching, copy-on-write and recompute see the same bytes whatever else shares the block.
Rounding uses the stored float16 scale and rounds half up (floor(x + 0.5)) everywhere.
"""

from __future__ import annotations

import torch

from qrun.kernels.dtype import cast

SCALE_DTYPE = torch.float16
# On Turing (sm_75) attention over an int8 cache spills registers at head_dim 128 in every tile
# the launcher has (docs/KERNELS.md), so quantized caches need Ampere (sm_80) or newer on a GPU.
QUANTIZED_KV_MIN_CAPABILITY = 80
_SCALE_LIMIT = 65504.0  # float16's largest finite value: keys and values are clamped to it
_MIN_STEP = 2.0 ** -24  # smallest positive float16: a group of equal values still gets a step


def kv_group_size(head_dim: int, bits: int) -> int:
    """Elements of head_dim sharing one scale: 64 for int8 and 32 for int4 where head_dim is a
    multiple of that, else the whole head (head_dim 80 or 96: one group). int4 needs the smaller
    groups: in a one-window SmolLM2 experiment they took its KL from 0.034 to 0.026 (+0.5 bit)."""
    group = 64 if bits == 8 else 32
    return group if head_dim % group == 0 else head_dim


def storage_dtype(bits: int) -> torch.dtype:
    return {8: torch.int8, 4: torch.uint8}[bits]


def bits_of(data: torch.Tensor) -> int:
    """8 for an int8 cache, 4 for a packed int4 one (uint8 bytes)."""
    return {torch.int8: 8, torch.uint8: 4}[data.dtype]


def quantize_kv_ref(x: torch.Tensor, bits: int, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (any float dtype) -> (data [..., D * bits / 8], scales [..., D / group, 2] float16)."""
    # Few ops, most in place: on the CPU this runs for every layer of every step.
    grouped = x.to(torch.float32, copy=True).clamp_(-_SCALE_LIMIT, _SCALE_LIMIT).unflatten(-1, (-1, group))
    if bits == 8:
        scales = torch.zeros(*grouped.shape[:-1], 2, dtype=SCALE_DTYPE, device=x.device)
        scales[..., 0] = grouped.abs().amax(-1).div_(127).clamp_min_(_MIN_STEP)
        step = scales[..., :1].float()
        data = grouped.div_(step).add_(0.5).floor_().clamp_(-127, 127).to(torch.int8).flatten(-2)
        return data, scales
    low, high = grouped.aminmax(dim=-1)
    scales = torch.stack([high.sub_(low).div_(15).clamp_min_(_MIN_STEP), low], dim=-1).to(SCALE_DTYPE)
    step, zero = scales.float().unsqueeze(-2).unbind(-1)
    q = grouped.sub_(zero).div_(step).add_(0.5).floor_().clamp_(0, 15).to(torch.uint8)
    first, second = q.chunk(2, dim=-1)
    return first.bitwise_or_(second << 4).flatten(-2), scales


def dequantize_kv_ref(data: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of `quantize_kv_ref`: [..., packed] and [..., groups, 2] -> [..., D] in `dtype`."""
    grouped, (scale, zero) = data.unflatten(-1, (scales.shape[-2], -1)), scales.float().unsqueeze(-2).unbind(-1)
    parts = [grouped & 15, grouped >> 4] if data.dtype == torch.uint8 else [grouped]  # int4: the two nibbles
    if len(parts) == 2 and not torch.compiler.is_compiling():  # Inductor fuses nibbles apart (7x faster there)
        parts = [torch.cat(parts, dim=-1)]  # eager: joins the bytes, then dequantizes in one pass
    out = [cast(part.to(torch.float32).mul_(scale).add_(zero), dtype) for part in parts]  # 2-5x addcmul's speed
    return (out[0] if len(out) == 1 else torch.cat(out, dim=-1)).flatten(-2)


# ---------------------------------------------------------------------------------------------
# Triton helpers, inlined into the store and attention kernels: the same arithmetic as the
# reference, element by element in float32.
# ---------------------------------------------------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def load_dequantized(data_ptr, scales_ptr, data_offs, scale_offs, dims, mask, BITS: tl.constexpr,
                     GROUP: tl.constexpr):
    """float32 values of head_dim elements `dims` of the tokens/heads whose data and scales
    start at data_offs and scale_offs (tensors broadcast against dims)."""
    group = dims // GROUP
    if BITS == 8:
        q = tl.load(data_ptr + data_offs + dims, mask=mask, other=0).to(tl.float32)
    else:
        within = dims % GROUP
        byte_index = group * (GROUP // 2) + within % (GROUP // 2)
        byte = tl.load(data_ptr + data_offs + byte_index, mask=mask, other=0).to(tl.int32)
        q = ((byte >> ((within // (GROUP // 2)) * 4)) & 15).to(tl.float32)
    scale = tl.load(scales_ptr + scale_offs + group * 2, mask=mask, other=0.0).to(tl.float32)
    zero = tl.load(scales_ptr + scale_offs + group * 2 + 1, mask=mask, other=0.0).to(tl.float32)
    return q * scale + zero


@triton.jit
def _group_values(src_ptr, heads, head_ok, stride_src_h, start, COUNT: tl.constexpr, COUNT_PAD: tl.constexpr):
    cols = tl.arange(0, COUNT_PAD)[None, :]
    mask = head_ok[:, None] & (cols < COUNT)
    x = tl.load(src_ptr + heads[:, None] * stride_src_h + start + cols, mask=mask, other=0.0).to(tl.float32)
    return tl.minimum(tl.maximum(x, -65504.0), 65504.0), mask


@triton.jit
def store_quantized(src_ptr, stride_src_h, data_ptr, stride_dh, scales_ptr, stride_sh, num_heads,
                    BITS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr):
    """Quantize one token's heads (src_ptr + h * stride_src_h + d, d < HEAD_DIM) group by group
    into data and scales (bases already at the token's slot). GROUP_PAD: the next power of two
    of GROUP (int8) or of GROUP / 2 (int4)."""
    heads = tl.arange(0, HEADS_PAD)
    head_ok = heads < num_heads
    cols = tl.arange(0, GROUP_PAD)[None, :]
    HALF: tl.constexpr = GROUP // 2  # int4: a group's bytes (a constexpr may not be set inside the loop)
    for g in tl.static_range(HEAD_DIM // GROUP):
        scale_offs = scales_ptr + heads * stride_sh + g * 2
        if BITS == 8:
            x, mask = _group_values(src_ptr, heads, head_ok, stride_src_h, g * GROUP, GROUP, GROUP_PAD)
            scale = tl.maximum(tl.max(tl.abs(x), 1) / 127, 5.960464477539063e-08).to(tl.float16)
            q = tl.floor(x / scale.to(tl.float32)[:, None] + 0.5)
            q = tl.minimum(tl.maximum(q, -127.0), 127.0)
            tl.store(data_ptr + heads[:, None] * stride_dh + g * GROUP + cols, q.to(tl.int8), mask=mask)
            tl.store(scale_offs + 1, tl.zeros([HEADS_PAD], tl.float16), mask=head_ok)
        else:
            first, mask = _group_values(src_ptr, heads, head_ok, stride_src_h, g * GROUP, HALF, GROUP_PAD)
            second, _ = _group_values(src_ptr, heads, head_ok, stride_src_h, g * GROUP + HALF, HALF, GROUP_PAD)
            low = tl.minimum(tl.min(tl.where(mask, first, float("inf")), 1),
                             tl.min(tl.where(mask, second, float("inf")), 1))
            high = tl.maximum(tl.max(tl.where(mask, first, float("-inf")), 1),
                              tl.max(tl.where(mask, second, float("-inf")), 1))
            scale = tl.maximum((high - low) / 15, 5.960464477539063e-08).to(tl.float16)
            zero = low.to(tl.float16)
            step = scale.to(tl.float32)[:, None]
            q1 = tl.minimum(tl.maximum(tl.floor((first - zero.to(tl.float32)[:, None]) / step + 0.5), 0.0), 15.0)
            q2 = tl.minimum(tl.maximum(tl.floor((second - zero.to(tl.float32)[:, None]) / step + 0.5), 0.0), 15.0)
            packed = (q1.to(tl.int32) | (q2.to(tl.int32) << 4)).to(tl.uint8)
            tl.store(data_ptr + heads[:, None] * stride_dh + g * HALF + cols, packed, mask=mask)
            tl.store(scale_offs + 1, zero, mask=head_ok)
        tl.store(scale_offs, scale, mask=head_ok)
