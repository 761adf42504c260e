"""Paged attention on the CPU in C++ (cpu_attention.cpp): decode rows and prefill chunks.

torch has no paged attention on the CPU. Its reference here (`paged_attention_ref`) gathers each
sequence's K/V blocks into new tensors, casts them to float32 and runs SDPA over decode
sequences grouped by length, ~20 small ops per group (in a microbenchmark on an AVX512 EPYC,
decoding 4 sequences of ~850 tokens cost ~380 us per layer that way: gather and cast 120, SDPA
260; the C++ kernel takes ~170 us). The C++ kernel reads every decode row's
keys and values once, in place in the cache blocks and in their stored dtype (float32,
bfloat16, float16, or the int8/int4 of `kernels/kv_quant.py`, dequantized as it reads), for all
decode rows of a step in one call: no gather, no padding, no grouping. Its threads are torch's
own (it links the OpenMP runtime torch loaded), split over chunks of up to 128 tokens of each
sequence, up to 512 where a sequence holds more than 128 a core, in a multiple of the cores (all KV
heads; beyond 96 tokens at least two halves, so one stream's attention uses two threads evenly;
`chunk_tokens` in the C++ says why), whose softmaxes are merged after, as flash-decoding does: a
long sequence uses every thread. Scores come 16 tokens at a time (their dot products' lanes summed
together rather than one horizontal sum each) and e^x by a polynomial the compiler vectorises.
Each cached row is converted to floats once, in registers, and used there by every query head of
a pack sharing its KV head (GQA: SmolLM2's 3 per KV head as one pack), whose queries or sums
stay in registers too. A bfloat16 row is unpacked beside zero words rather than widened and
shifted, its floats in a fixed order that the queries are put in once a chunk (and the weighted
sums taken out of): two unpacks per 32 values in place of a widening load and a shift for each 16
(`decode_row_vectors` in the C++). On a 2-core Xeon (bfloat16 cache,
SmolLM2's 9 query and 3 KV heads of 64): 32 sequences of 600 tokens took 0.77-0.84 ms per layer
(before that change), against 1.27 ms when each chunk's rows were first converted into a float
buffer and read back once per query head, and 2.0 ms for the kernel that looped (sequence, KV
head) pairs with a horizontal sum per token; 4 of 1,500 0.21 against 0.36 and 0.62 ms.

Prefill chunks (sequences with more than one query in the step) are a matrix product rather than
a dot product per row: the kernel puts 16 query vectors in a vector's lanes (a chunk's rows times
the query heads of one KV head) and multiplies each by a key's or value's element broadcast, so
scores, the online softmax and the weighted sums are lanewise multiply-adds with no horizontal
sums, each cached row read once per 16-48 queries. A bfloat16 cache on a CPU with AVX512-BF16
multiplies pairs (`vdpbf16ps`: queries and softmax weights rounded to bfloat16, as a GPU's flash
attention multiplies them); other caches convert rows to float32. Every query's keys pass in
tiles of 16 from the sequence's first, so a prompt attends to the same bits however the scheduler
cut it into chunks. Against torch's SDPA on the chunk's gathered, float32-cast K/V (the
reference), one layer of SmolLM2's heads on an AVX512 EPYC, 2 threads
(`scripts/attention_speed.py`, 2026-12-04): a bfloat16 cache 512 queries over 512 keys 1.33 ms
against 5.25 (3.95x), 512 over 1,024 3.34 against 12.2, 32 over 2,000 0.50 against 1.46, 2,048
over 2,048 17.5 against 43.4 (2.47x); float32, int8 and int4 caches 1.48-3.23x (rows converted
to float32, no pairs). On CPUs with AMX a bfloat16 cache's tiles multiply on the tile unit
(`tdpbf16ps`, the same roundings): 16 keys' scores against 16 query vectors come out a key a row,
as the lanes' online softmax takes them, and the weighted values are summed into each query
vector's row of sums, rescaled between key tiles only where a maximum moved: 2.4-3.3x the
AVX512-BF16 pairs on a 2-core Xeon (a one-off A/B of the two kernels in one process, commit
0db97d5). `python scripts/attention_speed.py --caches bfloat16 --cases
16x16,64x300,512x512,512x1024,32x2000,2048x2048,1x2000` there (2026-12-05, SmolLM2's heads),
the reference / the kernel / torch's SDPA in bfloat16 on K/V gathered beforehand, ms: 0.08 /
0.03 / 0.02, 0.48 / 0.16 / 0.22, 3.79 / 1.12 / 1.37, 6.43 / 2.11 / 2.92, 1.38 / 0.43 / 0.60,
27.6 / 10.7 / 11.3, 0.40 / 0.09 / 0.10. That SDPA multiplies on the tile unit too, but its bits
depend on where the chunk was cut, so prefill chunks run this kernel there as everywhere.

The kernel is `torch.ops.qrun.paged_attention`, part of the C++ library `kernels/cpu_library.py`
builds (a compiled decode layer keeps it as one call); where it cannot be built the kernel table
keeps the torch reference (`qrun.kernels.ops_for`).
"""

from __future__ import annotations

import torch

from qrun.kernels.paged_attention import paged_attention_ref

_FLOAT_KINDS = (torch.float32, torch.bfloat16, torch.float16)
HEAD_DIMS = (64, 80, 96, 128, 256)  # instantiated in cpu_attention.cpp; others run the torch reference


def _kernel_takes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, k_scales: torch.Tensor | None,
                  v_scales: torch.Tensor | None) -> bool:
    """Whether the kernel has an instantiation for this head_dim and cache dtype, and the cache
    is laid out as it reads it (contiguous blocks)."""
    tensors = [t for t in (k_cache, v_cache, k_scales, v_scales) if t is not None]
    kind_known = k_cache.dtype in _FLOAT_KINDS if k_scales is None else k_cache.dtype in (torch.int8, torch.uint8)
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
    """`paged_attention_ref`'s signature and result through the C++ kernel; through the reference
    where a gradient is wanted."""
    # the converter differentiates through the layers: the kernel has no backward
    if not _kernel_takes(q, k_cache, v_cache, k_scales, v_scales) or (torch.is_grad_enabled() and q.requires_grad):
        return paged_attention_ref(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, max_query_len,
                                   max_seq_len, scale, out, k_scales, v_scales)
    attended = torch.ops.qrun.paged_attention(q, k_cache, v_cache, block_tables, seq_lens, query_start_loc, scale,
                                              k_scales, v_scales)
    return attended.to(q.dtype) if out is None else out.copy_(attended)
