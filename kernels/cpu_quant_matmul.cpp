// y = x W^T for 4-bit weights on x86 CPUs with AVX512-VNNI, or AVX2: activations quantized to int8 per row and
// weight group (one step per group, a multiple of 32 inputs), weights' 4-bit codes multiplied by them with vpdpbusd
// (64 unsigned x signed byte products per instruction; on AVX2 vpmaddubsw and vpmaddwd, 32 products in two
// instructions). Layout and reasons: kernels/cpu_quant_matmul.py.
//
// codes:   a qrun_plane (cpu_quant_planes.h): for a tile of 16 output channels and a block of 32 inputs, 4 slices
//          of 64 bytes; in slice s, channel c's 4 bytes hold the codes of inputs 8s + j (low nibble) and 8s + 4 + j
//          (high nibble), j = 0..3, as qrun_plane_slice gives them from a plane of 1-4 bits a code. So one slice is
//          one vpdpbusd operand per nibble: a lane per output channel, 4 inputs per lane.
// scales, zeros: float16 [N / 16][K / group][16], centers: int8 [K / 32] (one value per group):
//          w = (code - center) * scale + zero.
// A second plane over the first k_high inputs holds the upper digits of 5-8-bit codes, its scales 16x the low
// plane's: the two digits multiply as one 8-bit code (vpdpbusd's unsigned operand), w = (16 high + low - (16
// high_center + center)) * scale + zero + high_zero, at the instructions of one 4-bit plane (on AVX2 as well up to
// 6-bit codes; wider ones a digit at a time, as vpmaddubsw's pairs of their products could pass its int16 sums).

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_quant_planes.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define QRUN_HAS_VNNI 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QRUN_HAS_AVX2_PRODUCT 1
#endif
#if defined(QRUN_HAS_VNNI) || defined(QRUN_HAS_AVX2_PRODUCT)
#include <immintrin.h>
#include <omp.h>
#define QRUN_HAS_PRODUCT 1
#endif

#ifdef QRUN_HAS_PRODUCT
namespace {

constexpr int64_t TILE_N = 16, BLOCK_K = 32;
// Many rows (a prefill chunk) run in blocks of about this many bytes of int8 inputs, each block over all of a thread's
// tiles: the block stays in the core's caches while its weights stream past (512 rows, one digit: 3072 x 576 ~5%,
// 576 x 1536 ~20% faster than all rows per tile).
constexpr int64_t ROW_BLOCK_BYTES = 1 << 16;
// Bytes of codes ahead of the stream fetched into L1 (~10% faster from DRAM on a Xeon) and, further, into L2: at one
// or two rows the product runs ahead of what a 2-core EPYC's (Zen 4) own prefetchers bring while its memory is slow
// (one-off probes in issue 15's notes; the serving benchmark's single stream did not move).
constexpr int64_t PREFETCH = 1024, PREFETCH_L2 = 8192;

// The lines (64 bytes each) of a block of codes, ahead of the stream it is in.
inline void prefetch_ahead(const uint8_t* block, int lines) {
    for (int line = 0; line < lines; line++) {
        _mm_prefetch(reinterpret_cast<const char*>(block + 64 * line + PREFETCH), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(block + 64 * line + PREFETCH_L2), _MM_HINT_T1);
    }
}

// The scales and zeros are streams of their own beside each tile's codes, 32 bytes a group, which the hardware's
// prefetchers follow late: fetched into L1 SCALES_AHEAD values (512 bytes) ahead of the group being scaled. C++ steps
// of a 4.0-bpw SmolLM2, a 2-core Xeon, alternating with the kernel without them in one process (one-off probes): one
// row of 200 tokens 1.00-1.05x over five runs (1.01-1.02x at 256 bytes ahead, 1.01x at 8 KiB), 8 rows 1.00x, 32 rows
// 1.06x.
constexpr int64_t SCALES_AHEAD = 256;

inline void prefetch_scales(const uint16_t* stream) {
    _mm_prefetch(reinterpret_cast<const char*>(stream + SCALES_AHEAD), _MM_HINT_T0);
}

// A tile_rows' multiply_groups<upper, BITS>(first, last) over the groups the high plane covers (qrun_planes_fit makes
// them whole groups), with its upper digits, then over the rest; the low plane's usual code widths (4 and 3 bits) as
// constants, so their unpacking and prefetches unroll (BITS 0: the width read at run time).
template <typename MultiplyGroups>
inline void multiply_planes(const MultiplyGroups& multiply_groups, int low_bits, int64_t high_groups, int64_t groups) {
    multiply_groups.template operator()<true, 0>(0, high_groups);
    if (low_bits == 4)
        multiply_groups.template operator()<false, 4>(high_groups, groups);
    else if (low_bits == 3)
        multiply_groups.template operator()<false, 3>(high_groups, groups);
    else
        multiply_groups.template operator()<false, 0>(high_groups, groups);
}

// x ~ step * (high + low / LOW_STEPS) per group: one int8 digit (high), or two, as
// precise as 15 bits, at twice the multiplications.
constexpr float LOW_STEPS = 254.f;

struct QuantizedRows {
    std::vector<int8_t> high, low;  // [M, K]
    std::vector<float> steps;  // [M, K / group]: the int8 step of each row's inputs in a weight group
    std::vector<float> group_sums;  // [M, K / group]: the float inputs summed, for the zeros
    std::vector<float> rounded_sums;  // [M, K / group]: the same of the rounded inputs, for the centers
};

// The calling thread's QuantizedRows, sized for `rows` rows of k inputs, reused by its next call (a decode step makes
// ~120).
QuantizedRows& calling_thread_rows(int64_t rows, int64_t k, int64_t groups, bool two_digits) {
    thread_local QuantizedRows kept;
    kept.high.resize(rows * k);
    kept.low.resize(two_digits ? rows * k : 0);
    kept.steps.resize(rows * groups);
    kept.group_sums.resize(rows * groups);
    kept.rounded_sums.resize(rows * groups);
    return kept;  // the caller's: a parallel region's threads naming `kept` would get their own
}

// The weights of a product, [n, low.k] in groups of `group` inputs: the low digits' plane and, over the first high.k
// inputs, the upper digits of 5-8-bit codes (high.codes null: none; their scales, 16x the low ones', are not read).
struct Weights {
    qrun_plane low, high;
    int64_t n, group;
};

// What a call writes (qrun_quant_matmul's y_kind): float32 sums, bfloat16 rounded once from them, or that bfloat16
// widened back to float32 (a bfloat16 model's logits as compute_logits widens them, with no pass of its own).
enum OutputKind { FLOAT32 = 0, BFLOAT16 = 1, BFLOAT16_WIDENED = 2 };

}  // namespace
#endif

#ifdef QRUN_HAS_VNNI
namespace {

// Rows a channel tile's block of weights is unpacked for: 6, or 4 with two input digits, where 6 rows' two sums each
// beside the weights outgrow the 32 vector registers (the 6-bit head at 64 rows, against 6 rows before their sums ran
// side by side: 4 rows 1.00-1.02x, 3 rows 0.96x, 5 rows 0.89x).
template <bool two_digits>
constexpr int64_t ROW_TILE = two_digits ? 4 : 6;

// 16 inputs from float32 or bfloat16 (its upper half).
template <typename In>
inline __m512 load16(const In* at) {
    if constexpr (sizeof(In) == 4) return _mm512_loadu_ps(at);
    const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(at));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
}

// x's rows quantized into the calling thread's buffers (calling_thread_rows). Many rows split over the threads:
// serial, 64 rows of 1536 inputs took ~10% of a 576 x 1536 product.
template <typename In>
const QuantizedRows& quantize_rows(const In* x, int64_t rows, int64_t ldx, int64_t k, int64_t group, bool two_digits,
                                   int threads) {
    const int64_t groups = k / group;
    QuantizedRows& q = calling_thread_rows(rows, k, groups, two_digits);
    qrun_parallel_for(rows, threads, rows * k >= (1 << 14), [&](int64_t m) {
        for (int64_t g = 0; g < groups; g++) {
            const In* inputs = x + m * ldx + g * group;
            __m512 top16 = _mm512_setzero_ps(), sum = _mm512_setzero_ps();
            for (int64_t i = 0; i < group; i += 16) {
                const __m512 values = load16(inputs + i);
                top16 = _mm512_max_ps(top16, _mm512_abs_ps(values));
                sum = _mm512_add_ps(sum, values);
            }
            const float top = _mm512_reduce_max_ps(top16), step = top / 127.f;
            const __m512 inverse = _mm512_set1_ps(top > 0.f ? 127.f / top : 0.f);
            __m512 rounded_sum = _mm512_setzero_ps();
            for (int64_t i = 0; i < group; i += 16) {
                const __m512 scaled = _mm512_mul_ps(load16(inputs + i), inverse);
                const __m512 rounded = _mm512_roundscale_ps(scaled, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                const int64_t at = m * k + g * group + i;
                _mm_storeu_si128(reinterpret_cast<__m128i*>(q.high.data() + at),
                                 _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(rounded)));
                rounded_sum = _mm512_add_ps(rounded_sum, rounded);
                if (two_digits) {
                    const __m512 low = _mm512_roundscale_ps(
                        _mm512_mul_ps(_mm512_sub_ps(scaled, rounded), _mm512_set1_ps(LOW_STEPS)),
                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
                    _mm_storeu_si128(reinterpret_cast<__m128i*>(q.low.data() + at),
                                     _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(low)));
                    rounded_sum = _mm512_fmadd_ps(low, _mm512_set1_ps(1.f / LOW_STEPS), rounded_sum);
                }
            }
            q.steps[m * groups + g] = step;
            q.rounded_sums[m * groups + g] = _mm512_reduce_add_ps(rounded_sum) * step;
            q.group_sums[m * groups + g] = _mm512_reduce_add_ps(sum);
        }
    });
    return q;
}

// 16 float16 values as floats.
inline __m512 load_halves(const uint16_t* at) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
}

// 16 floats -> bfloat16 bits, rounded to nearest even as qrun_bfloat16_bits (NaN too: 0x7FC0); one instruction with
// AVX512-BF16 (whose conversion flushes denormals, which neither weights nor sums here are).
inline __m256i to_bfloat16(__m512 values) {
#if defined(__AVX512BF16__)
    return _mm256_mask_blend_epi16(_mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q),
                                   __m256i(_mm512_cvtneps_pbh(values)), _mm256_set1_epi16(0x7FC0));
#else
    return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(qrun_round16<QRUN_BF16>(values)), 16));
#endif
}

// Where a call writes: y [rows, n] with row stride ldy, of its kind. Or, where gate_tiles is set (n = 2 x 16
// gate_tiles), gated: y [rows, n / 2] = silu(gate) * up of the product's first n / 2 channels (the gates) and its last
// (the ups), as kernels/cpu_activation.cpp computes it from the rounded product (float32 or bfloat16). A gate tile's
// values wait in y where their product goes until the same thread stores its up tile (each thread's tiles ordered so:
// its work is gate tiles with their up tiles), so the MLP's activation needs no pass of its own after the product.
struct Output {
    void* y;
    int64_t ldy;
    OutputKind kind;
    int64_t gate_tiles = 0;

    void store(int64_t row, int64_t tile, __m512 values) const {
        if (gate_tiles && tile >= gate_tiles) return store_gated(row * ldy + (tile - gate_tiles) * TILE_N, values);
        const int64_t at = row * ldy + tile * TILE_N;
        if (kind == BFLOAT16)
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(y) + at), to_bfloat16(values));
        else if (kind == BFLOAT16_WIDENED)
            _mm512_storeu_ps(static_cast<float*>(y) + at, widen(to_bfloat16(values)));
        else
            _mm512_storeu_ps(static_cast<float*>(y) + at, values);
    }

  private:
    static __m512 widen(__m256i bfloat16) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bfloat16), 16));
    }

    // the up tile's values at y[at]: silu of the gate stored there, times them
    void store_gated(int64_t at, __m512 up) const {
        if (kind == BFLOAT16)
            qrun_store16<QRUN_BF16>(
                y, at, qrun_gated16<QRUN_BF16>(qrun_load16<QRUN_BF16>(y, at), widen(to_bfloat16(up))));
        else
            qrun_store16<QRUN_F32>(y, at, qrun_gated16<QRUN_F32>(qrun_load16<QRUN_F32>(y, at), up));
    }
};

// Rows m0 .. m0 + R of y's channel tiles tiles[0 .. T), every input: the weights of a block are unpacked once for
// the R rows, whose int32 sums stay in registers. The T tiles are read side by side, as separate streams. Flattened
// (every call in it inlined), as its lambdas are written to be: the inliner, left to its budget for the whole file,
// made the AVX2 path's join_upper a shared function of its own when this file grew by a few functions.
template <int R, int T, bool two_digits>
[[gnu::flatten]] void tile_rows(const Weights& weights, const QuantizedRows& x, int64_t m0, const Output& out,
                                const int64_t* tiles) {
    const qrun_plane &low_plane = weights.low, &high_plane = weights.high;
    const int64_t k = low_plane.k, group = weights.group;
    const int64_t groups = k / group, blocks_per_group = group / BLOCK_K, high_groups = high_plane.k / group;
    const int64_t block_bytes = low_plane.block_bytes(), high_block_bytes = high_plane.block_bytes();
    __m512 total[T][R];
    // Each row's int32 sums over the group so far, by the inputs' digit: the group's inputs share one step. Each
    // vpdpbusd waits for the one before on its sum (~5 cycles), so where few sums run side by side (one or two rows
    // and tiles) each runs as two chains, over the even and the odd code vectors.
    constexpr int CHAINS = R * T * (two_digits ? 2 : 1) < 4 ? 2 : 1;
    __m512i high_dot[T][R][CHAINS], low_dot[T][R][CHAINS];
    const auto clear_sums = [&](int t, int r) {
        for (int c = 0; c < CHAINS; c++) high_dot[t][r][c] = low_dot[t][r][c] = _mm512_setzero_si512();
    };
    const auto summed = [](const __m512i (&chains)[CHAINS]) {
        return CHAINS == 2 ? _mm512_add_epi32(chains[0], chains[CHAINS - 1]) : chains[0];
    };
    const uint8_t* tile_codes[T];
    const uint8_t* tile_high_codes[T];
    for (int t = 0; t < T; t++) {
        tile_codes[t] = low_plane.block(tiles[t], 0);
        tile_high_codes[t] = high_plane.codes ? high_plane.block(tiles[t], 0) : nullptr;
        for (int r = 0; r < R; r++) {
            total[t][r] = _mm512_setzero_ps();
            clear_sums(t, r);
        }
    }
    const __m512i low_nibbles = _mm512_set1_epi8(15);
    // One row's input digits of a block, broadcast once for all T tiles (at more rows or two digits they would not
    // fit in the registers beside the tiles' sums and codes): one-row products of a 2048 x 1536 4-bit matrix in L2,
    // with that, the tiles' loop unrolled and the code width a constant, 1.13-1.22x faster than without (3-bit codes
    // 1.14-1.17x; two input digits, the last two alone, 1.10-1.13x; one-off probes alternating in one process on a
    // 2-core Xeon; the same sums).
    constexpr bool shared_inputs = R == 1 && !two_digits;
    // Block b of every tile into the sums, its codes BITS wide (0: the low plane's width, read at run time); with the
    // high plane, each weight an 8-bit code (its high digit's nibble above its low digit's) times the low plane's
    // scale, centred on both planes' centres; the high plane's scale, 16x, is not read.
    const auto multiply_block = [&]<bool upper, int BITS>(int64_t b) {
        const int low_bits = BITS ? BITS : low_plane.bits;
        const int64_t at = m0 * k + b * BLOCK_K;
        const int32_t* high = reinterpret_cast<const int32_t*>(x.high.data() + at);
        const int32_t* low = two_digits ? reinterpret_cast<const int32_t*>(x.low.data() + at) : nullptr;
        [[maybe_unused]] __m512i inputs[8];
        if constexpr (shared_inputs)
            for (int q = 0; q < 8; q++) inputs[q] = _mm512_set1_epi32(high[q]);
        const auto multiply_tile = [&](int t) {
            const uint8_t* block = tile_codes[t] + b * block_bytes;
            const uint8_t* high_block = upper ? tile_high_codes[t] + b * high_block_bytes : nullptr;
            prefetch_ahead(block, low_bits);  // a line a bit of the codes' width
            if constexpr (upper) prefetch_ahead(high_block, high_plane.bits);
            __m512i w[8], upper_digits[8];
            if constexpr (upper) qrun_plane_upper_vectors(high_block, high_plane.bits, upper_digits);
            if (low_bits == 4) {
                for (int s = 0; s < 4; s++) {
                    const __m512i bytes = _mm512_loadu_si512(block + 64 * s);
                    if constexpr (upper) {
                        // bitwise select (0xCA): low_nibbles' bits from the second operand, the rest from the third
                        w[2 * s] = _mm512_ternarylogic_epi32(low_nibbles, bytes, upper_digits[2 * s], 0xCA);
                        w[2 * s + 1] = _mm512_ternarylogic_epi32(low_nibbles, _mm512_srli_epi16(bytes, 4),
                                                                 upper_digits[2 * s + 1], 0xCA);
                    } else {
                        w[2 * s] = _mm512_and_si512(bytes, low_nibbles);
                        w[2 * s + 1] = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
                    }
                }
            } else {
                qrun_plane_vectors(block, low_bits, w);
                if constexpr (upper)
                    for (int q = 0; q < 8; q++)
                        w[q] = _mm512_ternarylogic_epi32(low_nibbles, w[q], upper_digits[q], 0xCA);
            }
            // the rows' sums input by input, side by side: R independent chains of vpdpbusd in flight (row by row,
            // one digit ran ~10% slower at 64 rows)
            for (int q = 0; q < 8; q++)
                for (int r = 0; r < R; r++) {
                    __m512i& high_sum = high_dot[t][r][q % CHAINS];
                    const __m512i input = shared_inputs ? inputs[q] : _mm512_set1_epi32(high[r * k / 4 + q]);
                    high_sum = _mm512_dpbusd_epi32(high_sum, w[q], input);
                    if constexpr (two_digits) {
                        __m512i& low_sum = low_dot[t][r][q % CHAINS];
                        low_sum = _mm512_dpbusd_epi32(low_sum, w[q], _mm512_set1_epi32(low[r * k / 4 + q]));
                    }
                }
        };
        // unrolled, the tiles' sums stay in registers; but beside the upper digits' vectors the tiles' codes then
        // spill (those products 0.88-0.96x, in the same probes)
        if constexpr (upper)
            for (int t = 0; t < T; t++) multiply_tile(t);
        else
#pragma GCC unroll 8
            for (int t = 0; t < T; t++) multiply_tile(t);
    };
    // Groups [first, last): their blocks' sums, then each scaled into the totals.
    const auto multiply_groups = [&]<bool upper, int BITS>(int64_t first, int64_t last) {
        for (int64_t g = first; g < last; g++) {
            for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; b++)
                multiply_block.template operator()<upper, BITS>(b);
            // (code - center) . x: centred codes, so x's rounding meets weights of at most half the group's range
            // (center x sum(x) is in the zeros, with x's float sums)
            const int64_t b = (g + 1) * blocks_per_group - 1;
            const float center = upper ? low_plane.centers[b] + 16.f * high_plane.centers[b] : low_plane.centers[b];
            for (int t = 0; t < T; t++) {
                const int64_t at = (tiles[t] * groups + g) * TILE_N;
                prefetch_scales(low_plane.scales + at);
                prefetch_scales(low_plane.zeros + at);
                const __m512 scale = load_halves(low_plane.scales + at);
                __m512 zero = load_halves(low_plane.zeros + at);
                if constexpr (upper) {
                    const uint16_t* high = high_plane.zeros + (tiles[t] * high_groups + g) * TILE_N;
                    prefetch_scales(high);
                    zero = _mm512_add_ps(zero, load_halves(high));
                }
                for (int r = 0; r < R; r++) {
                    __m512 dot = _mm512_cvtepi32_ps(summed(high_dot[t][r]));
                    if constexpr (two_digits)
                        dot = _mm512_fmadd_ps(_mm512_cvtepi32_ps(summed(low_dot[t][r])),
                                              _mm512_set1_ps(1.f / LOW_STEPS), dot);
                    const __m512 centred =
                        _mm512_sub_ps(_mm512_mul_ps(dot, _mm512_set1_ps(x.steps[(m0 + r) * groups + g])),
                                      _mm512_set1_ps(center * x.rounded_sums[(m0 + r) * groups + g]));
                    total[t][r] = _mm512_fmadd_ps(centred, scale, total[t][r]);
                    total[t][r] = _mm512_fmadd_ps(zero, _mm512_set1_ps(x.group_sums[(m0 + r) * groups + g]),
                                                  total[t][r]);
                    clear_sums(t, r);
                }
            }
        }
    };
    multiply_planes(multiply_groups, low_plane.bits, high_groups, groups);
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++) out.store(m0 + r, tiles[t], total[t][r]);
}

// The weights of channel tile `tile` in block b of `plane` (groups of `group` inputs), 16 channels a vector:
// values[i] holds input 32 b + i. As cpu_quant_matmul.py's unpack, the product with the scale and the sum with the
// zero each rounded (no fused multiply-add: the exact float weights the reference gives).
void dequantize_tile_block(const qrun_plane& plane, int64_t group, int64_t tile, int64_t b, __m512 values[BLOCK_K]) {
    const int64_t at = (tile * (plane.k / group) + b * BLOCK_K / group) * TILE_N;
    const __m512 scale = load_halves(plane.scales + at), zero = load_halves(plane.zeros + at);
    const __m512 center = _mm512_set1_ps(float(plane.centers[b]));
    const __m512i nibble = _mm512_set1_epi32(15);
    const uint8_t* block = plane.block(tile, b);
    for (int slice = 0; slice < 4; slice++) {  // channel c's 4 bytes: inputs 8s + j (low nibbles), 8s + 4 + j (high)
        const __m512i words = qrun_plane_slice<__m512i>(block, plane.bits, slice);
        for (int j = 0; j < 4; j++)
            for (int half = 0; half < 2; half++) {
                const __m512i codes = _mm512_and_si512(_mm512_srli_epi32(words, 8 * j + 4 * half), nibble);
                const __m512 product = _mm512_mul_ps(_mm512_sub_ps(_mm512_cvtepi32_ps(codes), center), scale);
                values[8 * slice + 4 * half + j] = _mm512_add_ps(product, zero);
            }
    }
}

// Channel tile `tile`'s weights in block b, the high plane's added where it covers the block (null: none), stored as
// bfloat16 in rows 32 b .. 32 b + 31 of out (row stride ldo): qrun_dequantize_planes' unit.
void store_dequantized_block(const qrun_plane& low, const qrun_plane* high, int64_t group, int64_t tile, int64_t b,
                             uint16_t* out, int64_t ldo) {
    __m512 values[BLOCK_K], upper[BLOCK_K];
    dequantize_tile_block(low, group, tile, b, values);
    if (high) {
        dequantize_tile_block(*high, group, tile, b, upper);
        for (int i = 0; i < BLOCK_K; i++) values[i] = _mm512_add_ps(values[i], upper[i]);
    }
    for (int i = 0; i < BLOCK_K; i++)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (b * BLOCK_K + i) * ldo + tile * TILE_N),
                            to_bfloat16(values[i]));
}

// Whether each of 16 float16 scales at `high` is 16x its own at `low`.
bool sixteen_times(const uint16_t* low, const uint16_t* high) {
    return _mm512_cmp_ps_mask(load_halves(high), _mm512_mul_ps(load_halves(low), _mm512_set1_ps(16.f)),
                              _CMP_EQ_OQ) == 0xFFFF;
}

}  // namespace
#elif defined(QRUN_HAS_AVX2_PRODUCT)
// AVX2: a tile's 16 channels as two halves of 8 lanes, and half the vector registers (16).
namespace {

// Rows a channel tile's block of weights is unpacked for: each row holds 2 halves of sums per digit of its inputs
// beside the block's codes, in 16 registers.
template <bool two_digits>
constexpr int64_t ROW_TILE = two_digits ? 2 : 3;

// 8 inputs from float32 or bfloat16 (its upper half).
template <typename In>
inline __m256 load8(const In* at) {
    if constexpr (sizeof(In) == 4) return _mm256_loadu_ps(at);
    const __m128i halves = _mm_loadu_si128(reinterpret_cast<const __m128i*>(at));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(halves), 16));
}

inline float sum8(__m256 x) {
    const __m128 quads = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 pairs = _mm_add_ps(quads, _mm_movehl_ps(quads, quads));
    return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
}

inline float max8(__m256 x) {
    const __m128 quads = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    const __m128 pairs = _mm_max_ps(quads, _mm_movehl_ps(quads, quads));
    return _mm_cvtss_f32(_mm_max_ss(pairs, _mm_movehdup_ps(pairs)));
}

// 8 rounded values in [-127, 127] as int8 digits at `at` (NaN: 0; its group's sum carries it to the output).
inline void store_digits(int8_t* at, __m256 rounded) {
    const __m256i words = _mm256_and_si256(_mm256_cvtps_epi32(rounded),
                                           _mm256_castps_si256(_mm256_cmp_ps(rounded, rounded, _CMP_ORD_Q)));
    const __m128i shorts = _mm_packs_epi32(_mm256_castsi256_si128(words), _mm256_extracti128_si256(words, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(at), _mm_packs_epi16(shorts, shorts));
}

// The AVX512 path's quantize_rows, 8 inputs at a time. At one row it runs on the calling thread alone while the
// team waits: as scalar loops it took ~2% of a 4.0-bpw SmolLM2's batch-1 step on a 2-core Zen 3 EPYC.
template <typename In>
const QuantizedRows& quantize_rows(const In* x, int64_t rows, int64_t ldx, int64_t k, int64_t group, bool two_digits,
                                   int threads) {
    const int64_t groups = k / group;
    QuantizedRows& q = calling_thread_rows(rows, k, groups, two_digits);
    const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    constexpr int ROUND = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
    qrun_parallel_for(rows, threads, rows * k >= (1 << 14), [&](int64_t m) {
        for (int64_t g = 0; g < groups; g++) {
            const In* inputs = x + m * ldx + g * group;
            __m256 top8 = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
            for (int64_t i = 0; i < group; i += 8) {
                const __m256 values = load8(inputs + i);
                top8 = _mm256_max_ps(top8, _mm256_and_ps(values, magnitude));
                sum = _mm256_add_ps(sum, values);
            }
            const float top = max8(top8), step = top / 127.f;
            const __m256 inverse = _mm256_set1_ps(top > 0.f ? 127.f / top : 0.f);
            __m256 rounded_sum = _mm256_setzero_ps();
            for (int64_t i = 0; i < group; i += 8) {
                const __m256 scaled = _mm256_mul_ps(load8(inputs + i), inverse);
                const __m256 rounded = _mm256_round_ps(scaled, ROUND);
                const int64_t at = m * k + g * group + i;
                store_digits(q.high.data() + at, rounded);
                rounded_sum = _mm256_add_ps(rounded_sum, rounded);
                if (two_digits) {
                    const __m256 low = _mm256_round_ps(
                        _mm256_mul_ps(_mm256_sub_ps(scaled, rounded), _mm256_set1_ps(LOW_STEPS)), ROUND);
                    store_digits(q.low.data() + at, low);
                    rounded_sum = _mm256_fmadd_ps(low, _mm256_set1_ps(1.f / LOW_STEPS), rounded_sum);
                }
            }
            q.steps[m * groups + g] = step;
            q.rounded_sums[m * groups + g] = sum8(rounded_sum) * step;
            q.group_sums[m * groups + g] = sum8(sum);
        }
    });
    return q;
}

// 8 float16 values as floats.
inline __m256 load_halves(const uint16_t* at) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
}

// 8 floats' bfloat16 bits (qrun_bfloat16_bits) in the low halves of their lanes.
inline __m256i bfloat16_lanes(__m256 values) {
    const __m256i bits = _mm256_castps_si256(values);
    const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    const __m256i rounded =
        _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
    return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0),
                              _mm256_castps_si256(_mm256_cmp_ps(values, values, _CMP_UNORD_Q)));
}

// The AVX512 path's Output: a tile's 16 sums once per row and product, as two halves.
struct Output {
    void* y;
    int64_t ldy;
    OutputKind kind;
    int64_t gate_tiles = 0;

    void store(int64_t row, int64_t tile, const __m256 (&halves)[2]) const {
        if (gate_tiles && tile >= gate_tiles) {
            float values[TILE_N];
            _mm256_storeu_ps(values, halves[0]);
            _mm256_storeu_ps(values + 8, halves[1]);
            return store_gated(row * ldy + (tile - gate_tiles) * TILE_N, values);
        }
        const int64_t at = row * ldy + tile * TILE_N;
        if (kind == BFLOAT16) {
            // packus interleaves the halves' 128-bit lanes; the permute puts them back in order
            const __m256i packed = _mm256_packus_epi32(bfloat16_lanes(halves[0]), bfloat16_lanes(halves[1]));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(static_cast<uint16_t*>(y) + at),
                                _mm256_permute4x64_epi64(packed, 0xD8));
            return;
        }
        for (int h = 0; h < 2; h++)
            _mm256_storeu_ps(static_cast<float*>(y) + at + 8 * h,
                             kind == BFLOAT16_WIDENED
                                 ? _mm256_castsi256_ps(_mm256_slli_epi32(bfloat16_lanes(halves[h]), 16))
                                 : halves[h]);
    }

  private:
    // the up tile's values at y[at]: silu of the gate stored there, times them
    void store_gated(int64_t at, const float* up) const {
        if (kind == BFLOAT16) {
            for (int i = 0; i < TILE_N; i++) {
                const float gate = qrun_round_value<QRUN_BF16>(qrun_silu(qrun_load_value<QRUN_BF16>(y, at + i)));
                qrun_store_value<QRUN_BF16>(y, at + i, gate * qrun_round_value<QRUN_BF16>(up[i]));
            }
            return;
        }
        float* gates = static_cast<float*>(y) + at;
        for (int h = 0; h < TILE_N; h += 8)
            _mm256_storeu_ps(gates + h, _mm256_mul_ps(qrun_silu8(_mm256_loadu_ps(gates + h)), _mm256_loadu_ps(up + h)));
    }
};

// The AVX512 path's tile_rows. vpdpbusd's product of four code bytes and four input bytes summed into a lane is
// vpmaddubsw's (pairs into int16) and vpmaddwd's (pairs of those into int32): a 4-bit code times an int8 digit is at
// most 15 x 127, so the int16 sums of a slice's two nibbles (4 products) stay below 2^15; an 8-bit code's would not,
// so the high plane's digits sum on their own, scaled by 16 in vpmaddwd.
template <int R, int T, bool two_digits>
[[gnu::flatten]] void tile_rows(const Weights& weights, const QuantizedRows& x, int64_t m0, const Output& out,
                                const int64_t* tiles) {
    const qrun_plane &low_plane = weights.low, &high_plane = weights.high;
    const int64_t k = low_plane.k, group = weights.group;
    const int64_t groups = k / group, blocks_per_group = group / BLOCK_K, high_groups = high_plane.k / group;
    const int64_t block_bytes = low_plane.block_bytes(), high_block_bytes = high_plane.block_bytes();
    __m256 total[T][R][2];
    __m256i high_dot[T][R][2], low_dot[T][R][2];  // each row's int32 sums over the group so far, by input digit
    const uint8_t* tile_codes[T];
    const uint8_t* tile_high_codes[T];
    for (int t = 0; t < T; t++) {
        tile_codes[t] = low_plane.block(tiles[t], 0);
        tile_high_codes[t] = high_plane.codes ? high_plane.block(tiles[t], 0) : nullptr;
        for (int r = 0; r < R; r++)
            for (int h = 0; h < 2; h++) {
                total[t][r][h] = _mm256_setzero_ps();
                high_dot[t][r][h] = low_dot[t][r][h] = _mm256_setzero_si256();
            }
    }
    const __m256i nibbles = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1), sixteens = _mm256_set1_epi16(16);
    // a slice's codes (low and high nibbles: 4 inputs each) times 8 input bytes, 4 for each nibble, in int32 lanes
    const auto dot = [&](const __m256i (&codes)[2], int32_t first, int32_t second, __m256i scale) {
        const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(codes[0], _mm256_set1_epi32(first)),
                                               _mm256_maddubs_epi16(codes[1], _mm256_set1_epi32(second)));
        return _mm256_madd_epi16(pairs, scale);
    };
    // slice s of a block's codes (in a plane of `bits` bits a code) as [half][low nibbles, high nibbles]
    const auto unpack = [&](const uint8_t* block, int bits, int s, __m256i (&w)[2][2]) {
        for (int h = 0; h < 2; h++) {
            const __m256i bytes = qrun_plane_slice<__m256i>(block + 32 * h, bits, s);
            w[h][0] = _mm256_and_si256(bytes, nibbles);
            w[h][1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), nibbles);
        }
    };
    // slice s of a block of upper digits (in a plane of `bits` bits a digit) joined to its low digits w as codes
    const auto join_upper = [&](const uint8_t* high_block, int bits, int s, __m256i (&w)[2][2]) {
        const __m256i upper_nibbles = _mm256_set1_epi8(int8_t(0xF0));
        for (int h = 0; h < 2; h++) {
            const __m256i bytes = qrun_plane_slice<__m256i>(high_block + 32 * h, bits, s);
            w[h][0] = _mm256_or_si256(w[h][0], _mm256_and_si256(_mm256_slli_epi16(bytes, 4), upper_nibbles));
            w[h][1] = _mm256_or_si256(w[h][1], _mm256_and_si256(bytes, upper_nibbles));
        }
    };
    // Slice s of tile t's block (w: its codes, w_upper: their upper digits, where split) times each row's digits of
    // the block's inputs (`high`, and `low` where two) into the sums.
    const auto add_slice = [&]<bool split_upper>(int t, int s, const int32_t* high, const int32_t* low,
                                                 const __m256i (&w)[2][2], const __m256i (&w_upper)[2][2]) {
        for (int r = 0; r < R; r++) {
            const int32_t* digits[2] = {high + r * k / 4 + 2 * s, two_digits ? low + r * k / 4 + 2 * s : nullptr};
            for (int h = 0; h < 2; h++)
                for (int d = 0; d < (two_digits ? 2 : 1); d++) {
                    __m256i& sums = d ? low_dot[t][r][h] : high_dot[t][r][h];
                    sums = _mm256_add_epi32(sums, dot(w[h], digits[d][0], digits[d][1], ones));
                    if constexpr (split_upper)
                        sums = _mm256_add_epi32(sums, dot(w_upper[h], digits[d][0], digits[d][1], sixteens));
                }
        }
    };
    // Block b of every tile into the sums, its codes BITS wide and their upper digits UPPER_BITS (0: the planes'
    // widths, read at run time). Up to 6-bit codes (upper digits of 1 or 2 bits) multiply whole, as the VNNI path's
    // do: 4 products of a code below 64 and a digit within +-127 stay below 2^15 in vpmaddubsw's and the nibbles'
    // int16 sums; wider codes multiply digit by digit.
    const auto multiply_block = [&]<bool upper, int BITS, int UPPER_BITS>(int64_t b) {
        const int low_bits = BITS ? BITS : low_plane.bits, upper_bits = UPPER_BITS ? UPPER_BITS : high_plane.bits;
        const bool whole_codes = upper_bits <= 2;
        const int64_t at = m0 * k + b * BLOCK_K;
        const int32_t* high = reinterpret_cast<const int32_t*>(x.high.data() + at);
        const int32_t* low = two_digits ? reinterpret_cast<const int32_t*>(x.low.data() + at) : nullptr;
        for (int t = 0; t < T; t++) {
            const uint8_t* block = tile_codes[t] + b * block_bytes;
            const uint8_t* high_block = upper ? tile_high_codes[t] + b * high_block_bytes : nullptr;
            prefetch_ahead(block, low_bits);  // a line a bit of the codes' width
            if constexpr (upper) prefetch_ahead(high_block, upper_bits);
            for (int s = 0; s < 4; s++) {
                __m256i w[2][2], w_upper[2][2];  // [half][nibble]
                unpack(block, low_bits, s, w);
                if constexpr (upper) {
                    if (whole_codes) {
                        join_upper(high_block, upper_bits, s, w);
                        add_slice.template operator()<false>(t, s, high, low, w, w);
                        continue;
                    }
                    unpack(high_block, upper_bits, s, w_upper);
                }
                add_slice.template operator()<upper>(t, s, high, low, w, w_upper);
            }
        }
    };
    // Groups [first, last): their blocks' sums, then each scaled into the totals.
    const auto scaled_groups = [&]<bool upper, int BITS, int UPPER_BITS>(int64_t first, int64_t last) {
        for (int64_t g = first; g < last; g++) {
            for (int64_t b = g * blocks_per_group; b < (g + 1) * blocks_per_group; b++)
                multiply_block.template operator()<upper, BITS, UPPER_BITS>(b);
            const int64_t b = (g + 1) * blocks_per_group - 1;
            const float center = upper ? low_plane.centers[b] + 16.f * high_plane.centers[b] : low_plane.centers[b];
            for (int t = 0; t < T; t++) {
                const int64_t at = (tiles[t] * groups + g) * TILE_N;
                prefetch_scales(low_plane.scales + at);
                prefetch_scales(low_plane.zeros + at);
                for (int h = 0; h < 2; h++) {
                    const __m256 scale = load_halves(low_plane.scales + at + 8 * h);
                    __m256 zero = load_halves(low_plane.zeros + at + 8 * h);
                    if constexpr (upper)
                        zero = _mm256_add_ps(zero, load_halves(high_plane.zeros +
                                                               (tiles[t] * high_groups + g) * TILE_N + 8 * h));
                    for (int r = 0; r < R; r++) {
                        __m256 sum = _mm256_cvtepi32_ps(high_dot[t][r][h]);
                        if constexpr (two_digits)
                            sum = _mm256_fmadd_ps(_mm256_cvtepi32_ps(low_dot[t][r][h]),
                                                  _mm256_set1_ps(1.f / LOW_STEPS), sum);
                        const __m256 centred =
                            _mm256_sub_ps(_mm256_mul_ps(sum, _mm256_set1_ps(x.steps[(m0 + r) * groups + g])),
                                          _mm256_set1_ps(center * x.rounded_sums[(m0 + r) * groups + g]));
                        total[t][r][h] = _mm256_fmadd_ps(centred, scale, total[t][r][h]);
                        total[t][r][h] = _mm256_fmadd_ps(zero, _mm256_set1_ps(x.group_sums[(m0 + r) * groups + g]),
                                                         total[t][r][h]);
                        high_dot[t][r][h] = low_dot[t][r][h] = _mm256_setzero_si256();
                    }
                }
            }
        }
    };
    // the common 6-bit codes (4-bit low digits, 2-bit upper ones) with constant widths, so their slices unroll
    const auto multiply_groups = [&]<bool upper, int BITS>(int64_t first, int64_t last) {
        if constexpr (upper)
            if (low_plane.bits == 4 && high_plane.bits == 2)
                return scaled_groups.template operator()<true, 4, 2>(first, last);
        scaled_groups.template operator()<upper, BITS, 0>(first, last);
    };
    multiply_planes(multiply_groups, low_plane.bits, high_groups, groups);
    for (int t = 0; t < T; t++)
        for (int r = 0; r < R; r++) out.store(m0 + r, tiles[t], total[t][r]);
}

// The AVX512 path's dequantize_tile_block, 8 channels of the tile at a time.
void store_dequantized_block(const qrun_plane& low, const qrun_plane* high, int64_t group, int64_t tile, int64_t b,
                             uint16_t* out, int64_t ldo) {
    for (int h = 0; h < 2; h++) {
        __m256 values[BLOCK_K];
        for (int i = 0; i < BLOCK_K; i++) values[i] = _mm256_setzero_ps();
        for (const qrun_plane* plane : {&low, high}) {
            if (!plane) continue;
            const int64_t at = (tile * (plane->k / group) + b * BLOCK_K / group) * TILE_N + 8 * h;
            const __m256 scale = load_halves(plane->scales + at), zero = load_halves(plane->zeros + at);
            const __m256 center = _mm256_set1_ps(float(plane->centers[b]));
            const uint8_t* block = plane->block(tile, b) + 32 * h;
            for (int slice = 0; slice < 4; slice++) {
                const __m256i words = qrun_plane_slice<__m256i>(block, plane->bits, slice);
                for (int j = 0; j < 4; j++)
                    for (int half = 0; half < 2; half++) {
                        const __m256i codes =
                            _mm256_and_si256(_mm256_srli_epi32(words, 8 * j + 4 * half), _mm256_set1_epi32(15));
                        const __m256 product = _mm256_mul_ps(_mm256_sub_ps(_mm256_cvtepi32_ps(codes), center), scale);
                        __m256& value = values[8 * slice + 4 * half + j];
                        value = plane == &low ? _mm256_add_ps(product, zero)
                                              : _mm256_add_ps(value, _mm256_add_ps(product, zero));
                    }
            }
        }
        for (int i = 0; i < BLOCK_K; i++) {
            float sums[8];
            _mm256_storeu_ps(sums, values[i]);
            for (int c = 0; c < 8; c++)
                out[(b * BLOCK_K + i) * ldo + tile * TILE_N + 8 * h + c] = qrun_bfloat16_bits(sums[c]);
        }
    }
}

// Whether each of 16 float16 scales at `high` is 16x its own at `low`.
bool sixteen_times(const uint16_t* low, const uint16_t* high) {
    for (int h = 0; h < 2; h++)
        if (_mm256_movemask_ps(_mm256_cmp_ps(load_halves(high + 8 * h),
                                             _mm256_mul_ps(load_halves(low + 8 * h), _mm256_set1_ps(16.f)),
                                             _CMP_EQ_OQ)) != 0xFF)
            return false;
    return true;
}

}  // namespace
#endif

#ifdef QRUN_HAS_PRODUCT
namespace {

// The last rows of a tile (fewer than its row tile): tile_rows<left>.
template <int R, bool two_digits>
void remaining_rows(int64_t left, const Weights& weights, const QuantizedRows& x, int64_t m0, const Output& out,
                    int64_t tile) {
    if constexpr (R > 0) {
        if (left == R) return tile_rows<R, 1, two_digits>(weights, x, m0, out, &tile);
        remaining_rows<R - 1, two_digits>(left, weights, x, m0, out, tile);
    }
}

// At one or two rows the product is bound by reading the weights, and how many sequential streams a core reads
// fastest differs by CPU: on a 2-core Xeon four tiles side by side read more than one (the 6-bit head of a 4.0-bpw
// SmolLM2 1.64 -> 1.02 ms), on a 2-core EPYC (Zen 4) fewer did (single-stream decode 154 / 172 / 177 tok/s at 4 / 2
// / 1 streams). So the count is a parameter (kernels/read_streams.py measures it on the model at load).

// f(std::integral_constant<int, STREAMS>) for a product's read streams at one or two rows (1, 2 or 4).
template <typename F>
void with_read_streams(int streams, const F& f) {
    if (streams == 1) return f(std::integral_constant<int, 1>{});
    if (streams == 2) return f(std::integral_constant<int, 2>{});
    f(std::integral_constant<int, 4>{});
}

// The units in STREAMS runs read side by side: item j of the first units / runs is unit j of each run, the rest are one
// unit each; the threads claim items (qrun_parallel_claims). A unit is a channel tile, or where the product is gated
// (Output) a gate tile and its up tile, side by side and stored in that order: STREAMS / 2 runs of them (one at one
// stream).
template <int STREAMS, bool gated>
struct FewRowsItems {
    static constexpr int TILES = gated ? 2 : 1, RUNS = std::max(1, STREAMS / TILES);
    int64_t units, run;

    explicit FewRowsItems(int64_t n) : units(n / TILE_N / TILES), run(units / RUNS) {}

    int64_t count() const { return run + units % RUNS; }

    // Item `item`'s tiles as tile_rows takes them (its gate tiles, then their up tiles); how many.
    int tiles(int64_t item, int64_t* tiles) const {
        const int runs = item >= run ? 1 : RUNS;
        for (int r = 0; r < runs; r++) {
            const int64_t unit = item >= run ? RUNS * run + item - run : r * run + item;
            tiles[r] = unit;
            if constexpr (gated) tiles[runs + r] = units + unit;
        }
        return TILES * runs;
    }
};

// The product at R (one or two) rows, its items (FewRowsItems) claimed by the threads.
template <int R, bool two_digits, int STREAMS, bool gated>
void few_rows(const QuantizedRows& x, const Weights& weights, const Output& out, int threads) {
    using Items = FewRowsItems<STREAMS, gated>;
    const Items items(weights.n);
    // by value: what each thread reads again and again (QrunTeam::run says why)
    qrun_parallel_claims(items.count(), threads, [&x, weights, out, items](int64_t first, int64_t last) {
        for (int64_t item = first; item < last; item++) {
            int64_t tiles[Items::TILES * Items::RUNS];
            if (items.tiles(item, tiles) == Items::TILES)
                tile_rows<R, Items::TILES, two_digits>(weights, x, 0, out, tiles);
            else
                tile_rows<R, Items::TILES * Items::RUNS, two_digits>(weights, x, 0, out, tiles);
        }
    });
}

// The most bytes of codes a thread warms ahead of a product (QrunTeam::warm): three quarters of a Zen 3 core's L2
// cache (QrunTeam::warm's probes: 192 KiB 1.010x and 1.016x, this 1.032x and 1.048x).
constexpr int64_t WARM_BYTES = 384 << 10;

// The lines of `bytes` at `begin` fetched into L2 while waiting() holds, checked every WARM_CHECK bytes: a fetch that
// finds the core's queue of misses full waits for a slot, so a long run of them would hold up the job they prepare.
constexpr int64_t WARM_CHECK = 1024;

inline bool warm_lines(const void* begin, int64_t bytes, const QrunTeam::Waiting& waiting) {
    for (int64_t at = 0; at < bytes; at += 64) {
        if (at % WARM_CHECK == 0 && !waiting()) return false;
        _mm_prefetch(static_cast<const char*>(begin) + at, _MM_HINT_T1);
    }
    return true;
}

// The tiles few_rows' thread `part` claims first (its own run, from the front) fetched into its core's L2 cache:
// their codes, scales and zeros in both planes, until waiting() is false or WARM_BYTES of codes are fetched.
template <int STREAMS, bool gated>
void warm_few_rows(const Weights& weights, int part, int parts, const QrunTeam::Waiting& waiting) {
    using Items = FewRowsItems<STREAMS, gated>;
    const Items items(weights.n);
    int64_t warmed = 0;
    for (int64_t item = items.count() * part / parts; item < items.count() * (part + 1) / parts; item++) {
        int64_t tiles[Items::TILES * Items::RUNS];
        const int count = items.tiles(item, tiles);
        for (int t = 0; t < count; t++)
            for (const qrun_plane* plane : {&weights.low, &weights.high}) {
                if (!plane->codes) continue;
                const int64_t groups = plane->k / weights.group, bytes = plane->k / BLOCK_K * plane->block_bytes();
                const int64_t scale_bytes = groups * TILE_N * sizeof(uint16_t);
                if (!warm_lines(plane->block(tiles[t], 0), bytes, waiting) ||
                    !warm_lines(plane->scales + tiles[t] * groups * TILE_N, scale_bytes, waiting) ||
                    !warm_lines(plane->zeros + tiles[t] * groups * TILE_N, scale_bytes, waiting))
                    return;
                warmed += bytes;
            }
        if (warmed >= WARM_BYTES) return;
    }
}

// few_rows' first tiles warmed by the held team's other threads while they wait for it (none held: nothing).
template <bool gated>
void warm_few_rows(const Weights& weights, int streams) {
    QrunTeam* team = QrunTeam::held();
    if (!team) return;
    const auto warm = [weights, streams](int part, int parts, const QrunTeam::Waiting& waiting) {
        with_read_streams(streams, [&](auto count) {
            warm_few_rows<decltype(count)::value, gated>(weights, part, parts, waiting);
        });
    };
    team->warm(warm);
}

template <int R, bool two_digits, bool gated>
void few_rows(const QuantizedRows& x, const Weights& weights, const Output& out, int streams, int threads) {
    with_read_streams(streams, [&](auto count) {
        few_rows<R, two_digits, decltype(count)::value, gated>(x, weights, out, threads);
    });
}

template <int R, bool two_digits>
void few_rows(const QuantizedRows& x, const Weights& weights, const Output& out, int streams, int threads) {
    if (out.gate_tiles) return few_rows<R, two_digits, true>(x, weights, out, streams, threads);
    few_rows<R, two_digits, false>(x, weights, out, streams, threads);
}

template <bool two_digits>
void quant_matmul(const QuantizedRows& x, int64_t rows, const Weights& weights, const Output& out, int streams,
                  int threads) {
    if (rows == 1) return few_rows<1, two_digits>(x, weights, out, streams, threads);
    if (rows == 2) return few_rows<2, two_digits>(x, weights, out, streams, threads);
    constexpr int64_t R = ROW_TILE<two_digits>;
    const int64_t block_rows = std::max<int64_t>(1, ROW_BLOCK_BYTES / weights.low.k / R) * R;
    const int64_t tiles = weights.n / TILE_N, gate_tiles = out.gate_tiles;
    // a unit's tiles in order: gated, a gate tile and then its up tile (Output)
    const int64_t units = gate_tiles ? gate_tiles : tiles;
    for (int64_t first = 0; first < rows; first += block_rows) {
        const int64_t last = std::min(rows, first + block_rows);
        // the threads claim units as at one row (few_rows), block by block
        const auto block = [&x, weights, out, first, last, tiles, gate_tiles](int64_t from, int64_t to) {
            for (int64_t unit = from; unit < to; unit++)
                for (int64_t tile = unit; tile < tiles; tile += gate_tiles ? gate_tiles : tiles) {
                    int64_t m0 = first;
                    for (; m0 + R <= last; m0 += R) tile_rows<R, 1, two_digits>(weights, x, m0, out, &tile);
                    remaining_rows<R - 1, two_digits>(last - m0, weights, x, m0, out, tile);
                }
        };
        qrun_parallel_claims(units, threads, block);
    }
}

}  // namespace
#endif

// out [k, n] bfloat16 (row stride ldo) = the transpose of the weight the planes hold: the low digits' plane over all k
// inputs, plus the high digits' over the first high->k (high null: none), summed in float32 and rounded once.
// Input-major, so each channel tile's 16 values of an input are one store (oneDNN multiplies either layout alike).
// 0: done; 1: shapes the layout does not cover; 2: no kernel in this build.
extern "C" int qrun_dequantize_planes(const qrun_plane* low, const qrun_plane* high, int64_t n, int64_t group,
                                      uint16_t* out, int64_t ldo, int threads) {
#ifdef QRUN_HAS_PRODUCT
    if (!qrun_planes_fit(*low, high, n, group)) return 1;
    // a block of inputs' rows at a time, whole: each thread writes rows of its own
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t b = 0; b < low->k / BLOCK_K; b++)
        for (int64_t tile = 0; tile < n / TILE_N; tile++)
            store_dequantized_block(*low, high && b * BLOCK_K < high->k ? high : nullptr, group, tile, b, out, ldo);
    return 0;
#else
    return 2;
#endif
}

// 1 where this build has the kernel (the CPU and compiler support AVX512-VNNI, or AVX2 with FMA and F16C).
extern "C" int qrun_quant_matmul_available() {
#ifdef QRUN_HAS_PRODUCT
    return 1;
#else
    return 0;
#endif
}

// 1 where the high plane's scales [N / 16][k_high / group][16] are 16x the low plane's [N / 16][K / group][16] over
// its inputs, as the upper digits of 5-8-bit codes have them (qrun/quant.py's cpu_parts), so that qrun_quant_matmul
// may multiply both digits as one 8-bit code; else 0 (2: no kernel in this build).
extern "C" int qrun_quant_matmul_upper_digits(const uint16_t* scales, const uint16_t* high_scales, int64_t n,
                                              int64_t k, int64_t k_high, int64_t group) {
#ifdef QRUN_HAS_PRODUCT
    const int64_t groups = k / group, high_groups = k_high / group;
    for (int64_t tile = 0; tile < n / TILE_N; tile++)
        for (int64_t g = 0; g < high_groups; g++)
            if (!sixteen_times(scales + (tile * groups + g) * TILE_N, high_scales + (tile * high_groups + g) * TILE_N))
                return 0;
    return 1;
#else
    return 2;
#endif
}

// The weights qrun_quant_matmul reads first on each of the held team's other threads, for `rows` rows (one or two;
// else nothing) and its other arguments, fetched into their caches while they wait for it (QrunTeam::warm). Nothing
// where no team is held or the planes do not fit.
extern "C" void qrun_quant_matmul_warm(const qrun_plane* low, const qrun_plane* high, int gated, int64_t rows,
                                       int64_t n, int64_t group, int read_streams) {
#ifdef QRUN_HAS_PRODUCT
    if (rows < 1 || rows > 2 || !qrun_planes_fit(*low, high, n, group) || (gated && n % (2 * TILE_N))) return;
    const Weights weights{*low, high ? *high : qrun_plane{.k = 0}, n, group};
    gated ? warm_few_rows<true>(weights, read_streams) : warm_few_rows<false>(weights, read_streams);
#endif
}

// y [M, N] (row stride ldy; y_kind 0: float32, 1: bfloat16, 2: float32 holding each value's bfloat16 rounding) =
// x[:, :K] W^T (x float32, or bfloat16 when x_bfloat16; row stride ldx; K = low->k), with x rounded to
// `input_digits` (1 or 2) int8 digits per element; or where `gated` (N a multiple of 32, y_kind 0 or 1), y [M, N / 2]
// = silu of the product's first N / 2 columns times its last, rounded as kernels/cpu_activation.cpp rounds them. W:
// the low plane over all K inputs plus, over the first high->k, the high plane's upper digits of 5-8-bit codes (high
// null: none; its scales, 16x the low plane's, are not read: checked where the planes are made, by
// qrun_quant_matmul_upper_digits). At one or two rows each thread reads `read_streams` (1, 2 or 4) runs of tiles side
// by side (the same result whatever the count). 0: done; 1: shapes the layout does not cover (or another stream
// count); 2: no kernel in this build.
extern "C" int qrun_quant_matmul(const void* x, int x_bfloat16, int64_t ldx, const qrun_plane* low,
                                 const qrun_plane* high, void* y, int y_kind, int gated, int64_t ldy, int64_t rows,
                                 int64_t n, int64_t group, int input_digits, int read_streams, int threads) {
#ifdef QRUN_HAS_PRODUCT
    if (!qrun_planes_fit(*low, high, n, group) || input_digits < 1 || input_digits > 2 || y_kind < FLOAT32 ||
        y_kind > BFLOAT16_WIDENED || (gated && (n % (2 * TILE_N) || y_kind == BFLOAT16_WIDENED)) ||
        (read_streams != 1 && read_streams != 2 && read_streams != 4))
        return 1;
    const int64_t k = low->k;
    const QuantizedRows& quantized =
        x_bfloat16 ? quantize_rows(static_cast<const uint16_t*>(x), rows, ldx, k, group, input_digits == 2, threads)
                   : quantize_rows(static_cast<const float*>(x), rows, ldx, k, group, input_digits == 2, threads);
    const Weights weights{*low, high ? *high : qrun_plane{.k = 0}, n, group};
    const Output out{y, ldy, OutputKind(y_kind), gated ? n / TILE_N / 2 : 0};
    if (input_digits == 2)
        quant_matmul<true>(quantized, rows, weights, out, read_streams, threads);
    else
        quant_matmul<false>(quantized, rows, weights, out, read_streams, threads);
    return 0;
#else
    return 2;
#endif
}
