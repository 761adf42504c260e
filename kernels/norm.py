"""RMSNorm, optionally fused with the residual add that precedes it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qrun.kernels.dtype import cast


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, new_residual) where new_residual = x + residual (or x).

    Computed in float32 (torch's fused rms_norm upcasts half inputs) and rounded once, to the
    wider of x's and the weight's dtypes.
    """
    if residual is not None:
        x = x + residual
    dtype = x.dtype if x.dtype == weight.dtype else torch.promote_types(x.dtype, weight.dtype)
    return F.rms_norm(cast(x, dtype), x.shape[-1:], cast(weight, dtype), eps), x


# ---------------------------------------------------------------------------------------------
# Triton implementation: one program per row. With a residual, the add, the statistics and the
# scaling happen in one pass (read x and residual once, write the sum and the normed row once)
# instead of the three passes the torch version makes.
# ---------------------------------------------------------------------------------------------

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from qrun.kernels.launch import Launch, gpu_options  # noqa: E402


@triton.jit
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr,
    stride_x, stride_r, stride_o, stride_s,
    hidden, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(sum_ptr.dtype.element_ty)  # rounded like x + residual
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    variance = tl.sum(xf * xf, 0) / hidden
    normed = (xf * tl.math.rsqrt(variance + eps)).to(sum_ptr.dtype.element_ty)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0)
    out = w.to(tl.float32) * normed.to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_launches(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    new_residual: torch.Tensor | None = None,
) -> list[Launch]:
    """The launch `rms_norm_triton` runs: one program per row of x [rows, hidden] (contiguous
    rows), writing `out` and, with a residual, `new_residual` (allocated when None)."""
    rows, hidden = x.shape
    if residual is None:
        r2 = sum2 = x  # not read / written; sum2 only carries x's dtype into the kernel
    else:
        r2 = residual
        sum2 = new_residual if new_residual is not None else torch.empty(
            x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    if out is None:
        out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, sum2.dtype), device=x.device)
    block = triton.next_power_of_2(hidden)
    return [Launch(_rms_norm_kernel, (rows,),
                   (x, r2, weight, out, sum2, x.stride(0), r2.stride(0), out.stride(0), sum2.stride(0), hidden, eps),
                   dict(HAS_RESIDUAL=residual is not None, BLOCK=block),
                   gpu_options(_rms_norm_kernel, num_warps=min(16, max(1, block // 256))))]


def rms_norm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rms_norm_ref`: (weight * normed, x + residual or x)."""
    hidden = x.shape[-1]
    x2 = x.reshape(-1, hidden)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    new_residual, r2 = x, None
    if residual is not None:
        assert residual.shape == x.shape
        r2 = residual.reshape(-1, hidden)
        if r2.stride(-1) != 1:
            r2 = r2.contiguous()
        new_residual = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    out = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, new_residual.dtype), device=x.device)
    if x2.shape[0]:
        for launch in rms_norm_launches(x2, weight, eps, r2, out.view(-1, hidden), new_residual.view(-1, hidden)):
            launch.run()
    return out, new_residual
