"""x W^T (+ b) with a float16 W at one to eight rows on the CPU: the small-batch matmul of dense
bfloat16 models, and of float32 ones on CPUs without native bfloat16 (`qrun/cpu_linear.py` keeps a
float16 copy of each weight for it).

At one row a linear is bound by reading W. torch's float16 GEMV (the reference below) read a
3072 x 576 weight in ~150 us on a 2-core EPYC; `cpu_half_gemv.cpp` streams W's rows in one, two
or four runs side by side per thread (`read_streams.py` measures which is fastest; on AVX2, with
half AVX-512's registers, fewer at more rows), converting 16 values per instruction (8 on AVX2,
F16C) and accumulating in float32, with the inputs kept in float32 (the reference
rounds them to float16 first) and the output rounded once to the input's dtype (the reference
rounds it to float16 first, then to bfloat16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from qrun.kernels.read_streams import DEFAULT_READ_STREAMS

MAX_ROWS = 8  # cpu_half_gemv.cpp


def half_gemv_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                  read_streams: int = DEFAULT_READ_STREAMS) -> torch.Tensor:
    """y = x W^T + b in x's dtype, W float16 [N, K] (bias float16 [N] or None; the streams change
    only the order in which the kernel reads W)."""
    return F.linear(x.to(torch.float16), weight, bias).to(x.dtype)


def half_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              read_streams: int = DEFAULT_READ_STREAMS) -> torch.Tensor:
    """`half_gemv_ref` through the C++ kernel (float32 or bfloat16 x of up to MAX_ROWS rows), each
    thread reading `read_streams` runs of W's rows side by side; else through the reference."""
    if x.dim() != 2 or x.shape[0] > MAX_ROWS or x.dtype not in (torch.float32, torch.bfloat16):
        return half_gemv_ref(x, weight, bias)
    return torch.ops.qrun.half_gemv(x if x.stride(-1) == 1 else x.contiguous(), weight, bias, read_streams)
