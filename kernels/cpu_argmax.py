"""Greedy sampling's argmax on CPUs: `argmax.first_max_ref`'s signature, one vectorised pass per
row (`cpu_argmax.cpp`, through `torch.ops.qrun.first_max`).

torch's max over one row of SmolLM2's 49,152 float32 logits took 44 us on a 2-core EPYC (~120 us
in its slow hours), ~1-2% of a 4.0-bpw decode step at batch 1, for a row that sits in L2: the
kernel keeps each lane's largest value and its first index (16 lanes with AVX-512, two sets of 8
with AVX2), and notes NaNs and infinities on the way (a row holding a NaN answers its first one,
as torch does). Fewer rows than threads are split over the threads in runs of 16 values, as the
model's head splits its channel tiles, so the C++ step finds its logits' maxima on its held team,
each thread reading what it stored. One row of 49,152 on a 2-core Zen 3 EPYC (AVX2), one thread,
through the torch op (one-off probe, ~5 us of it the op's call): 21-24 us, against 103 us for the
scalar loop that AVX2 had before.
"""

from __future__ import annotations

import torch

from qrun.kernels.argmax import first_max_ref


def first_max_cpu(rows: torch.Tensor) -> torch.Tensor:
    """`argmax.first_max_ref` through the C++ kernel for float32 rows on the CPU, else the reference."""
    if rows.device.type != "cpu" or rows.dtype != torch.float32 or rows.dim() != 2 or rows.shape[1] == 0:
        return first_max_ref(rows)
    return torch.ops.qrun.first_max(rows if rows.stride(-1) == 1 else rows.contiguous())
