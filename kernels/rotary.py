"""Rotary position embedding in the half-split layout of Hugging Face checkpoints."""

from __future__ import annotations

import torch

from qrun.kernels.dtype import cast


def rotary_cos_sin(inv_freq: list[float], max_positions: int, device: torch.device | str) -> torch.Tensor:
    """[max_positions, D] table: cos in the first D/2 columns, sin in the last D/2 (float32)."""
    positions = torch.arange(max_positions, dtype=torch.float32, device=device)
    angles = torch.outer(positions, torch.tensor(inv_freq, dtype=torch.float32, device=device))
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def apply_rotary_ref(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D], positions: [T]. Returns rotated (q, k) in their dtype."""
    cos2, sin2 = _step_tables(positions, cos_sin)

    def rotate(x: torch.Tensor) -> torch.Tensor:
        # x * [cos, cos] + [x2, x1] * [-sin, sin]; half inputs promote to float32 inside the ops
        x1, x2 = x.chunk(2, dim=-1)
        return cast(torch.addcmul(x * cos2, torch.cat([x2, x1], dim=-1), sin2), x.dtype)

    return rotate(q), rotate(k)


_last_tables: tuple[tuple[int, int], torch.Tensor, torch.Tensor, torch.Tensor] | None = None


def _step_tables(positions: torch.Tensor, cos_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, 1, D] ([cos, cos], [-sin, sin]) of a step's positions: its first layer makes them for all (~2 ms a step)."""
    global _last_tables
    compiled = torch.compiler.is_compiling()  # a compiled layer makes the tables in its fused loops
    cached = None if compiled else _last_tables  # one read: another thread's engine may replace it
    if cached is not None and cached[0] == (id(positions), id(cos_sin)):
        return cached[2], cached[3]
    cos, sin = cos_sin[positions.long()].unsqueeze(1).chunk(2, dim=-1)
    cos2, sin2 = torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1)
    if not compiled:  # positions is kept alive with the tables, so its id cannot be reused meanwhile
        _last_tables = ((id(positions), id(cos_sin)), positions, cos2, sin2)
    return cos2, sin2


# ---------------------------------------------------------------------------------------------
# Triton implementation: one program per token loads its cos/sin row once and rotates all its
# query and key heads (one launch for both), computing in float32 like the reference.
# ---------------------------------------------------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from qrun.kernels.launch import Launch  # noqa: E402


@triton.jit
def _rotate_heads(src_ptr, dst_ptr, token, stride_s, stride_sh, stride_d, stride_dh, cos, sin,
                  NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HALF: tl.constexpr,
                  HALF_PAD: tl.constexpr):
    heads = tl.arange(0, HEADS_PAD)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < NUM_HEADS) & (cols < HALF)
    src = src_ptr + token * stride_s + heads * stride_sh + cols
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = dst_ptr + token * stride_d + heads * stride_dh + cols
    ty = dst_ptr.dtype.element_ty
    tl.store(dst, (x1 * cos - x2 * sin).to(ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr, k_ptr, q_out_ptr, k_out_ptr, positions_ptr, cos_sin_ptr,
    stride_qt, stride_qh, stride_kt, stride_kh,
    stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr,
    Q_HEADS_PAD: tl.constexpr, K_HEADS_PAD: tl.constexpr,
    HALF: tl.constexpr, HALF_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + token).to(tl.int64)
    cols = tl.arange(0, HALF_PAD)[None, :]
    cs = cos_sin_ptr + pos * stride_cs + cols
    cos = tl.load(cs, mask=cols < HALF, other=0.0).to(tl.float32)
    sin = tl.load(cs + HALF, mask=cols < HALF, other=0.0).to(tl.float32)
    _rotate_heads(q_ptr, q_out_ptr, token, stride_qt, stride_qh, stride_qot, stride_qoh, cos, sin,
                  NUM_Q_HEADS, Q_HEADS_PAD, HALF, HALF_PAD)
    _rotate_heads(k_ptr, k_out_ptr, token, stride_kt, stride_kh, stride_kot, stride_koh, cos, sin,
                  NUM_K_HEADS, K_HEADS_PAD, HALF, HALF_PAD)


def apply_rotary_launches(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
    q_out: torch.Tensor | None = None, k_out: torch.Tensor | None = None,
) -> list[Launch]:
    """The launch `apply_rotary_triton` runs: one program per token, writing q_out and k_out
    (allocated like q and k when None)."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_k_heads = k.shape[1]
    q_out = q_out if q_out is not None else torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = k_out if k_out is not None else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    half = head_dim // 2
    return [Launch(
        _rotary_kernel, (num_tokens,),
        (q, k, q_out, k_out, positions, cos_sin,
         q.stride(0), q.stride(1), k.stride(0), k.stride(1),
         q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1), cos_sin.stride(0)),
        dict(NUM_Q_HEADS=num_q_heads, NUM_K_HEADS=num_k_heads,
             Q_HEADS_PAD=triton.next_power_of_2(num_q_heads), K_HEADS_PAD=triton.next_power_of_2(num_k_heads),
             HALF=half, HALF_PAD=triton.next_power_of_2(half)),
    )]


def apply_rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `apply_rotary_ref`: new rotated (q, k), inputs untouched."""
    head_dim = q.shape[-1]
    assert head_dim % 2 == 0 and cos_sin.shape[-1] == head_dim, "rotary spans the whole head"
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and cos_sin.stride(-1) == 1
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if q.shape[0]:
        for launch in apply_rotary_launches(q, k, positions, cos_sin, q_out, k_out):
            launch.run()
    return q_out, k_out
