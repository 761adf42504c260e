"""4-bit weight matmuls on x86 CPUs with AVX512-VNNI or AVX2 (cpu_quant_matmul.cpp) or AMX
(cpu_quant_matmul_amx.cpp), and their torch reference.

torch's int4 CPU kernel (`aten._weight_int4pack_mm_for_cpu`) converts every weight to float and
multiplies in float32: at one row it reads ~11 GB/s, and its cost grows with the rows (a
3072 x 576 matrix: 60 us at one row, 0.9 ms at 32). Here, much as llama.cpp multiplies q4_0 by
q8_0, each input row is quantized to int8 per group of the weight's inputs (one float step per
group, a multiple of 32 inputs, where q8_0 takes 32), and vpdpbusd multiplies 64 weight codes by 64 int8
inputs per instruction into int32 sums, which become float once per group, scaled by the input's
step and the weight's scale:

    y[m, n] = sum_g scale[n, g] * xstep[m, g] * ((codes[n, g] - center[g]) . xq[m, g])
              + zero[n, g] * sum_{k in g} x[m, k]

with w = (code - center) * scale + zero. A step per 32 inputs instead (as q8_0, and this kernel
before) cost a conversion and a multiply-add per row and block of 32 on the pipes the vpdpbusd
need: at 64 rows, groups of 96 multiplied 7% faster per group (576 x 576 to 3072 x 576, one
thread, in cache: 132-134 against 143-144 us, and so on), groups of 32 alike; `qrun ppl` KL of a
4.0-bpw SmolLM2 to the dense model (brown k and j, 4,096 tokens each) 0.16565 against 0.16537, and
0.1845 with one step per row. The zeros multiply the exact float sums of the inputs, and the codes
are centred on the middle of the range their group uses (center * sum xq[m, g] subtracted after
the int32 sum), so the rounding of x meets weights of at most half that range
rather than the codes themselves (up to 15 steps). Lanes hold 16 output channels, so a block of
weights is loaded and unpacked once for up to 6 rows (4 with two input digits), whose sums run as
independent chains, and no sum is reduced across lanes. In microbenchmarks on a 2-core AVX512 EPYC
(noisy: +-20% between runs), a 3072 x 576 matrix took 15-17 us at one row against ~60 us for
torch's int4 kernel, and ~0.28 ms at 32 rows against ~0.8 ms; SmolLM2's 4.0-bpw layer linears at
512 rows took 7.4-8.5 ms a layer against 9.2-9.8 for prepacked bfloat16 oneDNN matmuls of the
dense weights, so there the kernel serves every row count. On
CPUs with AMX (AMX-BF16) the tile unit multiplies bfloat16 rows from `tile_rows()` rows on
(cpu_quant_matmul_amx.cpp): the codes enter the tiles exactly (bfloat16 0x43cc is 128 + cc, two
byte shuffles from the packed nibbles, no float math per weight), x unrounded, each group summed in
float32 and scaled after, so its only rounding is float32 summation's (`quant_matmul_ref` within
1e-6 relative before the output's rounding). SmolLM2's 3072 x 576 at 32 rows: 0.15 ms against the
VNNI kernel's 0.23 (and oneDNN's 0.2 for the dense bfloat16 weight). Its per-group scaling grows
with the rows, so from `tile_dequantize_rows()` rows on it dequantizes each pair of channel
tiles' weights to bfloat16 once and sums all inputs on the tiles unscaled ("weights mode"), and
from `dequantize_rows()` rows on (prefill chunks beyond the default budget of 512 tokens) the weight is dequantized
(`dequantize_planes`, the reference's float weights rounded once to bfloat16) and multiplied by
oneDNN. `qrun ppl` KL of a 4.0-bpw SmolLM2 to the dense model (brown k and j, 2,048 tokens each,
windows of 512, a Xeon with AMX, one-off runs with the thresholds patched): 0.1619 with every row
on the AMX kernel, 0.1622 as chosen here, 0.1638 with every row on the VNNI kernel.

The inputs are rounded to one int8 digit per element (x ~ xstep * xq), or to two (x ~ xstep *
(xq + xq' / 254): 15 bits, exact for bfloat16 inputs in practice) at twice the multiplications,
which cost 1.2-1.8x (3072 x 576: 19-21 vs 15-17 us at one row, ~0.49 vs ~0.28 ms at 32). One
digit adds ~0.5% relative error to a product of random inputs. On a 4.0-bpw SmolLM2 (brown k and
j, 8,192 tokens, KL to the dense model), one digit everywhere raised the KL from 0.1665 (two
digits) to 0.1768, of which all but 0.0022 came from the head, whose errors go straight into the logits: so
the head takes two digits and the decoder layers one (`CpuQuantMatmul.input_digits`).

Layout (`pack`): codes [N / 16][K / 32][4][16][4] bytes: for a tile of 16 channels and a block of
32 inputs, 4 slices of 64 bytes, channel c's 4 bytes in slice s holding inputs 8s + j (low
nibble) and 8s + 4 + j (high nibble); scales and zeros float16 [N / 16][K / group][16]; centers
int8 [K / 32] (one value per group): w = (code - center) * scale + zero. A plane whose codes
need fewer bits stores them in as few (`code_bits`; cpu_quant_planes.h: 2 bits four to a byte, 1
bit eight, 3 bits eight to three bytes), and the kernels unpack them to that layout, so a 2- or
3-bit matrix reads its own width from memory rather than nibbles: a batch-1 step of a 3.0-bpw
SmolLM2 reads 67.6 MB instead of 90.7 (4.0 bpw: 83.0 instead of 93.7, its 6-bit head's upper
digits in 2 bits). Unpacking 3 bits takes 19 instructions a block of a tile against 12 for
nibbles, which reading fewer bytes repays once they come from memory: one-row products of 3-bit
3072 x 576 matrices in groups of 96 on a 2-core Xeon, one in a core's cache 79 against 80
Gweights/s as nibbles, 67 side by side (49 MB) 55 against 48, 1356 (1 GB, past every cache) 54
against 64 ms; SmolLM2, whose weights that Xeon's cache holds whole, ran as fast either way
(3.0-bpw 128-token single streams 425-457 tok/s against 432-438 as nibbles; one-off probes,
alternating). A second plane
(`high_*`) adds the upper digits of 5-8-bit codes over the first `k_high` inputs
(CpuQuantMatmul's split: qrun/quant.py), its scales 16x the low plane's (checked where the
planes meet the kernel): the VNNI kernel multiplies the two digits as one 8-bit code (vpdpbusd's
unsigned operand) at the instructions of one plane. SmolLM2's 6-bit head (49152 x 576, two input
digits) took 13.2 ms at 64 rows against 23.5 as two passes, and 0.83 against 0.91 at one row.
"""

from __future__ import annotations

import functools

import torch

from qrun.kernels import cpu_int4, cpu_library
from qrun.kernels.read_streams import DEFAULT_READ_STREAMS

TILE_N, BLOCK_K = 16, 32
TILE_ROWS, TILED_DEQUANTIZE_ROWS = 16, 1024  # tile_rows(), dequantize_rows()


@functools.cache
def available() -> bool:
    """Whether the kernel runs here (the library built, on a CPU with AVX512-VNNI, or AVX2 with FMA
    and F16C: "the VNNI kernel" names both). On AVX2 a tile's 16 channels are two 8-lane halves and
    vpdpbusd's sums of four byte products are vpmaddubsw's and vpmaddwd's: a 5-6-bit code whole, a
    7-8-bit code's two digits each on its own (its pairs of products could pass vpmaddubsw's int16
    sums); the same results but for the order of float32 sums. Whole, and its 4- and 2-bit planes'
    widths constants, a 4.0-bpw SmolLM2's 6-bit head took 1.06-1.11 ms at one row in cache (Python's
    call included) against 1.92-2.17 digit by digit with the widths read at run time (2-core Zen 3
    EPYC, one-off probes). Before it, torch's int4 kernel ran there: on this 2-core Xeon
    with the library built for x86-64-v3 and torch's and oneDNN's kernels held to AVX2
    (`QRUN_CPU_ARCH=x86-64-v3 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`, float32, no AMX;
    one-off probe, `LLM.generate`, greedy) a 4.0-bpw SmolLM2 ran a 128-token single stream at 234.0
    tok/s against 12.8, and the first 16 requests of mixed_lengths.jsonl (64 tokens at most) at
    195.7 against 93.9 (the dense model: 41.0 and 122.6)."""
    return cpu_library.available() and torch.ops.qrun.quant_matmul_available()


def takes(n: int, k: int, group: int) -> bool:
    """Whether an [n, k] weight in groups of `group` inputs fits the layout."""
    return n % TILE_N == 0 and k % BLOCK_K == 0 and group % BLOCK_K == 0 and k % group == 0


def pack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """codes [N, K] (0..15), scales and zeros [N, K / group] with w = (code - 8) * scale + zero
    (torch's int4 kernel's convention) -> the kernel's (codes, scales, zeros, centers): the codes
    in as few bits as the largest needs (`code_bits`), each group's codes centred on the middle of
    the range they use (a 2-bit group's on 2), the zeros moved to match."""
    n, k = codes.shape
    groups = scales.shape[1]
    per_group = codes.view(n, groups, -1)
    centers = (per_group.amin(dim=(0, 2)).int() + per_group.amax(dim=(0, 2)).int() + 1) // 2  # codes may be uint8
    # tile, block, vector q (inputs 4q .. 4q + 3 of each channel), channel, j
    vectors = codes.to(torch.uint8).view(n // TILE_N, TILE_N, k // BLOCK_K, 8, 4).permute(0, 2, 3, 1, 4)
    packed = _packed_vectors(vectors, code_bits(codes))
    centred_zeros = zeros + (centers - 8).to(scales.dtype) * scales
    block_centers = centers.repeat_interleave(k // groups // BLOCK_K).to(torch.int8)
    return packed.reshape(-1), _tiled(scales), _tiled(centred_zeros), block_centers


def code_bits(codes: torch.Tensor) -> int:
    """The bits a plane stores each of `codes` (0..15) in: as many as the largest needs (1-4)."""
    return max(1, int(codes.max()).bit_length())


def _packed_vectors(vectors: torch.Tensor, bits: int) -> torch.Tensor:
    """[tiles, blocks, 8, 16, 4] codes below 2^bits -> [tiles, blocks, 64 bits] bytes: vector q in
    slice q / (8 / bits), `bits` bits at bits * (q % (8 / bits)); 3 bits as cpu_quant_planes.h lays
    them out (vectors 2s, 2s + 1 in slice s, 6 and 7 split over the slices' top bits)."""
    tiles, blocks = vectors.shape[:2]
    # in uint8 throughout (each code's bits land in a range of their own): a head's pack at load holds a
    # few bytes a code at most
    if bits == 3:
        v = vectors.unbind(2)
        slices = [v[0] | v[1] << 3 | (v[6] & 3) << 6, v[2] | v[3] << 3 | (v[7] & 3) << 6,
                  v[4] | v[5] << 3 | (v[6] >> 2) << 6 | (v[7] >> 2) << 7]
        return torch.stack(slices, 2).view(tiles, blocks, 64 * bits)
    per_byte = 8 // bits
    digits = vectors.reshape(tiles, blocks, bits, per_byte, TILE_N, 4)
    packed = digits[:, :, :, 0].contiguous()
    for p in range(1, per_byte):
        packed |= digits[:, :, :, p] << bits * p
    return packed.view(tiles, blocks, 64 * bits)


def _unpacked_vectors(blocks: torch.Tensor, bits: int) -> torch.Tensor:
    """`_packed_vectors`' inverse: [tiles, blocks, 64 bits] bytes -> [tiles, blocks, 8, 16, 4] codes."""
    tiles, count = blocks.shape[:2]
    if bits == 3:
        b0, b1, b2 = blocks.reshape(tiles, count, 3, TILE_N, 4).int().unbind(2)
        v = [b0 & 7, b0 >> 3 & 7, b1 & 7, b1 >> 3 & 7, b2 & 7, b2 >> 3 & 7, b0 >> 6 | (b2 >> 6 & 1) << 2,
             b1 >> 6 | (b2 >> 7 & 1) << 2]
        return torch.stack(v, 2).to(torch.uint8)
    per_byte = 8 // bits
    slices = blocks.reshape(tiles, count, bits, 1, TILE_N, 4).int()
    shifts = (torch.arange(per_byte) * bits).view(per_byte, 1, 1)
    return ((slices >> shifts) & ((1 << bits) - 1)).to(torch.uint8).view(tiles, count, 8, TILE_N, 4)


def _tiled(values: torch.Tensor) -> torch.Tensor:
    n, groups = values.shape
    return values.to(torch.float16).view(n // TILE_N, TILE_N, groups).transpose(1, 2).contiguous()


def unpack(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, centers: torch.Tensor, group: int,
           n: int) -> torch.Tensor:
    """float32 [n, K]: the weight `pack` laid out."""
    k = centers.numel() * BLOCK_K
    bits = codes.numel() * 8 // (n * k)
    vectors = _unpacked_vectors(codes.view(n // TILE_N, k // BLOCK_K, 64 * bits), bits)
    # tile, channel, block, vector, j
    values = vectors.permute(0, 3, 1, 2, 4).reshape(n, k).float() - centers.float().repeat_interleave(BLOCK_K)

    def per_input(tiled):
        return tiled.float().transpose(1, 2).reshape(n, -1).repeat_interleave(group, dim=1)

    return values * per_input(scales) + per_input(zeros)


def quant_matmul_ref(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                     centers: torch.Tensor, group: int, out_features: int, high_codes: torch.Tensor | None,
                     high_scales: torch.Tensor | None, high_zeros: torch.Tensor | None,
                     high_centers: torch.Tensor | None, k_high: int, input_digits: int,
                     read_streams: int = DEFAULT_READ_STREAMS) -> torch.Tensor:
    """`quant_matmul` in float32 with float inputs (x unrounded, whatever `input_digits`; the
    streams change only the order in which the kernel reads the weights)."""
    rows = x.float()
    y = rows @ unpack(codes, scales, zeros, centers, group, out_features).T
    if high_codes is not None:
        y += rows[:, :k_high] @ unpack(high_codes, high_scales, high_zeros, high_centers, group, out_features).T
    return y.to(x.dtype)


@functools.cache
def tile_rows() -> int:
    """From how many rows of bfloat16 inputs `quant_matmul` runs the AMX kernel (0: never; it needs
    AMX-BF16 and the OS's consent); fewer rows stay on the VNNI kernel, which reads the codes once
    and multiplies them with fewer instructions. One matrix alone favours the tiles early (2-core
    Xeon with AMX, 3072 x 576 in groups of 96: 22 / 44 us at 1 row, VNNI / AMX, 75 / 71 at 8, 126 /
    90 at 16), but a whole model's products, each weight read from memory once, do not: SmolLM2's
    120 4.0-bpw layer linears took 5.5 / 6.9 ms at 8 rows, 6.7 / 7.3 at 12, 8.7 / 8.1 at 16 (its
    6-bit head 1.6 / 1.5 at 8), and a 4.0-bpw decode step at batch 8 and 12 (context 300, the C++
    step, policies alternating) 13.4 / 16.4 and 17.6 / 21.8 ms with the tiles from 16 rows against 8,
    the same from 16 rows on."""
    return TILE_ROWS if cpu_library.available() and torch.ops.qrun.quant_matmul_tiles_available() else 0


def tile_dequantize_rows(group: int, high_plane: bool) -> int:
    """From how many rows of bfloat16 inputs the AMX kernel runs in weights mode for a weight in
    groups of `group` inputs: the codes mode's scaling costs per row, group and plane, the weights
    mode's dequantization per weight (a high plane's digits dequantized with the low ones', so its
    tiles multiply once), overlapped with the products of the tiles before. SmolLM2's 4.0-bpw layer
    linears (30 layers' distinct weights, so read from memory as in a step) on a 2-core Xeon, ms,
    codes / weights mode: the 52 in groups of 32, 2.11 / 2.43 at 8 rows, 2.33 / 2.35 at 10, 3.14 /
    2.45 at 16; the 44 in groups of 96, 2.79 / 3.39 at 16, 3.69 / 3.63 at 24, 4.28 / 3.70 at 28; the
    24 in groups of 128, 1.22 / 1.42 at 24, 1.45 / 1.44 at 28; the 6-bit head (49152 x 576, groups
    of 96, a high plane) 2.17 / 2.51 at 16, 2.85 / 2.65 at 20, 3.13 / 2.61 at 24. So a quarter of
    the group, a fifth with a high plane."""
    return max(1, group // (5 if high_plane else 4))


@functools.cache
def dequantize_rows() -> int:
    """From how many rows of bfloat16 inputs `quant_matmul` dequantizes the weight to bfloat16 and
    lets oneDNN multiply (0: never). On CPUs with AMX oneDNN's bfloat16 matmul runs on the tile
    unit; against the AMX kernel in weights mode, which stores its sums as bfloat16 itself, it wins
    once the rows no longer fit the core's L2 alongside the weights (SmolLM2's 120 layer linears,
    30 layers' distinct weights, on a 2-core Xeon, ms, weights mode / dequantized + oneDNN: 25 / 25
    at 128 rows, 53 / 64 at 384, 68 / 75 at 512, 96 / 121 at 768, 180 / 145 at 1024, 328 / 202 at
    2048; oneDNN on the dense weights ~68 at 512); against the VNNI kernel from far fewer (at 512
    rows 0.85 + ~0.2 ms against 14 ms for one 3072 x 576 matrix). Without AMX the VNNI kernel was the
    faster at every row count (1.3x oneDNN at 512 rows on an AVX512-BF16 EPYC), and the AVX2 one on float32
    rows against MKL's float32 matmul of the dense weight on a 2-core Zen 3 EPYC (AVX2 alone; one-off probe,
    two threads) but for the down projection from ~128 rows: 3072 x 576 13.1 against 14.9 ms at 512 rows and
    1.46 against 2.17 at 64; 576 x 1536 7.6 against 6.5 at 512, 2.2 against 1.9 at 128, 0.86 against 0.95 at
    64. (A Xeon held to AVX2 had shown the opposite: its MKL was not held, and ran AVX-512.)"""
    if not cpu_library.has_amx():
        return 0
    return TILED_DEQUANTIZE_ROWS if tile_rows() else cpu_int4.DEQUANTIZE_ROWS


def dequantize_planes(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, centers: torch.Tensor,
                      group: int, out_features: int, high_codes: torch.Tensor | None, high_scales: torch.Tensor | None,
                      high_zeros: torch.Tensor | None, high_centers: torch.Tensor | None,
                      k_high: int) -> torch.Tensor:
    """bfloat16 [out_features, K]: the weight the planes hold (the low digits plus the high ones'
    prefix, summed in float32 and rounded once), from the C++ kernel; `unpack` is its reference.
    The transpose of an input-major [K, out_features] tensor: 16 channels dequantize together, so
    each input's values are one store (3072 x 576 in groups of 32 on a 2-core Xeon: ~0.2 ms,
    against ~0.3 for the channel-major kernel before it), and oneDNN multiplies it as fast."""
    return torch.ops.qrun.dequantize_planes(codes, scales, zeros, centers, group, out_features, high_codes,
                                            high_scales, high_zeros, high_centers, k_high)


def gather_columns_ref(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """x[:, index] for x [rows, K], index int64: act order's gather of a linear's inputs."""
    return x.index_select(1, index)


def gather_columns(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """`gather_columns_ref` through the C++ op (6.7x faster at 512 rows of 576 bfloat16 values,
    4.3x at 32)."""
    return torch.ops.qrun.gather_columns(x if x.stride(-1) == 1 else x.contiguous(), index)


def quant_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 centers: torch.Tensor, group: int, out_features: int, high_codes: torch.Tensor | None,
                 high_scales: torch.Tensor | None, high_zeros: torch.Tensor | None, high_centers: torch.Tensor | None,
                 k_high: int, input_digits: int, read_streams: int = DEFAULT_READ_STREAMS) -> torch.Tensor:
    """y [M, out_features] (x's dtype) = x W^T (+ x[:, :k_high] W_high^T): the VNNI kernel with x
    rounded to `input_digits` int8 digits (1 or 2), its float32 sums rounded to bfloat16 as it stores
    them where one plane multiplies bfloat16 rows (no float32 output and second pass: ~1 us a call
    at one row), each thread reading `read_streams` runs of weights side by side at one or two rows
    (`read_streams.py`); bfloat16 rows from `tile_rows()` rows on the
    AMX kernel (x as it is; in weights mode from `tile_dequantize_rows()` rows), from
    `dequantize_rows()` on oneDNN on the dequantized weight (the op decides; the C++ model
    passes it the same thresholds)."""
    return torch.ops.qrun.quant_matmul(x, codes, scales, zeros, centers, group, out_features, high_codes, high_scales,
                                       high_zeros, high_centers, k_high, input_digits, tile_rows(),
                                       tile_dequantize_rows(group, high_codes is not None), dequantize_rows(),
                                       read_streams)
