"""The one dispatch point between Triton kernels and their torch references.

`QRUN_KERNELS=torch|triton|auto` forces a choice; `auto` runs Triton on CUDA devices and the
torch references elsewhere. Both implementations of an op share one signature, so callers
resolve the ops once (`ops_for`) and call them without knowing which they got.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

from qrun.kernels.cache_ops import store_kv_ref, store_kv_triton
from qrun.kernels.norm import rms_norm_ref, rms_norm_triton
from qrun.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from qrun.kernels.dequant_matmul import dequant_matmul_ref, dequant_matmul_triton
from qrun.kernels.rotary import apply_rotary_ref, apply_rotary_triton, rotary_cos_sin

_CHOICES = ("auto", "torch", "triton")

IMPLEMENTATIONS: dict[str, dict[str, object]] = {
    "paged_attention": {"torch": paged_attention_ref, "triton": paged_attention_triton},
    "store_kv": {"torch": store_kv_ref, "triton": store_kv_triton},
    "rms_norm": {"torch": rms_norm_ref, "triton": rms_norm_triton},
    "apply_rotary": {"torch": apply_rotary_ref, "triton": apply_rotary_triton},
    "dequant_matmul": {"torch": dequant_matmul_ref, "triton": dequant_matmul_triton},
}


def backend(device: torch.device) -> str:
    """'triton' or 'torch' for tensors on `device`, honouring QRUN_KERNELS."""
    choice = os.environ.get("QRUN_KERNELS", "auto").lower()
    if choice not in _CHOICES:
        raise ValueError(f"QRUN_KERNELS={choice!r} is not one of {', '.join(_CHOICES)}")
    if choice == "auto":
        return "triton" if device.type == "cuda" else "torch"
    return choice


def ops_for(device: torch.device) -> SimpleNamespace:
    """The implementation of every op for tensors on `device`, as attributes."""
    chosen = backend(device)
    missing = [name for name, impls in IMPLEMENTATIONS.items() if chosen not in impls]
    if missing:
        raise RuntimeError(f"no {chosen} implementation of {', '.join(missing)}; set QRUN_KERNELS=torch")
    return SimpleNamespace(**{name: impls[chosen] for name, impls in IMPLEMENTATIONS.items()})


__all__ = ["IMPLEMENTATIONS", "backend", "ops_for", "rotary_cos_sin"]
