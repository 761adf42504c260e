"""Matmuls of many rows on torch's CPU int4-packed weights: dequantize to bfloat16 (C++,
cpu_int4.cpp), then one oneDNN matmul.

torch's int4 CPU kernel (`aten._weight_int4pack_mm_for_cpu`) is a GEMV at heart: its cost grows
with the rows. In a microbenchmark on an AVX512 EPYC, a 3072 x 576 matrix took 0.4 ms at 8
rows, 2.9 ms at 64 and 21 ms at 512, where a bfloat16 matmul takes 1.4 and 11.5 ms, and
dequantizing the whole matrix about 1 ms. So from DEQUANTIZE_ROWS rows on (prefill chunks; eager
decode steps of that many sequences; the compiled decode layer keeps the int4 kernel) a quantized
linear dequantizes its weight and multiplies in bfloat16: the weight rounds to bfloat16 on the
way (relative error <= 2^-9 per weight, against the kernel's float32 weights).

The kernel reads torch's packed layout, which torch does not document: `layout_is_known()`
checks it once against torch's own kernel, and quantized linears keep the int4 kernel for every
row count where it does not hold (another torch version or CPU capability).
"""

from __future__ import annotations

import functools

import torch

from qrun.kernels import cpu_library

DEQUANTIZE_ROWS = 64
BLOCK_N = 64  # output channels per packed block (cpu_int4.cpp)


def dequantize_int4pack(packed: torch.Tensor, scale_zero: torch.Tensor, group: int, out: torch.Tensor,
                        accumulate: bool = False) -> torch.Tensor:
    """out [N, K'] bfloat16 (K' >= K: the first K columns) = the weight `packed` [N, K / 2]
    holds with `scale_zero` [K / group, N, 2] bfloat16, added to out's columns when `accumulate`."""
    torch.ops.qrun.dequantize_int4pack(packed, scale_zero, group, out, accumulate)
    return out


@functools.cache
def layout_is_known() -> bool:
    """Whether torch packs int4 weights as cpu_int4.cpp reads them (checked against torch's kernel)."""
    if not cpu_library.available():
        return False
    g = torch.Generator().manual_seed(0)
    n, k, group = 2 * BLOCK_N, 64, 32
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.int32)
    scale_zero = torch.randn(k // group, n, 2, generator=g).to(torch.bfloat16)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 1)
    if packed.shape != (n, k // 2):
        return False
    identity = torch.eye(k, dtype=torch.bfloat16)
    expected = torch.ops.aten._weight_int4pack_mm_for_cpu(identity, packed, group, scale_zero).T
    got = dequantize_int4pack(packed, scale_zero, group, torch.empty(n, k, dtype=torch.bfloat16))
    return bool(torch.allclose(got.float(), expected.float(), rtol=2e-2, atol=2e-2))
