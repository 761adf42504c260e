"""Matmul against mixed-bit packed weights (layout: docs/FORMAT.md, "Packed linear").

`dequant_matmul_ref` is the plain reference: unpack every group, dequantize to float32, undo
nothing (the activations are gathered into permuted order instead), one matmul. A GPU kernel
takes the same arguments and returns the same result.
"""

from __future__ import annotations

import torch

CHUNK = 32
# Group scales and mins are 8-bit codes against one float16 range per output column:
# scale = code / SCALE_LEVELS * scale_max[n] (uint8), min = code / MIN_LEVELS * min_absmax[n] (int8).
SCALE_LEVELS = 255
MIN_LEVELS = 127


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
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


def group_values(codes: torch.Tensor, column_range: torch.Tensor, levels: int) -> torch.Tensor:
    """8-bit group codes [G, N] -> float32 values: code * (column_range[n] / levels)."""
    return codes.float() * (column_range.float() / levels)


def dequantize_ref(qweight: torch.Tensor, qgroups: torch.Tensor, scales: torch.Tensor, scale_max: torch.Tensor,
                   mins: torch.Tensor | None, min_absmax: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """Packed weights -> float32 [K, N] in permuted input order.

    qweight int32 [R, N]; qgroups int32 [G, 2] = (bits, first qweight row) per group;
    scales uint8 [G, N] with scale_max float16 [N]; mins int8 [G, N] with min_absmax float16 [N],
    or both None (values: `group_values`). Asymmetric groups: w = q*scale + min; symmetric:
    w = (q - 2^(bits-1)) * scale.
    """
    scales = group_values(scales, scale_max, SCALE_LEVELS)
    mins = None if mins is None else group_values(mins, min_absmax, MIN_LEVELS)
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
        q = unpack_rows(qweight[row:row + words], bits).float()
        s = scales[g:end].repeat_interleave(group_size, 0)
        if mins is not None:
            w = q * s + mins[g:end].repeat_interleave(group_size, 0)
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
    scale_max: torch.Tensor,
    mins: torch.Tensor | None,
    min_absmax: torch.Tensor | None,
    perm: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y[M, N] = x[M, K] @ W.T (+ bias), W given packed (see dequantize_ref); computed in
    float32, returned in x.dtype. perm [K] (int16/int32): packed row i multiplies input column perm[i].
    """
    w = dequantize_ref(qweight, qgroups, scales, scale_max, mins, min_absmax, group_size)
    y = x[:, perm.long()].float() @ w
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Triton implementation
# ---------------------------------------------------------------------------------------------
#
# Both kernels walk the packed rows group by group (each group's width and first word come from
# qgroups at run time, so one compiled kernel serves any mix of widths) and 32-row chunk by
# chunk: row j of a chunk is the `bits`-wide field at bit j*bits of the chunk's words, read as
# (lo >> s) | (hi << (32 - s)) where it straddles two words. A chunk's words for BLOCK_N columns
# are gathered once per program (the repeated rows of the gather hit L1), dequantized to fp32
# with the group's scale/min (8-bit codes times the column's step), and multiplied with the
# activations gathered through `perm`.
#
# - GEMV path (M <= 4, decode): no tensor cores, an fp32 broadcast-multiply-reduce into an
#   [M, BLOCK_N] accumulator; the grid is (N / BLOCK_N, SPLIT_K) where SPLIT_K cuts the groups
#   into ranges when N alone can't fill the GPU. Each weight byte is read from DRAM once; the
#   SPLIT_K fp32 partials ([SPLIT_K, M, N], tiny) are summed afterwards.
# - Tiled path (larger M): tl.dot on [BLOCK_M, 32] x [32, BLOCK_N] tiles (dequantized weights
#   cast to the activation dtype, fp32 accumulation), autotuned over tile shapes on a GPU.

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from qrun.kernels.launch import Launch, fits_device, is_interpreted, sm_count  # noqa: E402

_SCALE_LEVELS = tl.constexpr(SCALE_LEVELS)
_MIN_LEVELS = tl.constexpr(MIN_LEVELS)


@triton.jit
def _column_steps(smax_ptr, mmax_ptr, cols, col_mask, HAS_MINS: tl.constexpr):
    """Each column's value of one scale code and of one min code (fp32 [BLOCK_N])."""
    sstep = tl.load(smax_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) / _SCALE_LEVELS
    mstep = sstep
    if HAS_MINS:
        mstep = tl.load(mmax_ptr + cols, mask=col_mask, other=0.0).to(tl.float32) / _MIN_LEVELS
    return sstep, mstep


@triton.jit
def _group_params(scales_ptr, mins_ptr, offset, cols, col_mask, sstep, mstep, HAS_MINS: tl.constexpr):
    """One group's fp32 scale and min [BLOCK_N] from its 8-bit codes (min = scale without mins)."""
    scale = tl.load(scales_ptr + offset + cols, mask=col_mask, other=0).to(tl.float32) * sstep
    minv = scale
    if HAS_MINS:
        minv = tl.load(mins_ptr + offset + cols, mask=col_mask, other=0).to(tl.float32) * mstep
    return scale, minv


@triton.jit
def _dequant_chunk(qw_ptr, stride_qw, word0, bits, cols, col_mask, scale, minv, HAS_MINS: tl.constexpr):
    """Dequantized fp32 [32, BLOCK_N] of the chunk whose first word row is word0."""
    j = tl.arange(0, 32)
    off = j * bits
    word = word0 + off // 32
    shift = off % 32
    straddle = shift + bits > 32
    ptr = qw_ptr + word.to(tl.int64)[:, None] * stride_qw + cols[None, :]
    lo = tl.load(ptr, mask=col_mask[None, :], other=0).to(tl.uint32, bitcast=True)
    hi = tl.load(ptr + stride_qw, mask=straddle[:, None] & col_mask[None, :], other=0).to(tl.uint32, bitcast=True)
    value = lo >> shift.to(tl.uint32)[:, None]
    value = value | tl.where(straddle[:, None], hi << ((32 - shift) % 32).to(tl.uint32)[:, None], 0)
    q = (value & ((1 << bits) - 1).to(tl.uint32)).to(tl.float32)
    if HAS_MINS:
        w = q * scale[None, :] + minv[None, :]
    else:
        w = (q - (1 << (bits - 1)).to(tl.float32)) * scale[None, :]
    return w


@triton.jit
def _dq_gemv_kernel(
    x_ptr, qw_ptr, qgroups_ptr, scales_ptr, smax_ptr, mins_ptr, mmax_ptr, perm_ptr, part_ptr,
    M, N, num_groups, groups_per_split,
    stride_xm, stride_qw, stride_s, stride_pk, stride_pm,
    GROUP_SIZE: tl.constexpr, HAS_MINS: tl.constexpr, M_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    rows_m = tl.arange(0, M_PAD)
    m_mask = rows_m < M
    j = tl.arange(0, 32)
    acc = tl.zeros([M_PAD, BLOCK_N], tl.float32)
    sstep, mstep = _column_steps(smax_ptr, mmax_ptr, cols, col_mask, HAS_MINS)
    g_lo = split * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, num_groups)
    for g in range(g_lo, g_hi):
        bits = tl.load(qgroups_ptr + 2 * g)
        word0 = tl.load(qgroups_ptr + 2 * g + 1)
        scale, minv = _group_params(scales_ptr, mins_ptr, g * stride_s, cols, col_mask, sstep, mstep, HAS_MINS)
        for c in range(GROUP_SIZE // 32):
            w = _dequant_chunk(qw_ptr, stride_qw, word0 + c * bits, bits, cols, col_mask, scale, minv, HAS_MINS)
            k_idx = tl.load(perm_ptr + g * GROUP_SIZE + c * 32 + j).to(tl.int64)
            xk = tl.load(x_ptr + rows_m[:, None] * stride_xm + k_idx[None, :], mask=m_mask[:, None], other=0.0)
            acc += tl.sum(xk.to(tl.float32)[:, :, None] * w[None, :, :], 1)
    out = part_ptr + split * stride_pk + rows_m[:, None] * stride_pm + cols[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & col_mask[None, :])


@triton.jit
def _dq_mm_kernel(
    x_ptr, qw_ptr, qgroups_ptr, scales_ptr, smax_ptr, mins_ptr, mmax_ptr, perm_ptr, bias_ptr, y_ptr,
    M, N, num_groups,
    stride_xm, stride_qw, stride_s, stride_ym,
    M_BUCKET,  # unused by the kernel: the autotuner's key, so M need not match exactly
    GROUP_SIZE: tl.constexpr, HAS_MINS: tl.constexpr, HAS_BIAS: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rows_m < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    j = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    sstep, mstep = _column_steps(smax_ptr, mmax_ptr, cols, col_mask, HAS_MINS)
    x_rows = x_ptr + rows_m.to(tl.int64)[:, None] * stride_xm
    for g in range(0, num_groups):
        bits = tl.load(qgroups_ptr + 2 * g)
        word0 = tl.load(qgroups_ptr + 2 * g + 1)
        scale, minv = _group_params(scales_ptr, mins_ptr, g * stride_s, cols, col_mask, sstep, mstep, HAS_MINS)
        for c in range(GROUP_SIZE // 32):
            w = _dequant_chunk(qw_ptr, stride_qw, word0 + c * bits, bits, cols, col_mask, scale, minv, HAS_MINS)
            k_idx = tl.load(perm_ptr + g * GROUP_SIZE + c * 32 + j).to(tl.int64)
            xk = tl.load(x_rows + k_idx[None, :], mask=m_mask[:, None], other=0.0)
            if DOT_F32:
                acc += tl.dot(xk.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(xk, w.to(xk.dtype))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    out = y_ptr + rows_m.to(tl.int64)[:, None] * stride_ym + cols[None, :]
    tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=m_mask[:, None] & col_mask[None, :])


def _mm_configs():
    configs = []
    for bm, bn, warps, stages in [(16, 64, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3),
                                  (128, 64, 4, 3), (128, 128, 8, 3), (32, 128, 4, 4), (64, 256, 8, 3)]:
        configs.append(triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=warps, num_stages=stages))
    return configs


def configs_for_rows(configs: list, m: int) -> list:
    """The tiles worth trying at M rows: ones much taller than M only waste tensor-core work
    (at least one is kept)."""
    kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, triton.next_power_of_2(m))]
    return kept or configs[:1]


def config_launch(config, named_args: dict, constexprs: dict) -> Launch:
    """The launch of `_dq_mm_kernel` with one autotuner config (the grid does not matter here)."""
    return Launch(_dq_mm_kernel, (1,), tuple(named_args.values()), {**constexprs, **config.kwargs},
                  dict(num_warps=config.num_warps, num_stages=config.num_stages))


def _prune_mm_configs(configs, named_args, **launch_kwargs):
    kept = configs_for_rows(configs, named_args["M"])
    device = named_args["x_ptr"].device
    if device.type != "cuda":
        return kept
    # The autotuner passes its whole launch (grid and warmup included); the fit check compiles
    # the kernel alone, with its own parameters.
    constexprs = {name: value for name, value in launch_kwargs.items() if name in _dq_mm_kernel.arg_names}
    # Tiles that spill or overflow shared memory on this GPU (Turing, for the larger ones) are
    # not timed at all; the smallest stays if none fits.
    fitting = [c for c in kept if fits_device(config_launch(c, named_args, constexprs), device)]
    return fitting or kept[:1]


_dq_mm_tuned = triton.autotune(
    configs=_mm_configs(),
    key=["M_BUCKET", "N", "num_groups", "GROUP_SIZE", "HAS_MINS"],
    prune_configs_by={"early_config_prune": _prune_mm_configs},
)(_dq_mm_kernel)

GEMV_MAX_M = 4


def gemv_split_k(n: int, num_groups: int, sms: int) -> int:
    """Groups are cut into this many ranges so that about two programs run per SM (a count
    that leaves no range empty)."""
    want = triton.cdiv(2 * sms, triton.cdiv(n, GEMV_BLOCK_N))
    groups_per_split = triton.cdiv(num_groups, max(1, min(want, num_groups)))
    return triton.cdiv(num_groups, groups_per_split)


GEMV_BLOCK_N = 64


def dequant_matmul_launches(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qgroups: torch.Tensor,
    scales: torch.Tensor,
    scale_max: torch.Tensor,
    mins: torch.Tensor | None,
    min_absmax: torch.Tensor | None,
    perm: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None,
    out: torch.Tensor | None = None,
    *,
    sms: int,
    every_config: bool = False,
) -> list[Launch]:
    """The launch `dequant_matmul_triton` runs for x [M, K], writing `out`: the fp32 split-K
    partials [splits, M, N] at M <= GEMV_MAX_M, y [M, N] above (allocated here when None, as the
    ahead-of-time check does on meta tensors). Above GEMV_MAX_M the autotuner picks a tile;
    `every_config` lists one launch per tile it may time instead (before dropping the tiles
    that do not fit the device)."""
    m, k = x.shape
    n = qweight.shape[1]
    num_groups = qgroups.shape[0]
    interpreted = is_interpreted(_dq_mm_kernel)
    mins_arg = mins if mins is not None else scales
    min_absmax_arg = min_absmax if mins is not None else scale_max
    has_mins = dict(GROUP_SIZE=group_size, HAS_MINS=mins is not None)
    if m <= GEMV_MAX_M:
        part = out if out is not None else torch.empty(gemv_split_k(n, num_groups, sms), m, n, dtype=torch.float32,
                                                       device=x.device)
        split_k = part.shape[0]
        block_n = GEMV_BLOCK_N if not interpreted else 32
        return [Launch(
            _dq_gemv_kernel, (triton.cdiv(n, block_n), split_k),
            (x, qweight, qgroups, scales, scale_max, mins_arg, min_absmax_arg, perm, part,
             m, n, num_groups, triton.cdiv(num_groups, split_k),
             x.stride(0), qweight.stride(0), scales.stride(0), part.stride(0), part.stride(1)),
            dict(**has_mins, M_PAD=triton.next_power_of_2(m), BLOCK_N=block_n),
        )]
    y = out if out is not None else torch.empty(m, n, dtype=x.dtype, device=x.device)
    args = (x, qweight, qgroups, scales, scale_max, mins_arg, min_absmax_arg, perm,
            bias if bias is not None else scale_max, y,
            m, n, num_groups, x.stride(0), qweight.stride(0), scales.stride(0), y.stride(0),
            min(triton.next_power_of_2(m), 4096))
    constexprs = dict(**has_mins, HAS_BIAS=bias is not None)
    if interpreted:
        return [Launch(_dq_mm_kernel, (triton.cdiv(m, 16), triton.cdiv(n, 32)), args,
                       dict(**constexprs, DOT_F32=True, BLOCK_M=16, BLOCK_N=32))]
    constexprs["DOT_F32"] = x.dtype == torch.float32
    if every_config:
        return [Launch(_dq_mm_kernel, (triton.cdiv(m, c.kwargs["BLOCK_M"]), triton.cdiv(n, c.kwargs["BLOCK_N"])),
                       args, {**constexprs, **c.kwargs}, dict(num_warps=c.num_warps, num_stages=c.num_stages))
                for c in configs_for_rows(_dq_mm_tuned.configs, m)]

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))
    return [Launch(_dq_mm_tuned, grid, args, constexprs)]


def dequant_matmul_triton(
    x: torch.Tensor,
    qweight: torch.Tensor,
    qgroups: torch.Tensor,
    scales: torch.Tensor,
    scale_max: torch.Tensor,
    mins: torch.Tensor | None,
    min_absmax: torch.Tensor | None,
    perm: torch.Tensor,
    group_size: int,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Same contract as `dequant_matmul_ref`: y[M, N] in x.dtype, fp32 accumulation."""
    assert x.dim() == 2 and group_size % 32 == 0
    m, k = x.shape
    n = qweight.shape[1]
    assert qgroups.shape[0] * group_size == k, "perm / group layout does not cover x's columns"
    if m == 0:
        return torch.empty(0, n, dtype=x.dtype, device=x.device)
    if x.stride(-1) != 1:
        x = x.contiguous()
    qweight, qgroups, scales, scale_max, perm = (t.contiguous() for t in (qweight, qgroups, scales, scale_max, perm))
    mins, min_absmax = (None if t is None else t.contiguous() for t in (mins, min_absmax))
    sms = sm_count(x.device)
    if m > GEMV_MAX_M:
        out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(gemv_split_k(n, qgroups.shape[0], sms), m, n, dtype=torch.float32, device=x.device)
    for launch in dequant_matmul_launches(x, qweight, qgroups, scales, scale_max, mins, min_absmax, perm, group_size,
                                          bias, out, sms=sms):
        launch.run()
    if m > GEMV_MAX_M:
        return out
    y = out[0] if out.shape[0] == 1 else out.sum(0)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
