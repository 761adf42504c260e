"""The one dispatch point between the kernels (Triton on GPUs, C++ on CPUs) and their torch
references.

`QRUN_KERNELS=torch|triton|cpu|auto` forces a choice; `auto` runs Triton on CUDA devices, and on
the CPU the C++ kernels where an op has one (paged attention, decode rows and prefill chunks:
`kernels/cpu_attention.py`; the rotation and its inverse: `kernels/cpu_rotation.py`; RMSNorm:
`kernels/cpu_norm.py`; rotary: `kernels/cpu_rotary.py`; the MLP's SiLU-gated activation:
`kernels/cpu_activation.py`; the quantized cache store: `kernels/cpu_kv_store.py`; greedy
sampling's argmax: `kernels/cpu_argmax.py`; sampling's draw: `kernels/cpu_draw.py`; logprobs:
`kernels/cpu_logprobs.py`; structured outputs' token masks: `kernels/cpu_token_bitmask.py`; built at
first use by `kernels/cpu_library.py`) and
the torch references for the rest, or the references alone where no C++ compiler builds them. Every
implementation of an op shares one signature, so callers resolve the ops once (`ops_for`) and
call them without knowing which they got (resolved once per backend: a later lookup is a
dictionary's).
"""

from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch

from qrun.kernels import (cpu_activation, cpu_argmax, cpu_attention, cpu_draw, cpu_kv_store, cpu_library,
                           cpu_logprobs, cpu_norm, cpu_rotary, cpu_rotation, cpu_token_bitmask)
from qrun.kernels.activation import silu_and_mul_ref
from qrun.kernels.argmax import first_max_ref
from qrun.kernels.cache_ops import store_kv_ref, store_kv_triton
from qrun.kernels.draw import draw_ref
from qrun.kernels.logprobs import top_logprobs_ref
from qrun.kernels.norm import rms_norm_ref, rms_norm_triton
from qrun.kernels.paged_attention import paged_attention_ref, paged_attention_triton
from qrun.kernels.dequant_matmul import dequant_matmul_ref, dequant_matmul_triton
from qrun.kernels.rotary import apply_rotary_ref, apply_rotary_triton, rotary_cos_sin
from qrun.kernels.rotation import reflect, rotate, unrotate
from qrun.kernels.token_bitmask import mask_logits_ref

_CHOICES = ("auto", "torch", "triton", "cpu")

IMPLEMENTATIONS: dict[str, dict[str, object]] = {
    "paged_attention": {"torch": paged_attention_ref, "triton": paged_attention_triton,
                        "cpu": cpu_attention.paged_attention_cpu},
    "store_kv": {"torch": store_kv_ref, "triton": store_kv_triton, "cpu": cpu_kv_store.store_kv_cpu},
    "rms_norm": {"torch": rms_norm_ref, "triton": rms_norm_triton, "cpu": cpu_norm.rms_norm_cpu},
    "apply_rotary": {"torch": apply_rotary_ref, "triton": apply_rotary_triton, "cpu": cpu_rotary.apply_rotary_cpu},
    "dequant_matmul": {"torch": dequant_matmul_ref, "triton": dequant_matmul_triton},
    # GPUs keep torch's two ops (Inductor fuses them in a compiled graph)
    "silu_and_mul": {"torch": silu_and_mul_ref, "triton": silu_and_mul_ref, "cpu": cpu_activation.silu_and_mul_cpu},
    # GPUs rotate through torch's matmuls (cuBLAS): a kernel of its own did not pay there
    "rotate": {"torch": rotate, "triton": rotate, "cpu": cpu_rotation.rotate_cpu},
    "unrotate": {"torch": unrotate, "triton": unrotate, "cpu": cpu_rotation.unrotate_cpu},
    "reflect": {"torch": reflect, "triton": reflect, "cpu": cpu_rotation.reflect_cpu},
    # GPUs take torch's max (one reduction kernel)
    "first_max": {"torch": first_max_ref, "triton": first_max_ref, "cpu": cpu_argmax.first_max_cpu},
    # GPUs draw with torch's ops: a row's few reductions, each one kernel
    "draw": {"torch": draw_ref, "triton": draw_ref, "cpu": cpu_draw.draw_cpu},
    # GPUs: torch's log-softmax and top-k, a kernel each
    "top_logprobs": {"torch": top_logprobs_ref, "triton": top_logprobs_ref, "cpu": cpu_logprobs.top_logprobs_cpu},
    # GPUs: the reference's few elementwise kernels
    "mask_logits": {"torch": mask_logits_ref, "triton": mask_logits_ref, "cpu": cpu_token_bitmask.mask_logits_cpu},
}


def backend(device: torch.device) -> str:
    """'triton', 'cpu' or 'torch' for tensors on `device`, honouring QRUN_KERNELS."""
    choice = os.environ.get("QRUN_KERNELS", "auto").lower()
    if choice not in _CHOICES:
        raise ValueError(f"QRUN_KERNELS={choice!r} is not one of {', '.join(_CHOICES)}")
    if choice == "auto":
        if device.type == "cuda":
            return "triton"
        return "cpu" if device.type == "cpu" and cpu_library.available() else "torch"
    if choice == "cpu" and not cpu_library.available():
        raise RuntimeError("QRUN_KERNELS=cpu, but the C++ kernels did not build here (see the warning above); "
                           "unset it to run the torch references")
    return choice


def ops_for(device: torch.device) -> SimpleNamespace:
    """The implementation of every op for tensors on `device`, as attributes. The C++ backend
    covers some ops; the rest run their torch references."""
    return _ops(backend(device))


@functools.cache
def _ops(chosen: str) -> SimpleNamespace:
    fallback = "torch" if chosen == "cpu" else None
    missing = [name for name, impls in IMPLEMENTATIONS.items() if chosen not in impls and fallback not in impls]
    if missing:
        raise RuntimeError(f"no {chosen} implementation of {', '.join(missing)}; set QRUN_KERNELS=torch")
    return SimpleNamespace(**{name: impls.get(chosen, impls.get(fallback)) for name, impls in IMPLEMENTATIONS.items()})


__all__ = ["IMPLEMENTATIONS", "backend", "ops_for", "rotary_cos_sin"]
