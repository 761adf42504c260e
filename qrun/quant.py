"""Quantized linear layers: the module the loader swaps in, and its execution paths.

Each QuantLinear's path is chosen once, at load (`prepare_quantized_linears` -> `matmul_path`):
- CPU, `QRUN_QUANT_CPU=fast` (default): `CpuQuantMatmul`: every group width runs on a 4-bit
  kernel (5-8-bit codes as two 4-bit digits): the C++ VNNI one, or torch's int4 kernel; linears
  sharing an input in the same order (q/k/v, gate/up) run as one (`QuantLinear.fuse`, called by
  the model's `fuse_projections` before the linears left unfused are prepared, so a load builds
  each weight's CPU planes once).
- everywhere else: the kernel table's `dequant_matmul` (`qrun.kernels.ops_for`): the Triton
  kernel on CUDA, or its torch reference (float32 dequantize, then matmul) on the torch backend:
  the CPU with `QRUN_QUANT_CPU=ref` (for checking the fast path), CUDA with `QRUN_KERNELS=torch`.
A rotated matrix (stored in a rotated input basis) rotates its input first, on every path,
unless linears sharing an input also share its rotation (q/k/v, gate/up: quantized together):
then the model rotates that input once (`share_input_rotations`).

Format of the tensors: docs/FORMAT.md.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from qrun.format import FORMAT_VERSION, LAYER_INPUTS, READABLE_VERSIONS, MatrixLayout
from qrun.errors import ModelLoadError
from qrun.kernels import backend, cpu_int4, cpu_quant_matmul, ops_for
from qrun.kernels.dequant_matmul import (MIN_LEVELS, SCALE_LEVELS, dequantize_ref,
                                         group_values, unpack_rows)
from qrun.kernels.read_streams import DEFAULT_READ_STREAMS, fastest_for
from qrun.kernels.rotation import rotation_factors, unpack_signs, unrotate

INT4_GROUP_SIZES = (32, 64, 128, 256)
CPU_MODES = ("fast", "ref")


def cpu_mode() -> str:
    mode = os.environ.get("QRUN_QUANT_CPU", "fast").lower()
    if mode not in CPU_MODES:
        raise ValueError(f"QRUN_QUANT_CPU={mode!r} is not one of {', '.join(CPU_MODES)}")
    return mode


def matmul_path(device: torch.device) -> str:
    """How quantized linears on `device` multiply: "cpu_int4" (torch's int4 CPU kernel, which
    only the CPU has; the default there) or "dequant_matmul" (the kernel table's op: Triton, or
    its torch reference, which dequantizes and then multiplies on any device, e.g. CUDA with
    QRUN_KERNELS=torch, or the CPU with QRUN_QUANT_CPU=ref)."""
    if device.type == "cpu" and backend(device) in ("torch", "cpu") and cpu_mode() == "fast":
        return "cpu_int4"
    return "dequant_matmul"


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
        self.input_rotation: InputRotation | None = None  # set by `prepare` where rotates_input
        self.cpu_matmul: CpuQuantMatmul | None = None  # the "cpu_int4" path's weights
        self.dequant_matmul = None  # the "dequant_matmul" path's op; both None until `prepare`

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
        if self.qweight is None:
            raise RuntimeError("this linear's packed weights were released once its CPU matmul held them "
                               "(release_packed, at load); load the model with QRUN_QUANT_CPU=ref to keep them")
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
        if self.cpu_matmul is None and self.dequant_matmul is None:
            self.prepare()  # the loader does this; a module built by hand prepares on first use
        if self.rotates_input:
            x2 = self.input_rotation(x2)
        if self.cpu_matmul is not None:
            y = self.cpu_matmul(x2)
        else:
            y = self.dequant_matmul(x2, *self.packed(), self.input_perm(), self.group_size, self.bias)
        return y.reshape(*shape[:-1], self.out_features)

    def prepare(self, input_digits: int = 1) -> None:
        """Choose this linear's execution path for its device, once (`matmul_path`), and build
        what it needs: the CPU int4 weights, or the kernel table's dequant_matmul.
        `input_digits`: how finely the CPU kernel rounds inputs (2 for a head: cpu_quant_matmul.py)."""
        device = self.qweight.device
        signs = self.input_signs()  # unpacked now: a compiled layer must not see it change on first use
        self.input_rotation = None if signs is None else InputRotation(signs)
        if matmul_path(device) == "cpu_int4":
            self.cpu_matmul, self.dequant_matmul = CpuQuantMatmul.build([self], input_digits), None
        else:
            self.cpu_matmul, self.dequant_matmul = None, ops_for(device).dequant_matmul

    def release_packed(self) -> None:
        """Drop the file's packed tensors where the CPU matmul holds the weights in its own form,
        as a fused matmul's linears are dropped: the model holds its weights once (a 4.0-bpw SmolLM2
        held 183 MiB of tensors on the CPU, 38 of them its o_proj's, down_proj's and head's packed ones)."""
        if self.cpu_matmul is None:
            return
        for name in self.layout.tensor_shapes():
            setattr(self, name, None)
        self._identity = self._signs = None

    def cpu_parts(self) -> "_CpuParts":
        """This matrix in the CPU fast path's terms (see CpuQuantMatmul)."""
        g = self.group_size
        groups = self.qgroups.tolist()
        kernel_group = next((s for s in INT4_GROUP_SIZES[::-1] if g % s == 0), None)
        wide = 0  # act order puts the wide groups first
        while wide < len(groups) and groups[wide][0] > 4:
            wide += 1
        int4 = (kernel_group is not None and self.out_features % 16 == 0
                and all(b <= 4 for b, _ in groups[wide:]))
        bias = None if self.bias is None else self.bias.float()
        perm = None if self.perm is None else self.perm.long()
        if not int4:
            return _CpuParts(perm, dequantize_ref(*self.packed(), g).T.contiguous(), None, None, 0, None, None, bias)
        scales = group_values(self.scales, self.scale_max, SCALE_LEVELS)
        mins = None if self.mins is None else group_values(self.mins, self.min_absmax, MIN_LEVELS)
        low, low_sz, high, high_sz = [], [], [], []
        for b, first, last in _runs(groups, g):
            row = groups[first][1]
            codes = unpack_rows(self.qweight[row:row + (last - first) * g * b // 32], b)
            s = scales[first:last]
            # the groups' values with no offset: q * s + m (asym) or q * s - 2^(b-1) s (sym)
            m = mins[first:last] if mins is not None else -(1 << (b - 1)) * s
            low.append(codes & 15)  # the kernel computes (code - 8) * scale + zero
            low_sz.append(torch.stack([s, m + 8 * s], -1))
            # the upper digit: (code >> 4) * 16 s, with s as the VNNI kernel keeps it (float16): exactly 16x the low
            # digit's scale, so it multiplies both digits as one 8-bit code
            if b > 4:
                high.append(codes >> 4)
                high_sz.append(torch.stack([16 * s.half().float(), 128 * s], -1))

        def plane(codes, scale_zero):
            if not codes:
                return None, None
            stacked = torch.cat(scale_zero).repeat_interleave(g // kernel_group, 0)
            return torch.cat(codes).T.contiguous(), stacked

        low_codes, low_sz = plane(low, low_sz)
        high_codes, high_sz = plane(high, high_sz)
        return _CpuParts(perm, None, (low_codes, low_sz), (high_codes, high_sz) if high else None, wide * g,
                         kernel_group, g, bias)

    @staticmethod
    def fuse(linears: list["QuantLinear"]) -> nn.Module | None:
        """One CPU matmul for linears that read the same input (q/k/v, gate/up), outputs
        concatenated; None where they cannot share one (GPU kernels, differing input order)."""
        if not all(isinstance(lin, QuantLinear) and matmul_path(lin.qweight.device) == "cpu_int4"
                   and not lin.rotates_input for lin in linears):
            return None
        return CpuQuantMatmul.build(linears)


def _runs(groups: list[list[int]], group_size: int) -> Iterator[tuple[int, int, int]]:
    """(bits, first, last) of each run of consecutive groups [first, last) that share their bits and whose packed
    rows follow one another (qgroups' (bits, first row) pairs): each run unpacks as one block of rows."""
    first = 0
    for i in range(1, len(groups) + 1):
        if i == len(groups) or groups[i][0] != groups[first][0] or (
                groups[i][1] != groups[i - 1][1] + group_size * groups[i - 1][0] // 32):
            yield groups[first][0], first, i
            first = i


@dataclass
class _CpuParts:
    perm: torch.Tensor | None  # input column of each packed row; None: identity
    dense: torch.Tensor | None  # float32 [N, K] where the int4 kernel does not apply
    low: tuple[torch.Tensor, torch.Tensor] | None  # uint8 codes [N, K], scale/zero [K / kernel group, N, 2]
    high: tuple[torch.Tensor, torch.Tensor] | None  # the same for the first k_high rows' upper digits
    k_high: int
    kernel_group: int | None  # torch's int4 kernel's group: a divisor of `group` it takes
    group: int | None  # inputs sharing a scale
    bias: torch.Tensor | None  # float32 [N]


class CpuQuantMatmul(nn.Module):
    """The CPU fast path of one or more packed linears sharing an input (outputs concatenated).

    Every weight is a plane of 4-bit codes (stored in as few bits as they need): a group of <= 4
    bits is already on that grid; a wider code splits into two 4-bit digits, q = 16 hi + lo, so a
    5-8-bit group is one pass over the low digits plus one over the high digits with 16x the scale
    (the wide groups are a prefix of the packed rows: act order puts them first). The planes run on
    one of two kernels, chosen per matrix at load:
    - `kernels/cpu_quant_matmul.py`'s (int8 activations times the codes, AVX512-VNNI; on CPUs with
      AMX, `tile_rows()` bfloat16 rows and more on the tile unit, and prefill chunks from
      `dequantize_rows()` rows on through oneDNN on the weight dequantized per call), where the CPU
      has it and the shapes fit (N a multiple of 16, groups of a multiple of 32 inputs);
    - otherwise `aten._weight_int4pack_mm_for_cpu` (bfloat16 activations, scales and zeros), and
      from `cpu_int4.DEQUANTIZE_ROWS` rows on (prefill chunks), where that kernel is slower than a
      bfloat16 matmul, the weight dequantized per call and multiplied by oneDNN.
    Where neither takes the layout (group size not a multiple of 32, N not a multiple of 16) the
    matrix runs dense."""

    def __init__(self, parts: _CpuParts, out_features: int, input_digits: int = 1):
        super().__init__()
        self.input_digits = input_digits  # the VNNI kernel's rounding of inputs: see cpu_quant_matmul.py
        self.perm, self.k_high, self.kernel_group, self.bias = parts.perm, parts.k_high, parts.kernel_group, parts.bias
        self.group, self.out_features = parts.group, out_features
        self.dense = None if parts.dense is None else parts.dense.to(torch.bfloat16)
        # the VNNI kernel's (codes, scales, zeros, centers) of the low digits, then of the high ones
        # (or four Nones); low and high: torch's int4 kernel's weights instead
        self.planes = self.low = self.high = None
        self.read_streams = DEFAULT_READ_STREAMS  # the VNNI kernel's: cpu_model.fastest_cpu_model
        self.dequantizes = False
        self.gather_columns = (cpu_quant_matmul.gather_columns if backend(torch.device("cpu")) == "cpu"
                               else cpu_quant_matmul.gather_columns_ref)
        if parts.low is not None and self._vnni_takes(parts):
            high = _vnni_plane(parts.high, parts) if parts.high else (None,) * 4
            self.planes = (*_vnni_plane(parts.low, parts), *high)
        elif parts.low is not None:
            self.low, self.high = (None if p is None else _int4_plane(p) for p in (parts.low, parts.high))
            self.dequantizes = self.low[0].shape[0] % cpu_int4.BLOCK_N == 0 and cpu_int4.layout_is_known()

    @staticmethod
    def _vnni_takes(parts: _CpuParts) -> bool:
        n, k = parts.low[0].shape
        return (cpu_quant_matmul.available() and cpu_quant_matmul.takes(n, k, parts.group)
                and (parts.high is None or cpu_quant_matmul.takes(n, parts.k_high, parts.group)))

    @classmethod
    def build(cls, linears: list[QuantLinear], input_digits: int = 1) -> "CpuQuantMatmul | None":
        """The fused matmul of `linears`, or None when their inputs are not laid out alike."""
        parts = [lin.cpu_parts() for lin in linears]
        first = parts[0]
        if not all(p.k_high == first.k_high and p.kernel_group == first.kernel_group
                   and (p.dense is None) == (first.dense is None) and (p.high is None) == (first.high is None)
                   and (p.perm is None) == (first.perm is None) and (p.perm is None or torch.equal(p.perm, first.perm))
                   for p in parts[1:]):
            return None

        def cat_planes(planes):
            return None if planes[0] is None else (torch.cat([p[0] for p in planes]), torch.cat([p[1] for p in planes], 1))

        biases = [p.bias if p.bias is not None else torch.zeros(lin.out_features) for p, lin in zip(parts, linears)]
        group = first.group if all(p.group == first.group for p in parts) else first.kernel_group
        fused = _CpuParts(first.perm, None if first.dense is None else torch.cat([p.dense for p in parts]),
                          cat_planes([p.low for p in parts]), cat_planes([p.high for p in parts]), first.k_high,
                          first.kernel_group, group,
                          torch.cat(biases) if any(p.bias is not None for p in parts) else None)
        return cls(fused, sum(lin.out_features for lin in linears), input_digits)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step runs this ~120 times: casts and gathers only where they change something.
        xp = x if x.dtype == torch.bfloat16 or self.planes is not None else x.to(torch.bfloat16)
        if self.perm is not None:
            xp = self.gather_columns(xp, self.perm)
        if self.planes is not None:
            y = self.multiply_planes(xp)
        elif self.dense is not None:
            y = xp @ self.dense.T
        elif self.dequantizes and xp.shape[0] >= cpu_int4.DEQUANTIZE_ROWS and not torch.compiler.is_compiling():
            y = F.linear(xp, self.bfloat16_weight())
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(xp.contiguous(), self.low[0], self.kernel_group, self.low[1])
            if self.high is not None:
                y = y + torch.ops.aten._weight_int4pack_mm_for_cpu(xp[:, :self.k_high].contiguous(), self.high[0],
                                                                    self.kernel_group, self.high[1])
        if y.dtype != x.dtype:
            y = y.to(x.dtype)
        if self.bias is not None:
            y = y + self.bias.to(x.dtype)
        return y

    def multiply_planes(self, x: torch.Tensor, read_streams: int | None = None) -> torch.Tensor:
        """x (inputs in packed order) times the VNNI kernel's planes, without the bias."""
        return cpu_quant_matmul.quant_matmul(x, *self.planes[:4], self.group, self.out_features, *self.planes[4:],
                                             self.k_high, self.input_digits, read_streams or self.read_streams)

    def bfloat16_weight(self) -> torch.Tensor:
        """bfloat16 [N, K], inputs in packed order: the low digits, plus the high ones' prefix
        (`QuantLinear.dequantized_weight` is the float32 one in the original order and basis)."""
        packed, scale_zero = self.low
        weight = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.bfloat16)
        cpu_int4.dequantize_int4pack(packed, scale_zero, self.kernel_group, weight)
        if self.high is not None:
            cpu_int4.dequantize_int4pack(*self.high, self.kernel_group, weight[:, :self.k_high], accumulate=True)
        return weight


def _int4_plane(plane: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A plane of int4 codes as torch's int4 kernel takes it: (packed weight, bfloat16 scale/zero)."""
    codes, scale_zero = plane
    return (torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1),
            scale_zero.to(torch.bfloat16).contiguous())


def _vnni_plane(plane: tuple[torch.Tensor, torch.Tensor], parts: _CpuParts) -> tuple[torch.Tensor, ...]:
    """A plane of int4 codes with torch's kernel's (scale, zero) per kernel group in
    cpu_quant_matmul's layout (the same values, per group)."""
    codes, scale_zero = plane
    per_group = scale_zero[::parts.group // parts.kernel_group]
    return cpu_quant_matmul.pack(codes, per_group[..., 0].T, per_group[..., 1].T)


class InputRotation(nn.Module):
    """x -> x R, R = diag(signs) F: the rotated basis of the linears that read x (kernels/rotation.py),
    through the kernel table's `rotate`."""

    def __init__(self, signs: torch.Tensor):
        super().__init__()
        self.register_buffer("signs", signs, persistent=False)
        self.factors = rotation_factors(signs.shape[0], signs.device)
        self.rotate = ops_for(signs.device).rotate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.rotate(x, self.signs, self.factors)


# The model's input slots (an nn.Identity until shared) and the linears that read each, named
# within the slot's module.
SHARED_INPUTS = {slot: tuple(name.rpartition(".")[2] for name in LAYER_INPUTS[layer_input])
                 for slot, layer_input in (("qkv_input", "attn_in"), ("gate_up_input", "mlp_in"))}


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


def prepare_quantized_linears(model: nn.Module) -> None:
    """Choose every quantized linear's path at load, building the CPU int4 weights where that is
    the path (and then dropping the packed ones), so the first request does not wait and no forward
    reads the environment. The head's inputs are rounded to two int8 digits (its errors go straight
    into the logits), the layers' to one."""
    head = getattr(model, "lm_head", None)
    for module in model.modules():
        if isinstance(module, QuantLinear):
            module.prepare(input_digits=2 if module is head else 1)
            module.release_packed()


def vnni_matmuls(model: nn.Module) -> list[CpuQuantMatmul]:
    """The matmuls of `model` that run on the VNNI kernel (those with read streams to choose)."""
    return [m for m in model.modules() if isinstance(m, CpuQuantMatmul) and m.planes is not None]


def measure_read_streams(model: nn.Module) -> None:
    """Set every VNNI matmul's read streams to the count under which its model's one-row products,
    one call each as the torch layers run them, are fastest on this machine
    (`kernels/read_streams.py`; SmolLM2 at 4.0 bpw: ~90 MB of weights, ~0.1 s). For a model the
    C++ model does not cover: `cpu_model.fastest_cpu_model` times the others' steps."""
    matmuls = vnni_matmuls(model)

    def product(matmul: CpuQuantMatmul) -> tuple[Callable[[int], object], int]:
        row = torch.randn(1, matmul.planes[3].numel() * cpu_quant_matmul.BLOCK_K, dtype=torch.bfloat16)
        return (lambda streams: matmul.multiply_planes(row, streams),
                sum(t.numel() * t.element_size() for t in matmul.planes if t is not None))

    fastest = fastest_for(product(matmul) for matmul in matmuls)
    for matmul in matmuls:
        matmul.read_streams = fastest


def module_layouts(hf_config: dict, model: nn.Module) -> dict[str, MatrixLayout]:
    """Layouts of the quantized linears named in config.json's quantization_config."""
    qconfig = hf_config["quantization_config"]
    if not isinstance(qconfig, dict):
        raise ModelLoadError(f"quantization_config must be an object, got {type(qconfig).__name__}")
    if qconfig.get("quant_method") != "qrun-exl":
        raise ModelLoadError(f"unsupported quantization method {qconfig.get('quant_method')!r}; "
                             "qrun loads its own 'qrun-exl' format (qrun convert)")
    if qconfig.get("version") not in READABLE_VERSIONS:
        raise ModelLoadError(f"this model is in qrun-exl format version {qconfig.get('version')}; this qrun reads "
                             f"versions {READABLE_VERSIONS[0]} to {FORMAT_VERSION} (8-bit group scales): convert it again "
                             "with `qrun convert`")
    modules = qconfig.get("modules", {})
    if not isinstance(modules, dict):
        raise ModelLoadError(f"quantization_config.modules must be an object, got {type(modules).__name__}")
    layouts = {}
    for name, spec in modules.items():
        short = name.removeprefix("model.")
        try:
            linear = model.get_submodule(short)
        except AttributeError:
            linear = None
        if not isinstance(linear, (nn.Linear, QuantLinear)):  # QuantLinear once swapped in
            raise ModelLoadError(f"quantization_config.modules names {name!r}, which is no linear layer of this model")
        try:
            layouts[short] = MatrixLayout.from_json(linear.in_features, linear.out_features, spec)
        except ValueError as err:
            raise ModelLoadError(f"quantization_config.modules[{name!r}]: {err}") from None
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
