"""The packed weight format (runtime-owned; the converter writes it): the linears of a decoder
layer and the inputs they share, bit packing of quantized weights and the exact bit accounting
of a quantized matrix.

The layout is specified in docs/FORMAT.md; this module is its reference implementation.

A quantized linear of shape [N out, K in] stores, in *permuted* input order (act-order):
- qweight int32 [R, N]: the input rows, group after group; a group of G rows at b bits takes
  G*b/32 words per output column. Inside a group every run of 32 consecutive rows becomes b
  words: row j of the run sits at bit j*b of the run's little-endian b-word bit string (a value
  may straddle two words).
- qgroups int32 [n_groups, 2]: (bits, first qweight row) of each group.
- scales uint8 [n_groups, N] with scale_max float16 [N]; when asymmetric also mins int8
  [n_groups, N] with min_absmax float16 [N] (8-bit codes against a range per output column).
- perm int16 (int32 when K > 32767) [K]: permuted row i is original input column perm[i];
  absent when the rows are in the original order (no act-order), which saves 16/N bpw.
- rotation uint8 [K/8] (rotated matrices only): the packed signs of the input rotation
  (kernels/rotation.py); the weights are stored in the rotated basis and inputs are rotated
  before the matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from qrun.kernels.dequant_matmul import unpack_rows

FORMAT_VERSION = 3  # quantization_config.version: 2 stores group scales and mins as 8-bit codes, 3 adds rotations
READABLE_VERSIONS = (2, 3)  # version 2 is version 3 without rotated matrices
BIT_WIDTHS = (2, 3, 4, 5, 6, 8)
DEFAULT_HEAD_BITS = 6  # lm_head's bits when `qrun convert` is not told (--head-bits)
CHUNK = 32  # rows packed together: 32 values of b bits fill exactly b words

# A decoder layer's linears, named as in checkpoints (within `layers.{i}.`), by the input each
# reads, inputs and linears in forward order. The linears of one input are quantized as one
# matrix: one Hessian, one candidate and, when rotated, one set of signs, which is what lets the
# loader rotate that input once for all of them.
LAYER_INPUTS: dict[str, tuple[str, ...]] = {
    "attn_in": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "attn_out": ("self_attn.o_proj",),
    "mlp_in": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp_out": ("mlp.down_proj",),
}
LAYER_LINEARS = tuple(name for names in LAYER_INPUTS.values() for name in names)


@dataclass(frozen=True)
class MatrixLayout:
    """Shape of one quantized matrix: the bits of each group, group size, symmetric or not."""

    in_features: int
    out_features: int
    group_size: int
    group_bits: tuple[int, ...]  # one entry per group, in permuted order
    asym: bool
    permuted: bool = True  # False: rows in original input order, no perm tensor
    rotated: bool = False  # True: stored in the rotated input basis, with a rotation tensor

    def __post_init__(self) -> None:
        if self.group_size % CHUNK or self.group_size <= 0:
            raise ValueError(f"group size {self.group_size} is not a positive multiple of {CHUNK}")
        if self.in_features % self.group_size:
            raise ValueError(f"in_features {self.in_features} is not a multiple of group size {self.group_size}")
        if len(self.group_bits) != self.in_features // self.group_size:
            raise ValueError(f"{len(self.group_bits)} group bit widths for {self.in_features // self.group_size} groups")
        bad = sorted(set(self.group_bits) - set(BIT_WIDTHS))
        if bad:
            raise ValueError(f"unsupported bit widths {bad}; supported: {BIT_WIDTHS}")

    @property
    def num_groups(self) -> int:
        return len(self.group_bits)

    @property
    def qweight_rows(self) -> int:
        return sum(self.group_size * b // CHUNK for b in self.group_bits)

    @property
    def perm_dtype(self) -> torch.dtype:
        return torch.int16 if self.in_features <= 32767 else torch.int32

    def runs(self) -> list[tuple[int, int]]:
        """(bits, number of groups) of each run of equal widths, in order."""
        out: list[list[int]] = []
        for b in self.group_bits:
            if out and out[-1][0] == b:
                out[-1][1] += 1
            else:
                out.append([b, 1])
        return [(b, n) for b, n in out]

    def to_json(self) -> dict:
        return {"group_size": self.group_size, "asym": self.asym, "permuted": self.permuted,
                "rotated": self.rotated, "bits": [list(r) for r in self.runs()]}

    @classmethod
    def from_json(cls, in_features: int, out_features: int, spec: dict) -> "MatrixLayout":
        """The layout `to_json` wrote. A malformed `spec` is a ValueError saying what is wrong, found
        before the runs are expanded (a run may claim any number of groups)."""
        if not isinstance(spec, dict):
            raise ValueError(f"a layout must be an object, got {type(spec).__name__}")
        group_size, runs = spec.get("group_size"), spec.get("bits")
        flags = {key: spec.get(key, default)
                 for key, default in (("asym", None), ("permuted", True), ("rotated", False))}
        if not _is_int(group_size) or group_size <= 0 or group_size % CHUNK or in_features % group_size:
            raise ValueError(f"group_size {group_size!r} is not a positive multiple of {CHUNK} dividing "
                             f"in_features {in_features}")
        bad_flags = [key for key, value in flags.items() if not isinstance(value, bool)]
        if bad_flags:
            raise ValueError(f"{', '.join(bad_flags)} must be true or false")
        if not isinstance(runs, list) or not all(isinstance(r, list) and len(r) == 2 and all(map(_is_int, r))
                                                 and r[1] > 0 for r in runs):
            raise ValueError("bits must be a list of [bits, number of groups] runs")
        claimed, groups = sum(n for _, n in runs), in_features // group_size
        if claimed != groups:
            raise ValueError(f"bits runs cover {claimed} groups, the matrix has {groups}")
        bits = tuple(b for b, n in runs for _ in range(n))
        return cls(in_features, out_features, group_size, bits, flags["asym"], flags["permuted"], flags["rotated"])

    def tensor_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Every tensor this matrix writes: suffix -> (shape, dtype). Biases are not counted."""
        n, g = self.out_features, self.num_groups
        shapes = {
            "qweight": ((self.qweight_rows, n), torch.int32),
            "qgroups": ((g, 2), torch.int32),
            "scales": ((g, n), torch.uint8),
            "scale_max": ((n,), torch.float16),
        }
        if self.permuted:
            shapes["perm"] = ((self.in_features,), self.perm_dtype)
        if self.rotated:
            shapes["rotation"] = ((self.in_features // 8,), torch.uint8)
        if self.asym:
            shapes["mins"] = ((g, n), torch.int8)
            shapes["min_absmax"] = ((n,), torch.float16)
        return shapes

    def storage_bits(self) -> int:
        """Bits written for this matrix, all tensors counted (what bits-per-weight is made of)."""
        total = 0
        for shape, dtype in self.tensor_shapes().values():
            count = 1
            for s in shape:
                count *= s
            total += count * torch.tensor([], dtype=dtype).element_size() * 8
        return total

    def bpw(self) -> float:
        return self.storage_bits() / (self.in_features * self.out_features)

    def qgroups(self) -> torch.Tensor:
        rows, out = 0, []
        for b in self.group_bits:
            out.append((b, rows))
            rows += self.group_size * b // CHUNK
        return torch.tensor(out, dtype=torch.int32).reshape(-1, 2)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding unsigned 32-bit values -> int32 with the same bits."""
    return (words - ((words >> 31) & 1) * (1 << 32)).to(torch.int32)


def pack_run(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack rows of unsigned values q [rows, N] (rows a multiple of 32) into int32 [rows*bits/32, N]."""
    rows, n = q.shape
    if rows % CHUNK:
        raise ValueError(f"{rows} rows is not a multiple of {CHUNK}")
    q = q.to(torch.int64).reshape(rows // CHUNK, CHUNK, n)
    if q.numel() and (q.min() < 0 or q.max() >= (1 << bits)):
        raise ValueError(f"values outside [0, {1 << bits}) cannot be packed at {bits} bits")
    words = torch.zeros(rows // CHUNK, bits, n, dtype=torch.int64)
    for j in range(CHUNK):
        offset = j * bits
        w, s = divmod(offset, 32)
        words[:, w] |= (q[:, j] << s) & 0xFFFFFFFF
        if s + bits > 32:
            words[:, w + 1] |= q[:, j] >> (32 - s)
    return _to_int32(words.reshape(rows // CHUNK * bits, n))


def pack_matrix(q: torch.Tensor, layout: MatrixLayout) -> torch.Tensor:
    """q [K, N] unsigned integers in permuted row order -> qweight int32 [R, N]."""
    parts, row = [], 0
    for bits, groups in layout.runs():
        rows = groups * layout.group_size
        parts.append(pack_run(q[row:row + rows], bits))
        row += rows
    return torch.cat(parts, 0)


def unpack_matrix(qweight: torch.Tensor, layout: MatrixLayout) -> torch.Tensor:
    """qweight int32 [R, N] -> codes uint8 [K, N], permuted row order."""
    parts, row = [], 0
    for bits, groups in layout.runs():
        words = groups * layout.group_size * bits // CHUNK
        parts.append(unpack_rows(qweight[row:row + words], bits))
        row += words
    return torch.cat(parts, 0)


def dequantize_groups(q: torch.Tensor, group_bits: torch.Tensor, group_size: int,
                      scales: torch.Tensor, mins: torch.Tensor | None) -> torch.Tensor:
    """Unsigned q [K, N] (permuted order) and each group's float scale and min [G, N] -> float32
    weights [K, N] (permuted order). Asymmetric: w = q * scale + min. Symmetric: w = (q - 2^(bits-1)) * scale.
    """
    s = scales.float().repeat_interleave(group_size, 0)
    if mins is not None:
        return q.float() * s + mins.float().repeat_interleave(group_size, 0)
    mid = (1 << group_bits.long()).float().repeat_interleave(group_size, 0)[:, None] / 2
    return (q.float() - mid) * s
