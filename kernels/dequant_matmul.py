"""Matmul against mixed-bit packed weights (layout: docs/FORMAT.md, "Packed linear").

`dequant_matmul_ref` is the plain reference: unpack every group, dequantize to float32, undo
nothing (the activations are gathered into permuted order instead), one matmul. A GPU kernel
takes the same arguments and returns the same result.
"""

from __future__ import annotations

import torch

CHUNK = 32
UNPACK_SLICE_CODES = 1 << 20  # `unpack_rows`' int32 working set: 4 MiB
# Group scales and mins are 8-bit codes against one float16 range per output column:
# scale = code / SCALE_LEVELS * scale_max[n] (uint8), min = code / MIN_LEVELS * min_absmax[n] (int8).
SCALE_LEVELS = 255
MIN_LEVELS = 127


def unpack_rows(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [chunks*bits, N] -> uint8 [chunks*32, N]: row j of a 32-row chunk sits at bit j*bits.
    Unpacked UNPACK_SLICE_CODES codes at a time in int32: a load unpacks whole matrices, and a head's
    as int64 in one piece held ~9 bytes a code at once (a 4-bit 49152 x 576 head: +498 MB at the
    peak for 28 MB of codes)."""
    total, n = words.shape
    chunks = total // bits
    out = torch.empty(chunks, CHUNK, n, dtype=torch.uint8, device=words.device)
    mask = (1 << bits) - 1
    per_slice = max(1, UNPACK_SLICE_CODES // (CHUNK * n))
    for first in range(0, chunks, per_slice):
        w = words[first * bits:(first + per_slice) * bits].reshape(-1, bits, n)
        if 32 % bits == 0:  # no code crosses a word: every shift at once
            shifts = torch.arange(0, 32, bits, device=words.device, dtype=torch.int32).view(1, 1, -1, 1)
            out[first:first + per_slice] = ((w.unsqueeze(2) >> shifts) & mask).view(-1, CHUNK, n)
            continue
        for j in range(CHUNK):
            word, shift = divmod(j * bits, 32)
            value = w[:, word] >> shift  # arithmetic: the bits above 32 - shift copy the sign
            if shift + bits > 32:
                value = value & ((1 << (32 - shift)) - 1) | w[:, word + 1] << (32 - shift)
            out[first:first + per_slice, j] = value & mask
    return out.view(chunks * CHUNK, n)


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
# The kernels walk the packed rows group by group (each group's width and first word come from
# qgroups at run time, so one compiled kernel serves any mix of widths) and 32-row chunk by
# chunk: row j of a chunk is the `bits`-wide field at bit j*bits of the chunk's words, read as
# (lo >> s) | (hi << (32 - s)) where it straddles two words. A chunk's words for BLOCK_N columns
# are gathered once per program (the repeated rows of the gather hit L1), dequantized to fp32
# with the group's scale/min (8-bit codes times the column's step), and multiplied with the
# activations gathered through `perm`.
#
# A program's groups follow one another through dependent loads (a group's qgroups entry, then
# its words), so a GPU is busy only with many programs in flight: both product kernels cut the
# groups into ranges (split-K) until about PROGRAMS_PER_SM programs run on each SM, and write
# fp32 partials [splits, M, N] that are summed afterwards (at two programs per SM an H200 ran a
# 4096 x 4096 GEMV at 3% of its bytes floor, 3.7x slower than the bfloat16 dense product).
#
# - GEMV path (M <= 4, decode): no tensor cores, an fp32 broadcast-multiply-reduce into an
#   [M, BLOCK_N] accumulator. Each weight byte is read from DRAM once.
# - Tiled path (M <= TILED_MAX_M): tl.dot on [BLOCK_M, 32] x [32, BLOCK_N] tiles (dequantized
#   weights cast to the activation dtype, fp32 accumulation), autotuned over tile shapes on a GPU.
# - Above (prefill): the weight dequantized to the activations' dtype by `_dequantize_kernel`
#   (every group and column block at once) and multiplied by torch's matmul (cuBLAS), as the CPU
#   path does from 1024 rows: 32-row chunks are too thin a K for tensor cores to pay off in the
#   tiled kernel, and the dequantization costs one pass over the weight.

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
    x_ptr, qw_ptr, qgroups_ptr, scales_ptr, smax_ptr, mins_ptr, mmax_ptr, perm_ptr, part_ptr,
    M, N, num_groups, groups_per_split,
    stride_xm, stride_qw, stride_s, stride_pk, stride_pm,
    M_BUCKET,  # unused by the kernel: the autotuner's key, so M need not match exactly
    GROUP_SIZE: tl.constexpr, HAS_MINS: tl.constexpr, DOT_F32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = rows_m < M
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    j = tl.arange(0, 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    sstep, mstep = _column_steps(smax_ptr, mmax_ptr, cols, col_mask, HAS_MINS)
    x_rows = x_ptr + rows_m.to(tl.int64)[:, None] * stride_xm
    g_lo = split * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, num_groups)
    for g in range(g_lo, g_hi):
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
    out = part_ptr + split * stride_pk + rows_m.to(tl.int64)[:, None] * stride_pm + cols[None, :]
    tl.store(out, acc, mask=m_mask[:, None] & col_mask[None, :])


@triton.jit
def _dequantize_kernel(
    qw_ptr, qgroups_ptr, scales_ptr, smax_ptr, mins_ptr, mmax_ptr, w_ptr,
    N, stride_qw, stride_s, stride_w,
    GROUP_SIZE: tl.constexpr, HAS_MINS: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """w [K, N] (packed row order, w_ptr's dtype) = the weight of one group x BLOCK_N columns a program."""
    g = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    j = tl.arange(0, 32)
    sstep, mstep = _column_steps(smax_ptr, mmax_ptr, cols, col_mask, HAS_MINS)
    bits = tl.load(qgroups_ptr + 2 * g)
    word0 = tl.load(qgroups_ptr + 2 * g + 1)
    scale, minv = _group_params(scales_ptr, mins_ptr, g * stride_s, cols, col_mask, sstep, mstep, HAS_MINS)
    for c in range(GROUP_SIZE // 32):
        w = _dequant_chunk(qw_ptr, stride_qw, word0 + c * bits, bits, cols, col_mask, scale, minv, HAS_MINS)
        rows = (g * GROUP_SIZE + c * 32 + j).to(tl.int64)
        tl.store(w_ptr + rows[:, None] * stride_w + cols[None, :], w.to(w_ptr.dtype.element_ty),
                 mask=col_mask[None, :])


def _mm_configs():
    # (16, 64) comes with 8 warps too: with 4 it spills registers on sm_80 at groups of 128
    configs = []
    for bm, bn, warps, stages in [(16, 64, 4, 3), (16, 64, 8, 3), (32, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3),
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
    key=["M_BUCKET", "N", "num_groups", "groups_per_split", "GROUP_SIZE", "HAS_MINS"],
    prune_configs_by={"early_config_prune": _prune_mm_configs},
)(_dq_mm_kernel)

GEMV_MAX_M = 4
# TILED_MAX_M and PROGRAMS_PER_SM are not yet timed on a GPU (none was lent since they were set):
# scripts/gpu_check.py's dequant_matmul rows time the path not taken beside each size, to set them by.
TILED_MAX_M = 64  # above: dequantize, then torch's matmul
PROGRAMS_PER_SM = 16
GEMV_BLOCK_N = 64
# The tile split-K plans with (the autotuner picks the tile afterwards): the narrowest of _mm_configs.
SPLIT_BLOCK_M, SPLIT_BLOCK_N = 16, 64
DEQUANT_BLOCK_N = 128


def partial_splits(m: int, n: int, num_groups: int, weight_bytes: int, sms: int) -> int:
    """Ranges the groups of a product of m <= TILED_MAX_M rows are cut into: about
    PROGRAMS_PER_SM programs per SM, as long as the fp32 partials (written, then read) move no
    more bytes than the packed weight; a count that leaves no range empty."""
    column_programs = (triton.cdiv(n, GEMV_BLOCK_N) if m <= GEMV_MAX_M
                       else triton.cdiv(m, SPLIT_BLOCK_M) * triton.cdiv(n, SPLIT_BLOCK_N))
    want = min(triton.cdiv(PROGRAMS_PER_SM * sms, column_programs), weight_bytes // (8 * m * n), num_groups)
    groups_per_split = triton.cdiv(num_groups, max(1, want))
    return triton.cdiv(num_groups, groups_per_split)


def launch_output(x: torch.Tensor, qweight: torch.Tensor, qgroups: torch.Tensor, sms: int) -> torch.Tensor:
    """What `dequant_matmul_launches` writes for x [M, K]: the fp32 split-K partials
    [splits, M, N] at M <= TILED_MAX_M, else the dequantized weight [K, N] in x's dtype."""
    m, k = x.shape
    n = qweight.shape[1]
    if m > TILED_MAX_M:
        return torch.empty(k, n, dtype=x.dtype, device=x.device)
    return torch.empty(partial_splits(m, n, qgroups.shape[0], qweight.nbytes, sms), m, n, dtype=torch.float32,
                       device=x.device)


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
    out: torch.Tensor | None = None,
    *,
    sms: int,
    every_config: bool = False,
) -> list[Launch]:
    """The launch `dequant_matmul_triton` runs for x [M, K], writing `out` (`launch_output`'s;
    made here when None, as the ahead-of-time check does on meta tensors). Between
    GEMV_MAX_M and TILED_MAX_M the autotuner picks a tile; `every_config` lists one launch per
    tile it may time instead (before dropping the tiles that do not fit the device)."""
    m = x.shape[0]
    n = qweight.shape[1]
    num_groups = qgroups.shape[0]
    interpreted = is_interpreted(_dq_mm_kernel)
    mins_arg = mins if mins is not None else scales
    min_absmax_arg = min_absmax if mins is not None else scale_max
    has_mins = dict(GROUP_SIZE=group_size, HAS_MINS=mins is not None)
    groups = (qweight, qgroups, scales, scale_max, mins_arg, min_absmax_arg)
    out = out if out is not None else launch_output(x, qweight, qgroups, sms)
    if m > TILED_MAX_M:
        block_n = DEQUANT_BLOCK_N if not interpreted else 32
        return [Launch(_dequantize_kernel, (num_groups, triton.cdiv(n, block_n)),
                       (*groups, out, n, qweight.stride(0), scales.stride(0), out.stride(0)),
                       dict(**has_mins, BLOCK_N=block_n))]
    splits = out.shape[0]
    groups_per_split = triton.cdiv(num_groups, splits)
    strides = (x.stride(0), qweight.stride(0), scales.stride(0), out.stride(0), out.stride(1))
    if m <= GEMV_MAX_M:
        block_n = GEMV_BLOCK_N if not interpreted else 32
        return [Launch(
            _dq_gemv_kernel, (triton.cdiv(n, block_n), splits),
            (x, *groups, perm, out, m, n, num_groups, groups_per_split, *strides),
            dict(**has_mins, M_PAD=triton.next_power_of_2(m), BLOCK_N=block_n),
        )]
    args = (x, *groups, perm, out, m, n, num_groups, groups_per_split, *strides, min(triton.next_power_of_2(m), 4096))
    if interpreted:
        return [Launch(_dq_mm_kernel, (triton.cdiv(m, 16), triton.cdiv(n, 32), splits), args,
                       dict(**has_mins, DOT_F32=True, BLOCK_M=16, BLOCK_N=32))]
    constexprs = dict(**has_mins, DOT_F32=x.dtype == torch.float32)
    if every_config:
        return [Launch(_dq_mm_kernel,
                       (triton.cdiv(m, c.kwargs["BLOCK_M"]), triton.cdiv(n, c.kwargs["BLOCK_N"]), splits),
                       args, {**constexprs, **c.kwargs}, dict(num_warps=c.num_warps, num_stages=c.num_stages))
                for c in configs_for_rows(_dq_mm_tuned.configs, m)]

    def grid(meta):
        return (triton.cdiv(m, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]), splits)
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
    out = launch_output(x, qweight, qgroups, sms)
    for launch in dequant_matmul_launches(x, qweight, qgroups, scales, scale_max, mins, min_absmax, perm, group_size,
                                          out, sms=sms):
        launch.run()
    if m > TILED_MAX_M:  # out is the weight [K, N], whose rows multiply the inputs in perm's order
        x_packed_order = x[:, perm.long()]
        return x_packed_order @ out if bias is None else torch.addmm(bias.to(x.dtype), x_packed_order, out)
    y = out[0] if out.shape[0] == 1 else out.sum(0)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
