"""Dense bfloat16 linears on x86 CPUs: a float16 GEMV at one or a few rows, oneDNN on a prepacked
weight at more. And float32 ones where the CPU has no native bfloat16 (`dtype="auto"` there loads
float32): their weights rounded to float16 for the same GEMV, float32 matmuls at more rows.

At one or two rows a linear is a matrix-vector product bound by reading the weight. A float16
GEMV (float32 accumulation) reads at close to memory speed, while torch's bfloat16 matmul at one
row does not: on an AVX512-BF16 EPYC a 3072 x 576 weight took 151 us in torch's float16 GEMV and
321 us in bfloat16, and a SmolLM2 decode step fell from 32 to 21 ms. With the C++ kernels built
the GEMV is `kernels/cpu_half_gemv.py`'s (2-3x faster than torch's on weights in cache, 1.2-1.4x
streaming the 49152 x 576 head), else torch's (its reference). It reads each weight once for all
its rows, so a few rows cost little more than one: where the C++ decode step covers the model, the
load measures up to how many rows (GEMV_ROW_LIMITS) its steps beat those on oneDNN and sets
`gemv_rows` (`cpu_model.fastest_cpu_model`; on a 2-core Xeon with AMX, dense SmolLM2's C++ steps
took 9.9, 10.5, 17.7 and 17.8 ms at 1 to 4 rows with the GEMV at 1 and 2 only, and 11.4 and 12.1 ms
at 3 and 4 rows with it there too: one-off probes); elsewhere it takes GEMV_ROWS. At many rows
float16 loses by far (no hardware GEMM: 3.0 ms vs 0.5 ms at 32 rows), and
bfloat16's `F.linear` reorders the weight into oneDNN's blocked layout on every call: prepacked
once at load, SmolLM2's 120 layer matmuls took 12-18 ms instead of 21-29 ms at 3 to 16 rows and
28 vs 44 ms at 32 in a microbenchmark, with bit-identical results
(`torch.ops.mkldnn._linear_pointwise`, the op Inductor's weight prepacking runs). The module
holds the packed weight in place of the plain one.

So each linear keeps two copies, float16 and packed bfloat16 (together what a float32 model
costs); a head tied to the embedding keeps the embedding's plain bfloat16 weight as well.
float16 holds 3 more mantissa bits than bfloat16 but overflows past 65504: a forward whose
output is not finite runs again in bfloat16 (`ModelRunner.execute`, via `bfloat16_only`), one
check per step rather than one per linear.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from qrun.kernels import backend, cpu_half_gemv
from qrun.kernels.cpu_half_gemv import half_gemv_ref
from qrun.kernels.read_streams import DEFAULT_READ_STREAMS, fastest_for

GEMV_ROWS = 2  # the rows a float16 GEMV takes where the load does not measure it
GEMV_ROW_LIMITS = (8, 6, 4)  # the larger limits the load tries, most first (cpu_half_gemv.MAX_ROWS at most)

# The packed weight is an opaque oneDNN tensor, which Inductor only lowers when the weight is a
# constant of the graph. A compiled decode layer takes its weights as inputs, so it calls the
# matmul through this op, which Inductor leaves as a call. Eager mode calls the oneDNN op itself
# (the op's dispatch costs ~6 us a call).
_library = torch.library.Library("qrun", "FRAGMENT")
_library.define("onednn_linear(Tensor x, Tensor packed_weight, Tensor? bias, SymInt out_features) -> Tensor")


def _onednn_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None,
                   out_features: int) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


_library.impl("onednn_linear", _onednn_linear, "CompositeExplicitAutograd")


@torch.library.register_fake("qrun::onednn_linear")
def _onednn_linear_shape(x, packed_weight, bias, out_features):
    return x.new_empty(x.shape[0], out_features)


def cpu_dense_linears_apply(device: torch.device, dtype: torch.dtype, half_weights: bool = False) -> bool:
    """Whether dense linears of this dtype on this device run as `CpuDenseLinear`s: bfloat16 ones, and float32 ones
    where the load holds their weights in float16 (`half_weights`)."""
    return (device.type == "cpu" and (dtype == torch.bfloat16 or dtype == torch.float32 and half_weights)
            and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"))


def can_prepack() -> bool:
    """Whether oneDNN runs bfloat16 matmuls on this CPU (it needs AVX512: on an AVX2-only CPU W
    stays plain)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


class CpuDenseLinear(nn.Module):
    """y = x W^T + b, through a float16 copy of W at <= `gemv_rows` rows, W prepacked for oneDNN
    at more (or W itself where oneDNN lacks bfloat16). In a float32 model W and b are rounded to
    float16's precision in place (so the GEMV multiplies the values more rows do), and W stays
    float32 beside the copy: the GEMV reads half float32's bytes, oneDNN's float32 matmuls at more
    rows run as before."""

    def __init__(self, linear: nn.Linear, shared: bool = False):
        """`shared`: W is also another module's (a head tied to the embedding), so it stays
        as it is and the packed copy is extra; otherwise the packed copy replaces it."""
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.bias = linear.bias
        self.weight_f16 = linear.weight.detach().to(torch.float16)
        self.bias_f16 = None if linear.bias is None else linear.bias.detach().to(torch.float16)
        self.weight = linear.weight
        self.weight_packed = None
        if linear.weight.dtype == torch.float32:
            with torch.no_grad():
                linear.weight.copy_(self.weight_f16)
                if linear.bias is not None:
                    linear.bias.copy_(self.bias_f16)
        elif can_prepack():
            self.weight_packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach())
            if not shared:
                self.weight = nn.Parameter(self.weight_packed, requires_grad=False)
        self.enabled = True  # False inside bfloat16_only
        self.half_gemv = cpu_half_gemv.half_gemv if backend(self.weight_f16.device) == "cpu" else half_gemv_ref
        self.read_streams = DEFAULT_READ_STREAMS  # the GEMV's: cpu_model.fastest_cpu_model
        self.gemv_rows = GEMV_ROWS  # the most rows the GEMV takes: cpu_model.fastest_cpu_model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.enabled and x.shape[0] <= self.gemv_rows and x.dim() == 2:
            return self.half_gemv(x, self.weight_f16, self.bias_f16, self.read_streams)
        if self.weight_packed is None:
            return F.linear(x, self.weight, self.bias)
        rows = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            y = torch.ops.qrun.onednn_linear(rows, self.weight_packed, self.bias, self.out_features)
        else:
            y = _onednn_linear(rows, self.weight_packed, self.bias, self.out_features)
        return y.view(*x.shape[:-1], self.out_features)


@contextmanager
def bfloat16_only(model: nn.Module) -> Iterator[None]:
    """Run `model`'s CpuDenseLinears on their bfloat16 weights inside the block."""
    linears = [m for m in model.modules() if isinstance(m, CpuDenseLinear)]
    for lin in linears:
        lin.enabled = False
    try:
        yield
    finally:
        for lin in linears:
            lin.enabled = True


def max_gemv_rows(model: nn.Module) -> int:
    """The most rows any of `model`'s dense linears takes on its float16 GEMV (0: none has one)."""
    return max((m.gemv_rows for m in model.modules() if isinstance(m, CpuDenseLinear)), default=0)


def use_cpu_dense_linears(model: nn.Module) -> None:
    """Swap every dense nn.Linear of `model` for a CpuDenseLinear (the caller checks it applies), but a float32 one
    whose weights or bias float16 cannot hold (past 65504), which stays as it is."""
    references: dict[int, int] = {}
    for _, param in model.named_parameters(remove_duplicate=False):
        references[id(param)] = references.get(id(param), 0) + 1
    for module in list(model.modules()):  # the loop replaces submodules
        for name, child in module.named_children():
            if type(child) is nn.Linear and (child.weight.dtype != torch.float32 or _fits_float16(child)):
                setattr(module, name, CpuDenseLinear(child, shared=references[id(child.weight)] > 1))


def _fits_float16(linear: nn.Linear) -> bool:
    finite = torch.finfo(torch.float16).max
    return all(bool(t.abs().max() <= finite) for t in (linear.weight, linear.bias) if t is not None and t.numel())


def gemv_linears(model: nn.Module) -> list[CpuDenseLinear]:
    """The linears of `model` whose one-row products run on the library's float16 GEMV (those with
    read streams to choose)."""
    return [m for m in model.modules() if isinstance(m, CpuDenseLinear) and m.half_gemv is cpu_half_gemv.half_gemv]


def measure_gemv_read_streams(model: nn.Module) -> None:
    """Set every library GEMV's read streams to the count under which its model's one-row float16
    GEMVs, one call each as the torch layers run them, are fastest on this machine
    (`kernels/read_streams.py`; dense SmolLM2: ~270 MB of weights, ~0.2 s). For a model the C++
    decode step does not cover: `cpu_model.fastest_cpu_model` times the others' steps."""
    linears = gemv_linears(model)

    def product(linear: CpuDenseLinear) -> tuple[Callable[[int], object], int]:
        row = torch.randn(1, linear.in_features, dtype=torch.bfloat16)
        return (lambda streams: linear.half_gemv(row, linear.weight_f16, linear.bias_f16, streams),
                linear.weight_f16.numel() * linear.weight_f16.element_size())

    fastest = fastest_for(product(linear) for linear in linears)
    for linear in linears:
        linear.read_streams = fastest
