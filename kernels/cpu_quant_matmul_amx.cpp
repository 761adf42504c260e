// y = x W^T for bfloat16 rows x and cpu_quant_matmul.cpp's 4-bit planes, on AMX tiles (tdpbf16ps), for CPUs with
// AMX-BF16. The x rows enter the tiles as they are (no int8 rounding); the weights enter as their codes, exactly:
// bfloat16 0x43cc is 128 + cc, so a code's tile value is two byte shuffles away from the packed nibbles. Each group
// of `group` inputs is summed in float32 on the tiles and scaled afterwards:
//
//     sum_k x w = scale * sum_k x (128 + code) + (zero - (128 + center) * scale) * sum_k x
//
// (w = (code - center) * scale + zero, one scale and zero per channel and group): "codes mode". Its scaling costs per
// row and group, so with more rows the kernel instead dequantizes each pair of channel tiles' weights once, to
// bfloat16 (rounded as oneDNN's path rounds its dequantized weight), and sums every input on the tiles without
// scaling: "weights mode". Why and when: cpu_quant_matmul.py.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#include <omp.h>
#define QRUN_HAS_AMX 1
#endif

#ifdef QRUN_HAS_AMX
namespace {

constexpr int64_t TILE_N = 16, BLOCK_K = 32, TILE_ROWS = 16;
constexpr int64_t BLOCK_BYTES = BLOCK_K * TILE_N * 2;  // one block of a channel tile as bfloat16 pairs (a B tile)

// Tiles: 0-3 sums (row tile r, channel tile t: 2r + t), 4-5 rows of x, 6-7 weights. rows1 = 0: one row tile.
void configure(int rows0, int rows1) {
    QrunTileConfig config;
    for (int t = 0; t < 8; t++) config.bytes_per_row[t] = 64;
    config.rows[0] = config.rows[1] = config.rows[4] = rows0;
    config.rows[2] = config.rows[3] = config.rows[5] = rows1 ? rows1 : 1;
    config.rows[6] = config.rows[7] = BLOCK_K / 2;
    _tile_loadconfig(&config);
}

// Blocks [first, first + count) of channel tile `tile` as tdpbf16ps's B operand: per block 16 rows of 64 bytes,
// row p holding (128 + code) of inputs 32b + 2p and 32b + 2p + 1 for each of the 16 channels. Slice s of a block
// (qrun_plane_slice) gives rows 4s .. 4s + 3: its channel c holds in byte j inputs 8s + j (low nibble) and 8s + 4 + j
// (high).
void unpack_blocks(const qrun_plane& plane, int64_t tile, int64_t first, int64_t count, uint8_t* out) {
    // per 128-bit lane (4 channels): bytes 0, 1 of each channel, then bytes 2, 3
    const __m512i pairs = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m512i nibble = _mm512_set1_epi8(15), exponent = _mm512_set1_epi8(0x43);
    for (int64_t slice = 0; slice < count * 4; slice++) {
        const __m512i codes = qrun_plane_slice<__m512i>(plane.block(tile, first + slice / 4), plane.bits, slice % 4);
        const __m512i bytes = _mm512_shuffle_epi8(codes, pairs);
        const __m512i low = _mm512_and_si512(bytes, nibble);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
        uint8_t* rows = out + slice * 4 * 64;
        _mm512_store_si512(rows, _mm512_unpacklo_epi8(low, exponent));
        _mm512_store_si512(rows + 64, _mm512_unpackhi_epi8(low, exponent));
        _mm512_store_si512(rows + 128, _mm512_unpacklo_epi8(high, exponent));
        _mm512_store_si512(rows + 192, _mm512_unpackhi_epi8(high, exponent));
    }
}

struct Problem {
    const uint16_t* x;
    int64_t ldx, rows, k, group;
    const uint16_t* tail;  // where rows > 32: x's last rows % 32 rows, zero rows after them up to 32, row stride k
    const float* group_sums;  // [rows, k / group]: x's rows summed per group
    void* y;  // float32, or bfloat16 where y_bfloat16 (weights mode only)
    int64_t ldy;
    bool y_bfloat16;

    float* floats() const { return static_cast<float*>(y); }
};

// Tiles 0-3 += rows m0 .. m0 + 32 of x's inputs in blocks [first, first + blocks) times `blocks` B operands from w0
// (channel tile t0's) and w1 (t0 + 1's); after(b) once block b's products are issued (the tile unit works on them
// meanwhile). The weights load with the streaming hint (tileloaddt1), which leaves L1 to the x rows they meet (one-off
// probes on a 2-core Xeon, variants alternating in one process): the 4.0-bpw SmolLM2's 120 layer linears 1.13x at 16
// rows, 1.08x at 32, 1.06x at 64, 1.15x at 128, 1.18x at 512 (x streamed instead: 1.02-1.17x; both: 1.02-1.12x); the
// prefill of 64 prompts through the engine 1.03x.
template <bool two_tiles, bool two_row_tiles, typename After>
void multiply_blocks(const Problem& p, const uint8_t* w0, const uint8_t* w1, int64_t first, int64_t blocks,
                     int64_t m0, const After& after) {
    const bool padded = p.rows > 2 * TILE_ROWS && m0 + 2 * TILE_ROWS > p.rows;
    const uint16_t* x = (padded ? p.tail : p.x + m0 * p.ldx) + first * BLOCK_K;
    const int64_t stride = (padded ? p.k : p.ldx) * 2;
    for (int64_t b = 0; b < blocks; b++) {
        _tile_stream_loadd(6, w0 + b * BLOCK_BYTES, 64);
        if constexpr (two_tiles) _tile_stream_loadd(7, w1 + b * BLOCK_BYTES, 64);
        _tile_loadd(4, x + b * BLOCK_K, stride);
        _tile_dpbf16ps(0, 4, 6);
        if constexpr (two_tiles) _tile_dpbf16ps(1, 4, 7);
        if constexpr (two_row_tiles) {
            _tile_loadd(5, x + TILE_ROWS * stride / 2 + b * BLOCK_K, stride);
            _tile_dpbf16ps(2, 5, 6);
            if constexpr (two_tiles) _tile_dpbf16ps(3, 5, 7);
        }
        after(b);
    }
}

template <bool two_tiles, bool two_row_tiles>
void zero_sums() {
    _tile_zero(0);
    if constexpr (two_tiles) _tile_zero(1);
    if constexpr (two_row_tiles) _tile_zero(2);
    if constexpr (two_tiles && two_row_tiles) _tile_zero(3);
}

// sums: [32 rows][32 channels] float32
template <bool two_tiles, bool two_row_tiles>
void store_sums(float* sums) {
    _tile_stored(0, sums, 128);
    if constexpr (two_tiles) _tile_stored(1, sums + 16, 128);
    if constexpr (two_row_tiles) _tile_stored(2, sums + 16 * 32, 128);
    if constexpr (two_tiles && two_row_tiles) _tile_stored(3, sums + 16 * 32 + 16, 128);
}

// y[m0 .. m0 + rows, channel tiles t0, t0 + 1 (if two)] += group g of the plane (unpacked: its blocks, channel tile
// t0's, then t0 + 1's): the group's sums on the tiles, then scaled into y.
template <bool two_tiles, bool two_row_tiles>
void multiply_group(const Problem& p, const qrun_plane& plane, const uint8_t* unpacked, int64_t g, int64_t t0,
                    int64_t m0, int rows, float* sums) {
    const int64_t blocks = p.group / BLOCK_K, first = g * blocks;
    zero_sums<two_tiles, two_row_tiles>();
    multiply_blocks<two_tiles, two_row_tiles>(p, unpacked, unpacked + blocks * BLOCK_BYTES, first, blocks, m0,
                                              [](int64_t) {});
    store_sums<two_tiles, two_row_tiles>(sums);
    const int64_t groups = p.k / p.group;
    for (int t = 0; t < (two_tiles ? 2 : 1); t++) {
        const int64_t at = ((t0 + t) * (plane.k / p.group) + g) * TILE_N;
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane.scales + at)));
        const __m512 zero = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane.zeros + at)));
        const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(128.f + plane.centers[first]), scale, zero);
        for (int r = 0; r < rows; r++) {
            float* out = p.floats() + (m0 + r) * p.ldy + (t0 + t) * TILE_N;
            const __m512 sum = _mm512_load_ps(sums + r * 2 * TILE_N + t * TILE_N);
            __m512 total = _mm512_fmadd_ps(scale, sum, _mm512_loadu_ps(out));
            total = _mm512_fmadd_ps(offset, _mm512_set1_ps(p.group_sums[(m0 + r) * groups + g]), total);
            _mm512_storeu_ps(out, total);
        }
    }
}

template <bool two_tiles>
void multiply_plane(const Problem& p, const qrun_plane& plane, int64_t t0, uint8_t* unpacked, float* sums) {
    const int64_t blocks = p.group / BLOCK_K;
    for (int64_t g = 0; g < plane.k / p.group; g++) {
        unpack_blocks(plane, t0, g * blocks, blocks, unpacked);
        if constexpr (two_tiles) unpack_blocks(plane, t0 + 1, g * blocks, blocks, unpacked + blocks * BLOCK_BYTES);
        for (int64_t m0 = 0; m0 < p.rows; m0 += 2 * TILE_ROWS) {
            const int rows = int(std::min<int64_t>(2 * TILE_ROWS, p.rows - m0));
            if (p.rows > TILE_ROWS)
                multiply_group<two_tiles, true>(p, plane, unpacked, g, t0, m0, rows, sums);
            else
                multiply_group<two_tiles, false>(p, plane, unpacked, g, t0, m0, rows, sums);
        }
    }
}

// A plane's group as weights mode's lanes want it: (128 + center), and per lane of a B row's two halves (the first
// 16 values: channels 0-7, two inputs each; the last 16: channels 8-15) its channel's scale and zero.
struct GroupTerms {
    __m512 center, scale_first, zero_first, scale_second, zero_second;

    GroupTerms(const qrun_plane& plane, int64_t group, int64_t tile, int64_t g) {
        const int64_t at = (tile * (plane.k / group) + g) * TILE_N;
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane.scales + at)));
        const __m512 zero = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane.zeros + at)));
        const __m512i first_half = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
        const __m512i second_half = _mm512_add_epi32(first_half, _mm512_set1_epi32(8));
        center = _mm512_set1_ps(128.f + plane.centers[g * group / BLOCK_K]);
        scale_first = _mm512_permutexvar_ps(first_half, scale);
        zero_first = _mm512_permutexvar_ps(first_half, zero);
        scale_second = _mm512_permutexvar_ps(second_half, scale);
        zero_second = _mm512_permutexvar_ps(second_half, zero);
    }
};

// vpermb's order of a packed slice's bytes for weights mode: per 128-bit lane L, unpacking its low (high) 8 bytes'
// nibbles beside the exponent byte 0x43 gives 32-bit lanes 4L .. 4L + 3 of a B row, each holding in its low word
// the code of channel 8 + lane / 2 and in its high word that of channel lane / 2 (input parity lane % 2). So the
// row's two halves are one shift and one mask away as floats, and their bfloat16 pair is the row, in order.
constexpr auto slice_order() {
    struct Order {
        uint8_t bytes[64];
    } order{};
    for (int lane = 0; lane < 4; lane++)
        for (int m = 0; m < 4; m++)
            for (int pair = 0; pair < 2; pair++) {  // bytes 0, 1 of each channel (unpacklo), then bytes 2, 3
                const int channel = 2 * lane + m / 2, byte = 2 * pair + m % 2;
                order.bytes[16 * lane + 8 * pair + 2 * m] = uint8_t(4 * (channel + 8) + byte);
                order.bytes[16 * lane + 8 * pair + 2 * m + 1] = uint8_t(4 * channel + byte);
            }
    return order;
}

// A slice's four B rows as floats, the two halves of each: (128 + code) - (128 + center), times the scale, plus the
// zero, each rounded as dequantize_planes rounds (no fused multiply-add: the exact float weights of the reference).
struct SliceValues {
    __m512 first[4], second[4];  // a row's values of channels 0-7, of channels 8-15

    SliceValues(__m512i slice, const GroupTerms& terms) {
        static constexpr auto order = slice_order();
        const __m512i nibble = _mm512_set1_epi8(15), exponent = _mm512_set1_epi8(0x43);
        const __m512i high_word = _mm512_set1_epi32(int(0xFFFF0000));
        const __m512i bytes = _mm512_permutexvar_epi8(_mm512_loadu_si512(order.bytes), slice);
        const __m512i low_nibbles = _mm512_and_si512(bytes, nibble);
        const __m512i high_nibbles = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
        const __m512i rows[4] = {_mm512_unpacklo_epi8(low_nibbles, exponent),
                                 _mm512_unpackhi_epi8(low_nibbles, exponent),
                                 _mm512_unpacklo_epi8(high_nibbles, exponent),
                                 _mm512_unpackhi_epi8(high_nibbles, exponent)};
        for (int r = 0; r < 4; r++) {
            const __m512 codes_first = _mm512_castsi512_ps(_mm512_and_si512(rows[r], high_word));
            const __m512 codes_second = _mm512_castsi512_ps(_mm512_slli_epi32(rows[r], 16));
            first[r] = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(codes_first, terms.center), terms.scale_first),
                                     terms.zero_first);
            second[r] = _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(codes_second, terms.center), terms.scale_second),
                                      terms.zero_second);
        }
    }
};

// How far ahead of its dequantization weights mode fetches a plane's codes: the hardware's prefetchers stop at 4 KiB
// pages, and the codes stream from memory (SmolLM2's 120 layer linears at 32 rows: 11.7 -> 9.6 ms).
constexpr int64_t PREFETCH_BYTES = 4096;

// Weights mode: block b of channel tile `tile` of the planes, dequantized, as tdpbf16ps's B operand (the layout of
// unpack_blocks, each value the bfloat16 of the low plane's (code - center) * scale + zero plus, over the high plane's
// inputs, the high plane's: summed in float32 and rounded once, as dequantize_planes rounds).
void dequantize_block(const qrun_plane& low, const qrun_plane* high, int64_t group, int64_t tile, int64_t b,
                      uint8_t* out) {
    const int64_t g = b * BLOCK_K / group;
    const bool two_planes = high && g * group < high->k;
    const GroupTerms low_terms(low, group, tile, g);
    const GroupTerms high_terms = two_planes ? GroupTerms(*high, group, tile, g) : low_terms;
    const uint8_t* block = low.block(tile, b);
    const uint8_t* high_block = two_planes ? high->block(tile, b) : nullptr;
    for (int line = 0; line < low.bits; line++)
        _mm_prefetch(reinterpret_cast<const char*>(block + 64 * line + PREFETCH_BYTES), _MM_HINT_T0);
    for (int line = 0; two_planes && line < high->bits; line++)
        _mm_prefetch(reinterpret_cast<const char*>(high_block + 64 * line + PREFETCH_BYTES), _MM_HINT_T0);
    for (int slice = 0; slice < 4; slice++) {
        SliceValues values(qrun_plane_slice<__m512i>(block, low.bits, slice), low_terms);
        if (two_planes) {
            const SliceValues upper(qrun_plane_slice<__m512i>(high_block, high->bits, slice), high_terms);
            for (int r = 0; r < 4; r++) {
                values.first[r] = _mm512_add_ps(values.first[r], upper.first[r]);
                values.second[r] = _mm512_add_ps(values.second[r], upper.second[r]);
            }
        }
        for (int r = 0; r < 4; r++)
            _mm512_store_si512(out + (slice * 4 + r) * 64,
                               __m512i(_mm512_cvtne2ps_pbh(values.second[r], values.first[r])));
    }
}

// Weights mode for channel tiles t0 (and t0 + 1), dequantized in `weights` (tile_bytes apart): every row; ahead(b)
// after the first row tiles' products of block b.
template <bool two_tiles, bool two_row_tiles, typename Ahead>
void multiply_dequantized(const Problem& p, int64_t t0, const uint8_t* weights, int64_t tile_bytes, float* sums,
                          const Ahead& ahead) {
    for (int64_t m0 = 0; m0 < p.rows; m0 += 2 * TILE_ROWS) {
        zero_sums<two_tiles, two_row_tiles>();
        multiply_blocks<two_tiles, two_row_tiles>(p, weights, weights + (two_tiles ? tile_bytes : 0), 0,
                                                  p.k / BLOCK_K, m0, [&](int64_t b) {
                                                      if (m0 == 0) ahead(b);
                                                  });
        store_sums<two_tiles, two_row_tiles>(sums);
        const int64_t rows = std::min<int64_t>(2 * TILE_ROWS, p.rows - m0);
        for (int64_t r = 0; r < rows; r++) {
            const int64_t at = (m0 + r) * p.ldy + t0 * TILE_N;
            if (!p.y_bfloat16) {
                std::copy_n(sums + r * 2 * TILE_N, (two_tiles ? 2 : 1) * TILE_N, p.floats() + at);
                continue;
            }
            for (int t = 0; t < (two_tiles ? 2 : 1); t++)  // rounded once, as the float32 path's conversion rounds
                qrun_store16<QRUN_BF16>(p.y, at + t * TILE_N, _mm512_load_ps(sums + r * 2 * TILE_N + t * TILE_N));
        }
    }
}

// Weights mode for the pairs of channel tiles [first, last) (one thread's share): each pair's weights are dequantized
// into one of two buffers (`buffers`, each two tiles' worth) block by block between the products of the pair before,
// so the vector units dequantize while the tile unit multiplies (on a 2-core Xeon, ms before -> after: the 4.0-bpw
// SmolLM2's 6-bit head at 32 rows 3.37 -> 2.83, at 64 4.21 -> 3.73; its 120 layer linears at 64 rows 13.4 -> 12.9).
void multiply_dequantized_pairs(const Problem& p, const qrun_plane& low, const qrun_plane* high, int64_t tiles,
                                int64_t first, int64_t last, uint8_t* buffers, float* sums) {
    const int64_t blocks = p.k / BLOCK_K, tile_bytes = blocks * BLOCK_BYTES;
    const auto buffer = [&](int64_t pair) { return buffers + (pair - first) % 2 * 2 * tile_bytes; };
    const auto dequantize = [&](int64_t pair, int64_t b) {
        for (int64_t t = 2 * pair; t < std::min(2 * pair + 2, tiles); t++)
            dequantize_block(low, high, p.group, t, b, buffer(pair) + (t - 2 * pair) * tile_bytes + b * BLOCK_BYTES);
    };
    for (int64_t b = 0; b < blocks && first < last; b++) dequantize(first, b);
    for (int64_t pair = first; pair < last; pair++) {
        const auto ahead = [&](int64_t b) {
            if (pair + 1 < last) dequantize(pair + 1, b);
        };
        const bool two_tiles = 2 * pair + 1 < tiles, two_row_tiles = p.rows > TILE_ROWS;
        const int64_t t0 = 2 * pair;
        if (two_tiles && two_row_tiles) multiply_dequantized<true, true>(p, t0, buffer(pair), tile_bytes, sums, ahead);
        else if (two_tiles) multiply_dequantized<true, false>(p, t0, buffer(pair), tile_bytes, sums, ahead);
        else if (two_row_tiles) multiply_dequantized<false, true>(p, t0, buffer(pair), tile_bytes, sums, ahead);
        else multiply_dequantized<false, false>(p, t0, buffer(pair), tile_bytes, sums, ahead);
    }
}

}  // namespace
#endif

// 1 where this build has the kernel and the OS lets this process use the tiles.
extern "C" int qrun_quant_matmul_tiles_available() {
#ifdef QRUN_HAS_AMX
    return qrun_tiles_permitted() ? 1 : 0;
#else
    return 0;
#endif
}

// y [rows, n] (float32, or bfloat16 where y_bfloat16 in weights mode; row stride ldy) = x W^T (+ x[:, :high->k]
// W_high^T where high is not null), x bfloat16 [rows, low->k] (row stride ldx), the planes qrun_planes (in
// cpu_quant_matmul.cpp's layout); in weights mode where dequantize_weights, else in codes mode. 0: done; 1: shapes
// the layout does not cover; 2: no kernel in this build, or no tiles for this process.
extern "C" int qrun_quant_matmul_tiles(const uint16_t* x, int64_t ldx, const qrun_plane* low, const qrun_plane* high,
                                       void* y, int y_bfloat16, int64_t ldy, int64_t rows, int64_t n, int64_t group,
                                       int dequantize_weights, int threads) {
#ifdef QRUN_HAS_AMX
    if (!qrun_planes_fit(*low, high, n, group) || (y_bfloat16 && !dequantize_weights)) return 1;
    const int64_t k = low->k;
    if (!qrun_tiles_permitted()) return 2;
    const int64_t groups = k / group;
    std::vector<float> group_sums(dequantize_weights ? 0 : rows * groups);
    for (int64_t m = 0; m < rows && !dequantize_weights; m++)
        for (int64_t g = 0; g < groups; g++) {
            __m512 sum = _mm512_setzero_ps();
            for (int64_t i = g * group; i < (g + 1) * group; i += 16) {
                const __m256i halves = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + m * ldx + i));
                sum = _mm512_add_ps(sum, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16)));
            }
            group_sums[m * groups + g] = _mm512_reduce_add_ps(sum);
        }
    // tiles load 16 or 32 rows at a time: the rows after the last multiple of 32 get a zero-padded copy
    const int64_t chunk = 2 * TILE_ROWS, tail_rows = rows > chunk ? rows % chunk : 0;
    std::vector<uint16_t> tail(tail_rows ? chunk * k : 0, 0);
    for (int64_t m = 0; m < tail_rows; m++) std::copy_n(x + (rows - tail_rows + m) * ldx, k, tail.data() + m * k);
    const Problem p{x, ldx, rows, k, group, tail.data(), group_sums.data(), y, ldy, y_bfloat16 != 0};
    const int64_t tiles = n / TILE_N;
#pragma omp parallel num_threads(threads)
    {
        // codes mode: a group of two channel tiles, unpacked; weights mode: two pairs of channel tiles, dequantized
        const int64_t blocks = dequantize_weights ? 2 * k / BLOCK_K : group / BLOCK_K;
        thread_local std::vector<uint8_t> storage;  // the pool's threads keep theirs from call to call
        storage.resize(std::max<size_t>(storage.size(), 2 * blocks * BLOCK_BYTES + 64));
        const uintptr_t aligned = (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63);
        uint8_t* buffer = reinterpret_cast<uint8_t*>(aligned);
        alignas(64) float sums[2 * TILE_ROWS * 2 * TILE_N];
        configure(int(std::min<int64_t>(rows, TILE_ROWS)), int(std::clamp<int64_t>(rows - TILE_ROWS, 0, TILE_ROWS)));
        const qrun_plane* planes[2] = {low, high};
        const int count = high ? 2 : 1;
        const int64_t pairs = (tiles + 1) / 2;
        if (dequantize_weights) {  // each thread a run of pairs, so it can dequantize the next while multiplying one
            const int64_t parts = omp_get_num_threads(), part = omp_get_thread_num();
            multiply_dequantized_pairs(p, *low, high, tiles, pairs * part / parts, pairs * (part + 1) / parts, buffer,
                                       sums);
        }
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < (dequantize_weights ? 0 : pairs); pair++) {
            const int64_t t0 = 2 * pair;
            const bool two_tiles = t0 + 1 < tiles;
            for (int64_t m = 0; m < rows; m++)
                std::fill_n(p.floats() + m * ldy + t0 * TILE_N, (two_tiles ? 2 : 1) * TILE_N, 0.f);
            for (int q = 0; q < count; q++) {
                if (two_tiles)
                    multiply_plane<true>(p, *planes[q], t0, buffer, sums);
                else
                    multiply_plane<false>(p, *planes[q], t0, buffer, sums);
            }
        }
        _tile_release();
    }
    return 0;
#else
    return 2;
#endif
}
