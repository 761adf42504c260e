"""Paged attention on the CPU: decode rows in C++ (cpu_attention.cpp), prefill chunks in torch.

torch has no paged attention on the CPU. Its reference here (`paged_attention_ref`) gathers each
sequence's K/V blocks into new tensors, casts them to float32 and runs SDPA over decode
sequences grouped by length, ~20 small ops per group (in a microbenchmark on an AVX512 EPYC,
decoding 4 sequences of ~850 tokens cost ~380 us per layer that way: gather and cast 120, SDPA
260; the C++ kernel takes ~170 us). The C++ kernel reads every decode row's
keys and values once, in place in the cache blocks and in their stored dtype (float32,
bfloat16, float16, or the int8/int4 of `kernels/kv_quant.py`, dequantized as it reads), for all
decode rows of a step in one call: no gather, no padding, no grouping. Its threads are torch's
own (it links the OpenMP runtime torch loaded), split over (sequence, KV head) pairs.

The kernel is part of the C++ library `kernels/cpu_library.py` builds; where it cannot be
built the kernel table keeps the torch reference (`qrun.kernels.ops_for`).
"""

from __future__ import annotations

import torch

from qrun.kernels import cpu_library
from qrun.kernels.kv_quant import bits_of
from qrun.kernels.paged_attention import paged_attention_ref, prefill_attention_ref

_KV_KINDS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_INT_KINDS = {8: 3, 4: 4}
HEAD_DIMS = (64, 80, 96, 128, 256)  # instantiated in cpu_attention.cpp; others run the torch reference


def _kv_kind(cache: torch.Tensor, scales: torch.Tensor | None) -> int:
    return _KV_KINDS[cache.dtype] if scales is None else _INT_KINDS[bits_of(cache)]


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float,
                      k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> torch.Tensor:
    """float32 [T, Hq, D]: the attention of every row whose sequence decodes one token; rows of
    longer queries (prefill chunks) are left unwritten for the caller."""
    queries = q.to(torch.float32).contiguous()
    out = torch.empty_like(queries)
    tables = block_tables.to(torch.int32).contiguous()
    lens, starts = seq_lens.to(torch.int32).contiguous(), query_start_loc.to(torch.int32).contiguous()
    _, block_size, num_kv_heads, _ = k_cache.shape
    dim = q.shape[-1]
    group = dim if k_scales is None else dim // k_scales.shape[-2]
    status = cpu_library.library().qrun_decode_attention(
        _kv_kind(k_cache, k_scales), queries.data_ptr(), out.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        _pointer(k_scales), _pointer(v_scales), tables.data_ptr(), tables.shape[1], lens.data_ptr(),
        starts.data_ptr(), tables.shape[0], q.shape[1], num_kv_heads, dim, block_size.bit_length() - 1, group, scale,
        torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"qrun_decode_attention rejected a {k_cache.dtype} cache of head_dim {dim} "
                           f"(status {status})")
    return out


# The kernel as an op, so a compiled decode step keeps it as one call (Inductor cannot trace ctypes).
_ops = torch.library.Library("qrun", "FRAGMENT")
_ops.define("decode_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
            "Tensor query_start_loc, float scale, Tensor? k_scales, Tensor? v_scales) -> Tensor")
_ops.impl("decode_attention", _decode_attention, "CPU")


@torch.library.register_fake("qrun::decode_attention")
def _decode_attention_shape(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scales, v_scales):
    return q.new_empty(q.shape, dtype=torch.float32)


def _kernel_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor | None,
                  v_scales: torch.Tensor | None) -> bool:
    """Whether the kernel has an instantiation for this head_dim and cache dtype, and the cache
    is laid out as it reads it (contiguous blocks)."""
    tensors = [t for t in (k_cache, v_cache, k_scales, v_scales) if t is not None]
    kind_known = k_cache.dtype in _KV_KINDS if k_scales is None else k_cache.dtype in (torch.int8, torch.uint8)
    return q.shape[-1] in HEAD_DIMS and kind_known and all(t.is_contiguous() for t in tensors)


def paged_attention_cpu(
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
    """`paged_attention_ref`'s signature and result: decode rows through the C++ kernel, prefill
    chunks through the reference (SDPA per chunk)."""
    if not _kernel_takes(q, k_cache, v_cache, k_scales, v_scales):
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                                   max_seq_len, scale, out, k_scales, v_scales)
    args = (q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, k_scales, v_scales)
    if torch.compiler.is_compiling():
        decoded = torch.ops.qrun.decode_attention(*args)
    else:  # the op's dispatch costs more than the call
        decoded = _decode_attention(*args)
    out = decoded.to(q.dtype) if out is None else out.copy_(decoded)
    if max_query_len > 1:
        prefill_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale, out,
                              k_scales, v_scales)
    return out
