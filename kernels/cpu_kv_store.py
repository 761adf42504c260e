"""Storing keys and values into a quantized (int8, int4) paged cache on CPUs: `cache_ops.store_kv_ref`'s
signature, as one C++ pass over the step's tokens (`cpu_kv_store.cpp`, through
`torch.ops.qrun.store_kv_quantized`).

The reference quantizes with ~15 torch ops per layer and step (upcast, clamp, min/max, divide,
floor, pack, two scatters per tensor), which at a few decode rows cost more than the layer's
attention. The kernel does the same float32 operations and float16 roundings element for element,
so it writes the reference's bytes; the eager layers and the C++ model both store through
it (the kernel table's `store_kv` on the CPU). Float caches stay with the reference (one cast and
one scatter each).
"""

from __future__ import annotations

import torch

from qrun.kernels.cache_ops import store_kv_ref


def store_kv_cpu(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scales: torch.Tensor | None = None,
                 v_scales: torch.Tensor | None = None) -> None:
    """`cache_ops.store_kv_ref` through the C++ kernel for quantized caches laid out contiguously,
    else through the reference."""
    tensors = (k_cache, v_cache, k_scales, v_scales)
    if k_scales is None or k.device.type != "cpu" or not all(t.is_contiguous() for t in tensors):
        return store_kv_ref(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    torch.ops.qrun.store_kv_quantized(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)
