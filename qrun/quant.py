"""Quantized linear layers: the module the loader swaps in, and its execution paths.

Every QuantLinear forward goes through one dispatch point (`QuantLinear.forward`):
- the Triton backend (CUDA, or QRUN_KERNELS=triton): the `dequant_matmul` op of `qrun.kernels`;
- CPU, `QRUN_QUANT_CPU=fast` (default): a prepared torch path, built once per module:
  groups of <= 4 bits run through `aten._weight_int4pack_mm_for_cpu` (every width up to 4 is
  re-expressed exactly on the 4-bit grid: w = (q - 8) * scale + zero), groups of 5..8 bits (a
  prefix of the permuted input rows) run as one dense matmul of their dequantized weights;
  where the int4 layout does not apply (group size not 32/64/128/256, N not a multiple of 16)
  the whole matrix runs dense; other multiples of 32 (96, 192) run with their scales repeated on
  the largest size the kernel takes that divides them. Activations run in bfloat16 on this path.
- CPU, `QRUN_QUANT_CPU=ref`: `dequant_matmul_ref` (float32 dequantize, then matmul).
A rotated matrix (stored in a rotated input basis) rotates its input first, on every path,
unless linears sharing an input also share its rotation (q/k/v, gate/up: quantized together):
then the model rotates that input once (`share_input_rotations`).

Format of the tensors: docs/FORMAT.md.
"""

from __future__ import annotations

import os

import torch
from torch import nn

from qrun.convert.packing import FORMAT_VERSION, READABLE_VERSIONS, MatrixLayout
from qrun.errors import ModelLoadError
from qrun.kernels import backend, ops_for
from qrun.kernels.dequant_matmul import (MIN_LEVELS, SCALE_LEVELS, dequant_matmul_ref, dequantize_ref,
                                         group_values)
from qrun.kernels.rotation import rotate, unpack_signs, unrotate

INT4_GROUP_SIZES = (32, 64, 128, 256)
CPU_MODES = ("fast", "ref")


def cpu_mode() -> str:
    mode = os.environ.get("QRUN_QUANT_CPU", "fast").lower()
    if mode not in CPU_MODES:
        raise ValueError(f"QRUN_QUANT_CPU={mode!r} is not one of {', '.join(CPU_MODES)}")
    return mode


class QuantLinear(nn.Module):
    """y = x W^T + b with W stored packed (mixed bits per input group, act-order permutation)."""

    # Loaded as written, whatever the model's dtype: the codes' ranges are float16 by format.
    stored_dtype_params = ("scale_max", "min_absmax")

    def __init__(self, layout: MatrixLayout, bias: bool = False, dtype: torch.dtype = torch.float16):
        super().__init__()
        self.layout = layout
        self.in_features, self.out_features = layout.in_features, layout.out_features
        self.group_size = layout.group_size
        for name, (shape, tdtype) in layout.tensor_shapes().items():
            tensor = torch.zeros(shape, dtype=tdtype)
            self.register_parameter(name, nn.Parameter(tensor, requires_grad=False))
        if not layout.asym:
            self.mins = self.min_absmax = None
        if not layout.permuted:
            self.perm = None
        if not layout.rotated:
            self.rotation = None
        # False when the model rotates the input for this linear and its siblings (share_input_rotations)
        self.rotates_input = layout.rotated
        self.bias = nn.Parameter(torch.zeros(layout.out_features, dtype=dtype), requires_grad=False) if bias else None
        self._identity: torch.Tensor | None = None
        self._signs: torch.Tensor | None = None
        self._prepared: tuple | None = None
        self._prepared_key = None

    def extra_repr(self) -> str:
        runs = ",".join(f"{b}b×{n}" for b, n in self.layout.runs())
        return (f"in={self.in_features}, out={self.out_features}, group={self.group_size}, "
                f"{'asym' if self.layout.asym else 'sym'}, groups={runs}, bpw={self.layout.bpw():.3f}")

    def input_perm(self) -> torch.Tensor:
        """Input column of each packed row (the identity when the file stores no perm)."""
        if self.perm is not None:
            return self.perm
        if self._identity is None or self._identity.device != self.qweight.device:
            self._identity = torch.arange(self.in_features, dtype=self.layout.perm_dtype, device=self.qweight.device)
        return self._identity

    def packed(self) -> tuple:
        """(qweight, qgroups, scales, scale_max, mins, min_absmax): the dequant_matmul arguments."""
        return self.qweight, self.qgroups, self.scales, self.scale_max, self.mins, self.min_absmax

    def input_signs(self) -> torch.Tensor | None:
        """The input rotation's signs (+-1 float32 [K]), None when the matrix is not rotated."""
        if self.rotation is None:
            return None
        if self._signs is None or self._signs.device != self.rotation.device:
            self._signs = unpack_signs(self.rotation)
        return self._signs

    def dequantized_weight(self) -> torch.Tensor:
        """float32 [N, K] in original input order and basis."""
        w = dequantize_ref(*self.packed(), self.group_size)
        dense = torch.empty(self.out_features, self.in_features, dtype=torch.float32, device=w.device)
        dense[:, self.input_perm().long()] = w.T
        signs = self.input_signs()
        return dense if signs is None else unrotate(dense, signs)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.rotates_input:
            x2 = rotate(x2, self.input_signs())
        if backend(x.device) == "triton":
            y = ops_for(x.device).dequant_matmul(x2, *self.packed(), self.input_perm(), self.group_size, self.bias)
        elif cpu_mode() == "ref":
            y = dequant_matmul_ref(x2, *self.packed(), self.input_perm(), self.group_size, self.bias)
        else:
            y = self._forward_cpu_fast(x2)
        return y.reshape(*shape[:-1], self.out_features)

    # --- CPU fast path -------------------------------------------------------------------
    def _prepare_cpu(self) -> tuple:
        """(perm | None (identity), k_hi, dense_hi [N, k_hi] bf16 | None,
        low: (int4-packed rows k_hi.., kernel group size, scale_zero [K_lo/kernel group, N, 2]) | None)."""
        bits = [int(b) for b in self.qgroups[:, 0].tolist()]
        g = self.group_size
        hi_groups = 0
        while hi_groups < len(bits) and bits[hi_groups] > 4:
            hi_groups += 1
        kernel_group = next((s for s in INT4_GROUP_SIZES[::-1] if g % s == 0), None)
        lo_is_int4 = (all(b <= 4 for b in bits[hi_groups:]) and kernel_group is not None
                      and self.out_features % 16 == 0 and hi_groups < len(bits))
        if not lo_is_int4:
            hi_groups = len(bits)
        w = dequantize_ref(*self.packed(), g)  # [K, N] permuted
        k_hi = hi_groups * g
        dense_hi = w[:k_hi].T.contiguous().to(torch.bfloat16) if k_hi else None
        low = None
        if lo_is_int4:
            from qrun.kernels.dequant_matmul import unpack_rows

            q_parts, sz = [], []
            groups = self.qgroups.tolist()
            scales = group_values(self.scales, self.scale_max, SCALE_LEVELS)
            mins = None if self.mins is None else group_values(self.mins, self.min_absmax, MIN_LEVELS)
            for gi in range(hi_groups, len(groups)):
                b, row = groups[gi]
                q_parts.append(unpack_rows(self.qweight[row:row + g * b // 32], b))
                s = scales[gi]
                zero = mins[gi] + 8 * s if mins is not None else (8 - (1 << (b - 1))) * s
                sz.append(torch.stack([s, zero], -1))
            q = torch.cat(q_parts).T.contiguous().to(torch.int32)  # [N, K_lo]
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
            scale_zero = torch.stack(sz).to(torch.bfloat16).repeat_interleave(g // kernel_group, 0).contiguous()
            low = (packed, kernel_group, scale_zero)
        perm = None if self.perm is None else self.perm.long()
        return perm, k_hi, dense_hi, low

    def _forward_cpu_fast(self, x: torch.Tensor) -> torch.Tensor:
        key = (self.qweight.data_ptr(), self.scales.data_ptr())
        if self._prepared is None or self._prepared_key != key:
            self._prepared, self._prepared_key = self._prepare_cpu(), key
        perm, k_hi, dense_hi, low = self._prepared
        xp = x.to(torch.bfloat16)
        if perm is not None:
            xp = xp[:, perm]
        y = None
        if low is not None:
            packed, kernel_group, scale_zero = low
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xp[:, k_hi:].contiguous(), packed, kernel_group,
                                                            scale_zero)
        if dense_hi is not None:
            hi = xp[:, :k_hi] @ dense_hi.T
            y = hi if y is None else y + hi
        y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y


class InputRotation(nn.Module):
    """x -> x R, R = diag(signs) F: the rotated basis of the linears that read x (kernels/rotation.py)."""

    def __init__(self, signs: torch.Tensor):
        super().__init__()
        self.register_buffer("signs", signs, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rotate(x, self.signs)


# The model's input slots (an nn.Identity until shared) and the linears that read each.
SHARED_INPUTS = {"qkv_input": ("q_proj", "k_proj", "v_proj"), "gate_up_input": ("gate_proj", "up_proj")}


def share_input_rotations(model: nn.Module) -> None:
    """Rotate a shared input once where every linear reading it is rotated with the same signs.

    The converter quantizes q/k/v (and gate/up) together, so in a rotated block they share one
    rotation; applied per projection it cost 40% of the rotations of a decode step."""
    for module in list(model.modules()):  # the loop replaces submodules
        for slot, names in SHARED_INPUTS.items():
            linears = [getattr(module, name, None) for name in names]
            if not hasattr(module, slot) or not all(isinstance(lin, QuantLinear) and lin.rotates_input
                                                    for lin in linears):
                continue
            signs = linears[0].input_signs()
            if all(torch.equal(lin.input_signs(), signs) for lin in linears[1:]):
                setattr(module, slot, InputRotation(signs))
                for lin in linears:
                    lin.rotates_input = False


def module_layouts(hf_config: dict, model: nn.Module) -> dict[str, MatrixLayout]:
    """Layouts of the quantized linears named in config.json's quantization_config."""
    qconfig = hf_config["quantization_config"]
    if qconfig.get("quant_method") != "qrun-exl":
        raise ModelLoadError(f"unsupported quantization method {qconfig.get('quant_method')!r}; "
                             "qrun loads its own 'qrun-exl' format (qrun convert)")
    if qconfig.get("version") not in READABLE_VERSIONS:
        raise ModelLoadError(f"this model is in qrun-exl format version {qconfig.get('version')}; this qrun reads "
                             f"versions {READABLE_VERSIONS[0]} to {FORMAT_VERSION} (8-bit group scales): convert it again "
                             "with `qrun convert`")
    layouts = {}
    for name, spec in qconfig.get("modules", {}).items():
        short = name.removeprefix("model.")
        linear = model.get_submodule(short)
        layouts[short] = MatrixLayout.from_json(linear.in_features, linear.out_features, spec)
    return layouts


def swap_quantized_linears(model: nn.Module, hf_config: dict) -> None:
    """Replace the nn.Linear modules named in quantization_config by QuantLinear (shapes from the layouts)."""
    for name, layout in module_layouts(hf_config, model).items():
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        old = getattr(parent, attr)
        setattr(parent, attr, QuantLinear(layout, bias=old.bias is not None))
    if "lm_head" in module_layouts(hf_config, model) and getattr(model.config, "tie_word_embeddings", False):
        raise ModelLoadError("quantization_config quantizes lm_head of a tied model; the file is inconsistent")
