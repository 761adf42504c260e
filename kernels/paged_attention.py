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

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from qrun.kernels.dtype import cast
from qrun.kernels.kv_quant import dequantize_kv_ref


@dataclass
class _DecodeGroup:
    """Decoding sequences of similar context length, attended together padded to the longest."""

    rows: torch.Tensor | None  # [b] query rows (one per sequence); None: every row of the step, in order
    blocks: torch.Tensor  # [b * w] their first w blocks, sequence by sequence
    length: int  # w * block_size
    mask: torch.Tensor | None  # [b, 1, 1, length] True where a key exists; None when none is padding


@dataclass
class _PrefillChunk:
    rows: slice  # the chunk's query rows
    blocks: torch.Tensor  # [w] blocks holding its context
    length: int  # context length, the chunk included
    mask: torch.Tensor | None  # [n, length] causal mask after a cached prefix; None: plain causal


@dataclass
class _AttentionPlan:
    """Everything about a step's attention that depends only on the metadata, worked out once
    per step and reused by every layer (the metadata tensors are the same objects each layer)."""

    key: tuple
    tensors: tuple[torch.Tensor, ...]  # the metadata the key names, kept alive (see _plan_key)
    decode_groups: list[_DecodeGroup]
    prefills: list[_PrefillChunk]


# Padding a decode group may add to its real context before a new group starts: one batched
# attention over a little padding beats more, smaller ones (at 32 mixed-length sequences: 7
# groups, 1.25x the real keys, 1.35x faster than a padding-free segment softmax).
MAX_GROUP_PADDING = 1.25
_last_plan: _AttentionPlan | None = None


def _plan_key(*tensors: torch.Tensor) -> tuple:
    # The plan holds the tensors, so their ids cannot be reused while it is cached. Metadata is
    # built anew each step and never edited in place (inference tensors keep no version count).
    return tuple(id(t) for t in tensors)


def _decode_groups(decodes: list[int], lens: list[int], block_tables: torch.Tensor, block_size: int,
                   query_rows: list[int]) -> list[_DecodeGroup]:
    device = block_tables.device
    by_length = sorted(decodes, key=lambda s: lens[s], reverse=True)
    members: list[list[int]] = []
    real = 0  # keys the newest group really holds
    for s in by_length:
        if members:
            group = members[-1]
            padded = -(-lens[group[0]] // block_size) * block_size * (len(group) + 1)
            if padded <= MAX_GROUP_PADDING * (real + lens[s]):
                group.append(s)
                real += lens[s]
                continue
        members.append([s])
        real = lens[s]
    groups = []
    for group in members:
        width = -(-lens[group[0]] // block_size)  # the longest comes first
        group.sort(key=lambda s: query_rows[s])  # in row order a group of every row needs no gather
        length = width * block_size
        index = torch.tensor(group, dtype=torch.long, device=device)
        group_lens = torch.tensor([lens[s] for s in group], device=device)
        full = all(lens[s] == length for s in group)
        mask = None if full else (torch.arange(length, device=device)[None, :] < group_lens[:, None])[:, None, None, :]
        rows = [query_rows[s] for s in group]
        every_row = rows == list(range(query_rows[-1]))
        groups.append(_DecodeGroup(None if every_row else torch.tensor(rows, dtype=torch.long, device=device),
                                   block_tables[index, :width].flatten().long(), length, mask))
    return groups


def _attention_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    block_size: int) -> _AttentionPlan:
    global _last_plan
    key = _plan_key(block_tables, seq_lens, query_start_loc) + (block_size,)
    cached = _last_plan  # one read: another thread's engine may replace it meanwhile
    if cached is not None and cached.key == key:
        return cached
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    query_lens = [b - a for a, b in zip(starts, starts[1:])]
    decodes = [s for s, n in enumerate(query_lens) if n == 1]
    device = block_tables.device
    prefills = []
    for s, n in enumerate(query_lens):
        if n <= 1:
            continue
        length = lens[s]
        mask = None  # a whole prompt: SDPA's own causal mask (up to 1.4x faster than an explicit one)
        if length > n:
            query_pos = torch.arange(length - n, length, device=device)
            mask = torch.arange(length, device=device)[None, :] <= query_pos[:, None]
        blocks = block_tables[s, :-(-length // block_size)].long()
        prefills.append(_PrefillChunk(slice(starts[s], starts[s + 1]), blocks, length, mask))
    groups = _decode_groups(decodes, lens, block_tables, block_size, starts) if decodes else []
    plan = _AttentionPlan(key, (block_tables, seq_lens, query_start_loc), groups, prefills)
    _last_plan = plan
    return plan


def _compute_dtype(q: torch.Tensor, cache: torch.Tensor) -> torch.dtype:
    # torch's CPU attention is slower in bfloat16 than in float32 (decode at batch 1: 1.7x), more
    # than the cast of the gathered K/V costs: on the CPU a half-precision cache computes in float32.
    if cache.device.type == "cpu":
        return torch.float32
    return cache.dtype if cache.is_floating_point() else q.dtype


def _context(cache: torch.Tensor, scales: torch.Tensor | None, blocks: torch.Tensor, sequences: int,
             length: int, dtype: torch.dtype) -> torch.Tensor:
    """K or V of `sequences` sequences through their blocks, in `dtype`, head-major:
    [sequences, Hkv, length, D]."""
    gathered = cache.index_select(0, blocks)
    if scales is None:
        gathered = cast(gathered, dtype)
    else:
        gathered = dequantize_kv_ref(gathered, scales.index_select(0, blocks), dtype)
    return gathered.view(sequences, -1, *gathered.shape[2:]).transpose(1, 2)[:, :, :length]


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
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Torch reference: decodes in a few batched groups of similar length, prefill chunks one by
    one (`prefill_attention_ref`: below the Triton kernels, whose cache keys count the lines
    above them, so this file keeps its line count here and the GPU-compile check its cache).
    With scales the cache is quantized (`kernels/kv_quant.py`) and read dequantized.
    On the CPU the kernel table runs `kernels/cpu_attention.py` instead, for decode rows.
    Returns `out` (a new tensor when it is None) with every row of q attended."""
    plan = _attention_plan(block_tables, seq_lens, query_start_loc, k_cache.shape[1])
    dtype = _compute_dtype(q, k_cache)
    queries = cast(q, dtype)
    for group in plan.decode_groups:
        group_queries = queries if group.rows is None else queries[group.rows]
        b = group_queries.shape[0]
        k = _context(k_cache, k_scales, group.blocks, b, group.length, dtype)
        v = _context(v_cache, v_scales, group.blocks, b, group.length, dtype)
        attended = cast(F.scaled_dot_product_attention(group_queries.unflatten(1, (k.shape[1], -1)), k, v,
                                                       attn_mask=group.mask, scale=scale).flatten(1, 2), q.dtype)
        if group.rows is None and out is None:  # the whole step in one group: no scatter
            return attended
        if out is None:
            out = torch.empty_like(q)
        out[slice(None) if group.rows is None else group.rows] = attended
    if out is None:
        out = torch.empty_like(q)
    if plan.prefills:  # the plan is cached: prefill_attention_ref looks up this one
        prefill_attention_ref(queries, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                              k_scales, v_scales)
    return out


import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from qrun.kernels.kv_quant import bits_of, load_dequantized  # noqa: E402
from qrun.kernels.launch import Launch, fits_device, gpu_options, is_interpreted, sm_count  # noqa: E402

_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_loc_ptr, slot, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest s with query_start_loc[s] // BLOCK_Q + s <= slot (binary search)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi + 1) // 2
        start = tl.load(query_start_loc_ptr + mid)
        if start // BLOCK_Q + mid <= slot:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _paged_attn_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scales_ptr, v_scales_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    out_ptr, part_acc_ptr, part_ml_ptr,
    num_seqs, scale_log2, tiles_per_split,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_vb, stride_vt, stride_vh,
    stride_ksb, stride_kst, stride_ksh,
    stride_vsb, stride_vst, stride_vsh,
    stride_bt,
    stride_ot, stride_oh,
    stride_pat, stride_pah, stride_pas,
    stride_pmt, stride_pmh, stride_pms,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr, QPK: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, DOT_F32: tl.constexpr,
    PRECISION: tl.constexpr, KV_BITS: tl.constexpr, KV_GROUP: tl.constexpr,
):
    slot = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq = _find_seq(query_start_loc_ptr, slot, num_seqs - 1, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_start = (slot - (q_start // BLOCK_Q + seq)) * BLOCK_Q
    if q_block_start >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_before = seq_len - q_len  # cached tokens before this step's queries

    rows = tl.arange(0, BLOCK_M)
    tok = q_block_start + rows // QPK  # token index within the sequence's query chunk
    head = kv_head * QPK + rows % QPK
    row_valid = (rows // QPK < BLOCK_Q) & (tok < q_len)
    q_pos = context_before + tok  # absolute position; attends keys 0 ..= q_pos
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM

    q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & dim_valid[None, :], other=0.0)
    if DOT_F32:
        q = q.to(tl.float32)

    # Keys this block needs: up to the last valid query's position.
    kv_len = context_before + tl.minimum(q_block_start + BLOCK_Q, q_len)
    num_tiles = tl.cdiv(kv_len, BLOCK_N)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    cols = tl.arange(0, BLOCK_N)
    for tile in range(tile_lo, tile_hi):
        key_pos = tile * BLOCK_N + cols
        key_valid = key_pos < kv_len
        block = tl.load(table + key_pos // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
        in_block = key_pos % BLOCK_SIZE
        kv_mask = key_valid[None, :] & dim_valid[:, None]
        k_base = block[None, :] * stride_kb + in_block[None, :] * stride_kt + kv_head * stride_kh
        v_base = block[:, None] * stride_vb + in_block[:, None] * stride_vt + kv_head * stride_vh
        if KV_BITS == 0:
            k = tl.load(k_cache_ptr + k_base + dims[:, None], mask=kv_mask, other=0.0)  # [D, BLOCK_N]
            v = tl.load(v_cache_ptr + v_base + dims[None, :], mask=key_valid[:, None] & dim_valid[None, :],
                        other=0.0)  # [BLOCK_N, D]
        else:  # dequantized in float32, then in q's dtype for the dot
            k_scale_base = block[None, :] * stride_ksb + in_block[None, :] * stride_kst + kv_head * stride_ksh
            v_scale_base = block[:, None] * stride_vsb + in_block[:, None] * stride_vst + kv_head * stride_vsh
            k = load_dequantized(k_cache_ptr, k_scales_ptr, k_base, k_scale_base, dims[:, None], kv_mask,
                                 KV_BITS, KV_GROUP).to(q.dtype)
            v = load_dequantized(v_cache_ptr, v_scales_ptr, v_base, v_scale_base, dims[None, :],
                                 key_valid[:, None] & dim_valid[None, :], KV_BITS, KV_GROUP).to(q.dtype)
        if DOT_F32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, k, input_precision=PRECISION) * scale_log2  # log2 domain
        allowed = key_valid[None, :] & (key_pos[None, :] <= q_pos[:, None])
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # A row may see no allowed key in a tile (causal edge, or a whole split): keep the
        # reference point finite so exp2 gives 0, not NaN.
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new

    out_mask = row_valid[:, None] & dim_valid[None, :]
    if not SPLIT_K:
        out = acc / l_i[:, None]
        o_offs = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(out_ptr + o_offs, out.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        t64 = (q_start + tok).to(tl.int64)
        a_offs = t64[:, None] * stride_pat + head[:, None] * stride_pah + split * stride_pas + dims[None, :]
        tl.store(part_acc_ptr + a_offs, acc, mask=out_mask)
        ml_offs = t64 * stride_pmt + head * stride_pmh + split * stride_pms
        tl.store(part_ml_ptr + ml_offs, tl.where(l_i > 0, m_i, float("-inf")), mask=row_valid)
        tl.store(part_ml_ptr + ml_offs + 1, l_i, mask=row_valid)


@triton.jit
def _merge_splits_kernel(
    part_acc_ptr, part_ml_ptr, out_ptr,
    stride_pat, stride_pah, stride_pas,
    stride_pmt, stride_pmh, stride_pms,
    stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM_PAD)
    ml = part_ml_ptr + token * stride_pmt + head * stride_pmh + splits * stride_pms
    m = tl.load(ml, mask=split_valid, other=float("-inf"))
    l = tl.load(ml + 1, mask=split_valid, other=0.0)
    m_max = tl.max(m, 0)  # finite: every query sees at least its own key in some split
    w = tl.where(m > float("-inf"), tl.math.exp2(m - m_max), 0.0)
    a_offs = token * stride_pat + head * stride_pah + splits[:, None] * stride_pas + dims[None, :]
    acc = tl.load(part_acc_ptr + a_offs, mask=(w > 0)[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def num_kv_splits(programs: int, max_seq_len: int, block_n: int, sms: int) -> int:
    """How many KV chunks each program's work is split into (1: no split-K), on `sms` SMs.

    Split only when the un-split grid fills less than one wave of the GPU, and keep each split
    at least 4 tiles long so writing and merging its fp32 partial stays small next to the K/V
    it reads. A power of two up to MAX_KV_SPLITS, so few variants get compiled.
    """
    if programs >= sms:
        return 1
    want = triton.cdiv(2 * sms, programs)
    most = triton.cdiv(max_seq_len, block_n) // 4
    splits = min(want, most, MAX_KV_SPLITS)
    return 1 if splits < 2 else 1 << (splits.bit_length() - 1)


MAX_KV_SPLITS = 64


@dataclass(frozen=True)
class AttentionTiles:
    """How the attention kernel tiles its work: query rows and keys per program."""

    block_q: int  # tokens of one sequence per program
    block_m: int  # rows per program: block_q tokens x the QPK heads sharing a KV head, padded
    block_n: int  # keys per inner step


_UNPACKED_4BIT_VALUES = 4096


def attention_tile_candidates(head_dim: int, qpk: int, max_query_len: int, kv_bits: int = 0) -> list[AttentionTiles]:
    """Tile choices, fastest first: the launcher runs the first that fits the device.

    Prefill wants 64 rows per program (32 above head_dim 128) and decode 16; keys come 64 at a
    time (32 above head_dim 128). Turing's register file does not hold those tiles without
    spilling (`docs/KERNELS.md`), so the rows, then the keys, halve down to 16 x 16. A 4-bit
    cache's keys and values are unpacked in registers: tiles of more than 4096 of them (keys x
    head_dim) spilled on every target the AOT check compiles for (sm_80 to sm_90; head_dim 80,
    128, 256, decode and prefill), so they are not candidates there (each would be compiled at
    first use only to be passed over).
    """
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    target_rows = 16 if max_query_len <= 1 else (64 if head_dim_pad <= 128 else 32)
    block_n = 64 if head_dim_pad <= 128 else 32
    candidates = []
    while True:
        block_m = max(target_rows, triton.next_power_of_2(qpk))
        block_q = max(1, min(block_m // qpk, max_query_len))
        tiles = AttentionTiles(block_q, max(16, triton.next_power_of_2(block_q * qpk)), block_n)
        if tiles not in candidates and (kv_bits != 4 or block_n * head_dim_pad <= _UNPACKED_4BIT_VALUES):
            candidates.append(tiles)
        if target_rows > 16:
            target_rows //= 2
        elif block_n > 16:
            block_n //= 2
        else:
            return candidates


def paged_attention_launches(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    out: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    *,
    sms: int,
    fits: Callable[[Launch], bool] | None = None,
    tiles: AttentionTiles | None = None,
    num_splits: int | None = None,
) -> list[Launch]:
    """The launches `paged_attention_triton` runs (attention, then the split merge if any), for
    a device with `sms` SMs, with the first candidate tiles whose launches all satisfy `fits`
    (the last candidate when none does; the first when `fits` is None). `tiles` and
    `num_splits` override the choices. Works on meta tensors (nothing is read)."""
    if tiles is None:
        kv_bits = bits_of(k_cache) if k_scales is not None else 0
        candidates = attention_tile_candidates(q.shape[2], q.shape[1] // k_cache.shape[2], max_query_len, kv_bits)
        for tiles in candidates:
            launches = paged_attention_launches(
                q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len, scale,
                out, k_scales, v_scales, sms=sms, fits=fits, tiles=tiles, num_splits=num_splits)
            if fits is None or all(fits(launch) for launch in launches):
                return launches
        return launches
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    qpk = num_q_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    slots = num_tokens // tiles.block_q + num_seqs
    splits = num_splits or num_kv_splits(slots * num_kv_heads, max_seq_len, tiles.block_n, sms)
    tiles_per_split = triton.cdiv(triton.cdiv(max(max_seq_len, 1), tiles.block_n), splits)
    interpreted = is_interpreted(_paged_attn_kernel)
    dot_f32 = interpreted and q.dtype == torch.bfloat16  # the interpreter's bf16 tl.dot is wrong

    if splits > 1:
        part_acc = torch.empty(num_tokens, num_q_heads, splits, head_dim_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(num_tokens, num_q_heads, splits, 2, dtype=torch.float32, device=q.device)
        pa_strides = part_acc.stride()[:3]
        pm_strides = part_ml.stride()[:3]
    else:
        part_acc = part_ml = out  # unused
        pa_strides = pm_strides = (0, 0, 0)

    quantized = k_scales is not None
    ks, vs = (k_scales, v_scales) if quantized else (k_cache, v_cache)  # unread for a float cache
    launches = [Launch(
        _paged_attn_kernel, (slots, num_kv_heads, splits),
        (q, k_cache, v_cache, ks, vs, block_tables, seq_lens, query_start_loc,
         out, part_acc, part_ml,
         num_seqs, scale * _LOG2E, tiles_per_split,
         q.stride(0), q.stride(1),
         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
         v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
         *(ks.stride()[:3] if quantized else (0, 0, 0)), *(vs.stride()[:3] if quantized else (0, 0, 0)),
         block_tables.stride(0),
         out.stride(0), out.stride(1),
         *pa_strides, *pm_strides),
        dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, QPK=qpk,
             BLOCK_SIZE=block_size, BLOCK_Q=tiles.block_q, BLOCK_M=tiles.block_m,
             BLOCK_N=tiles.block_n, SPLIT_K=splits > 1, DOT_F32=dot_f32,
             # fp32 caches get exact fp32 products, not TF32 (which would cost ~3 digits).
             PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
             KV_BITS=bits_of(k_cache) if quantized else 0,
             KV_GROUP=head_dim // k_scales.shape[-2] if quantized else head_dim),
        gpu_options(_paged_attn_kernel, num_warps=4, num_stages=2),
    )]
    if splits > 1:
        splits_pad = triton.next_power_of_2(splits)
        launches.append(Launch(
            _merge_splits_kernel, (num_tokens, num_q_heads),
            (part_acc, part_ml, out, *pa_strides, *pm_strides, out.stride(0), out.stride(1)),
            dict(HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, NUM_SPLITS=splits, SPLITS_PAD=splits_pad),
            gpu_options(_merge_splits_kernel, num_warps=4),
        ))
    return launches


def paged_attention_triton(
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
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Triton flash attention over the paged cache; same contract as `paged_attention_ref`."""
    if out is None:
        out = torch.empty_like(q)
    num_tokens, num_q_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if num_tokens == 0 or seq_lens.shape[0] == 0:
        return out
    assert num_q_heads % num_kv_heads == 0, "Hq must be a multiple of Hkv"
    assert block_size & (block_size - 1) == 0, "block_size must be a power of two"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1 and out.stride(-1) == 1
    for launch in paged_attention_launches(
            q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len, max_seq_len, scale, out,
            k_scales, v_scales, sms=sm_count(q.device), fits=lambda launch: fits_device(launch, q.device)):
        launch.run()
    return out


def prefill_attention_ref(
    queries: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """`paged_attention_ref` for the rows of sequences with more than one query (prefill
    chunks), one SDPA per chunk, written into `out`; decode rows are left as they are."""
    dtype = _compute_dtype(queries, k_cache)
    queries = cast(queries, dtype)
    for chunk in _attention_plan(block_tables, seq_lens, query_start_loc, k_cache.shape[1]).prefills:
        k = _context(k_cache, k_scales, chunk.blocks, 1, chunk.length, dtype)
        v = _context(v_cache, v_scales, chunk.blocks, 1, chunk.length, dtype)
        attended = F.scaled_dot_product_attention(queries[chunk.rows].transpose(0, 1).unsqueeze(0), k, v,
                                                  attn_mask=chunk.mask, is_causal=chunk.mask is None, scale=scale,
                                                  enable_gqa=True)
        out[chunk.rows] = cast(attended[0].transpose(0, 1), out.dtype)
