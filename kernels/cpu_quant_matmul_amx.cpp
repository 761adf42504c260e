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

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define QRUN_HAS_AMX 1
#endif

#ifdef QRUN_HAS_AMX
namespace {

constexpr int64_t TILE_N = 16, BLOCK_K = 32, TILE_ROWS = 16;
constexpr int64_t BLOCK_BYTES = BLOCK_K * TILE_N * 2;  // one block of a channel tile as bfloat16 pairs (a B tile)

// Linux hands out the tile registers' state only to processes that ask (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); asking twice is harmless.
bool tiles_permitted() {
    static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return permitted;
}

struct alignas(64) TileConfig {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
};

// Tiles: 0-3 sums (row tile r, channel tile t: 2r + t), 4-5 rows of x, 6-7 weights. rows1 = 0: one row tile.
void configure(int rows0, int rows1) {
    TileConfig config;
    for (int t = 0; t < 8; t++) config.bytes_per_row[t] = 64;
    config.rows[0] = config.rows[1] = config.rows[4] = rows0;
    config.rows[2] = config.rows[3] = config.rows[5] = rows1 ? rows1 : 1;
    config.rows[6] = config.rows[7] = BLOCK_K / 2;
    _tile_loadconfig(&config);
}

// One plane in cpu_quant_matmul.cpp's layout.
struct Plane {
    const uint8_t* codes;
    const uint16_t* scales;
    const uint16_t* zeros;
    const int8_t* centers;
    int64_t k;  // inputs it covers (the first k of x's)
};

// Blocks [first, first + count) of channel tile `tile` as tdpbf16ps's B operand: per block 16 rows of 64 bytes,
// row p holding (128 + code) of inputs 32b + 2p and 32b + 2p + 1 for each of the 16 channels. Slice s of a packed
// block gives rows 4s .. 4s + 3: its channel c holds in byte j inputs 8s + j (low nibble) and 8s + 4 + j (high).
void unpack_blocks(const Plane& plane, int64_t tile, int64_t first, int64_t count, uint8_t* out) {
    // per 128-bit lane (4 channels): bytes 0, 1 of each channel, then bytes 2, 3
    const __m512i pairs = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m512i nibble = _mm512_set1_epi8(15), exponent = _mm512_set1_epi8(0x43);
    const uint8_t* codes = plane.codes + (tile * (plane.k / BLOCK_K) + first) * 4 * 64;
    for (int64_t slice = 0; slice < count * 4; slice++) {
        const __m512i bytes = _mm512_shuffle_epi8(_mm512_loadu_si512(codes + slice * 64), pairs);
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
// (channel tile t0's) and w1 (t0 + 1's).
template <bool two_tiles, bool two_row_tiles>
void multiply_blocks(const Problem& p, const uint8_t* w0, const uint8_t* w1, int64_t first, int64_t blocks,
                     int64_t m0) {
    const bool padded = p.rows > 2 * TILE_ROWS && m0 + 2 * TILE_ROWS > p.rows;
    const uint16_t* x = (padded ? p.tail : p.x + m0 * p.ldx) + first * BLOCK_K;
    const int64_t stride = (padded ? p.k : p.ldx) * 2;
    for (int64_t b = 0; b < blocks; b++) {
        _tile_loadd(6, w0 + b * BLOCK_BYTES, 64);
        if constexpr (two_tiles) _tile_loadd(7, w1 + b * BLOCK_BYTES, 64);
        _tile_loadd(4, x + b * BLOCK_K, stride);
        _tile_dpbf16ps(0, 4, 6);
        if constexpr (two_tiles) _tile_dpbf16ps(1, 4, 7);
        if constexpr (two_row_tiles) {
            _tile_loadd(5, x + TILE_ROWS * stride / 2 + b * BLOCK_K, stride);
            _tile_dpbf16ps(2, 5, 6);
            if constexpr (two_tiles) _tile_dpbf16ps(3, 5, 7);
        }
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
void multiply_group(const Problem& p, const Plane& plane, const uint8_t* unpacked, int64_t g, int64_t t0, int64_t m0,
                    int rows, float* sums) {
    const int64_t blocks = p.group / BLOCK_K, first = g * blocks;
    zero_sums<two_tiles, two_row_tiles>();
    multiply_blocks<two_tiles, two_row_tiles>(p, unpacked, unpacked + blocks * BLOCK_BYTES, first, blocks, m0);
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
void multiply_plane(const Problem& p, const Plane& plane, int64_t t0, uint8_t* unpacked, float* sums) {
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

// Weights mode: every block of channel tile `tile` of the planes, dequantized, as tdpbf16ps's B operand (the layout
// of unpack_blocks, each value the bfloat16 of the low plane's (code - center) * scale + zero plus, over the high
// plane's inputs, the high plane's: summed in float32 and rounded once, as dequantize_planes rounds).
void dequantize_blocks(const Plane& low, const Plane* high, int64_t group, int64_t tile, uint8_t* out) {
    const __m512i pairs = _mm512_broadcast_i32x4(_mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15));
    const __m512i nibble = _mm512_set1_epi8(15), exponent = _mm512_set1_epi8(0x43);
    const __m512i high_half = _mm512_set1_epi32(int(0xFFFF0000));
    // _mm512_cvtne2ps_pbh(odd, even) puts even's 16 values in the low half: back to pairs (even, odd) per channel
    const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    const int64_t blocks = group / BLOCK_K;
    // per slice of a plane's group g: its four B-tile rows' values (even inputs, odd inputs) as floats
    struct Values {
        __m512 even[4], odd[4];
    };
    const auto dequantize_slice = [&](const Plane& plane, int64_t g, int64_t slice) {
        const int64_t groups = plane.k / group, at = (tile * groups + g) * TILE_N;
        const __m512 scale = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane.scales + at)));
        const __m512 zero = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(plane.zeros + at)));
        // w = ((128 + code) - (128 + center)) * scale + zero, (128 + code) being the bfloat16 codes mode multiplies:
        // the difference is exact, so every value is dequantize_planes' to the bit (no fused multiply-add)
        const __m512 center = _mm512_set1_ps(128.f + plane.centers[g * blocks]);
        const uint8_t* codes = plane.codes + tile * (plane.k / BLOCK_K) * 4 * 64;
        const __m512i bytes = _mm512_shuffle_epi8(_mm512_loadu_si512(codes + slice * 64), pairs);
        const __m512i low_nibbles = _mm512_and_si512(bytes, nibble);
        const __m512i high_nibbles = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), nibble);
        const __m512i rows[4] = {_mm512_unpacklo_epi8(low_nibbles, exponent),
                                 _mm512_unpackhi_epi8(low_nibbles, exponent),
                                 _mm512_unpacklo_epi8(high_nibbles, exponent),
                                 _mm512_unpackhi_epi8(high_nibbles, exponent)};
        Values values;
        const auto weight = [&](__m512 code) {
            return _mm512_add_ps(_mm512_mul_ps(_mm512_sub_ps(code, center), scale), zero);
        };
        for (int r = 0; r < 4; r++) {  // a row's 32 bfloat16 codes as floats: even inputs, then odd ones
            values.even[r] = weight(_mm512_castsi512_ps(_mm512_slli_epi32(rows[r], 16)));
            values.odd[r] = weight(_mm512_castsi512_ps(_mm512_and_si512(rows[r], high_half)));
        }
        return values;
    };
    for (int64_t g = 0; g < low.k / group; g++)
        for (int64_t slice = g * blocks * 4; slice < (g + 1) * blocks * 4; slice++) {
            Values values = dequantize_slice(low, g, slice);
            if (high && g * group < high->k) {
                const Values upper = dequantize_slice(*high, g, slice);
                for (int r = 0; r < 4; r++) {
                    values.even[r] = _mm512_add_ps(values.even[r], upper.even[r]);
                    values.odd[r] = _mm512_add_ps(values.odd[r], upper.odd[r]);
                }
            }
            for (int r = 0; r < 4; r++) {
                const __m512i both = __m512i(_mm512_cvtne2ps_pbh(values.odd[r], values.even[r]));
                _mm512_store_si512(out + (slice * 4 + r) * 64, _mm512_permutexvar_epi16(interleave, both));
            }
        }
}

// Weights mode for channel tiles t0 (and t0 + 1): their planes dequantized into `buffer`, then every row.
template <bool two_tiles, bool two_row_tiles>
void multiply_dequantized(const Problem& p, const Plane& low, const Plane* high, int64_t t0, uint8_t* buffer,
                          float* sums) {
    const int64_t tile_bytes = low.k / BLOCK_K * BLOCK_BYTES;
    for (int t = 0; t < (two_tiles ? 2 : 1); t++)
        dequantize_blocks(low, high, p.group, t0 + t, buffer + t * tile_bytes);
    for (int64_t m0 = 0; m0 < p.rows; m0 += 2 * TILE_ROWS) {
        zero_sums<two_tiles, two_row_tiles>();
        multiply_blocks<two_tiles, two_row_tiles>(p, buffer, buffer + (two_tiles ? tile_bytes : 0), 0, low.k / BLOCK_K,
                                                  m0);
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

}  // namespace
#endif

// 1 where this build has the kernel and the OS lets this process use the tiles.
extern "C" int qrun_quant_matmul_tiles_available() {
#ifdef QRUN_HAS_AMX
    return tiles_permitted() ? 1 : 0;
#else
    return 0;
#endif
}

// y [rows, n] (float32, or bfloat16 where y_bfloat16 in weights mode; row stride ldy) = x W^T (+ x[:, :k_high]
// W_high^T where high_codes), x bfloat16 [rows, k]
// (row stride ldx), the planes in cpu_quant_matmul.cpp's layout; in weights mode where dequantize_weights, else
// in codes mode. 0: done; 1: shapes the layout does not cover; 2: no kernel in this build, or no tiles for this
// process.
extern "C" int qrun_quant_matmul_tiles(const uint16_t* x, int64_t ldx, const uint8_t* codes, const uint16_t* scales,
                                       const uint16_t* zeros, const int8_t* centers, const uint8_t* high_codes,
                                       const uint16_t* high_scales, const uint16_t* high_zeros,
                                       const int8_t* high_centers, int64_t k_high, void* y, int y_bfloat16,
                                       int64_t ldy, int64_t rows, int64_t n, int64_t k, int64_t group,
                                       int dequantize_weights, int threads) {
#ifdef QRUN_HAS_AMX
    if (n % TILE_N || k % BLOCK_K || group % BLOCK_K || k % group || (high_codes && (k_high % group || k_high > k)) ||
        (y_bfloat16 && !dequantize_weights))
        return 1;
    if (!tiles_permitted()) return 2;
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
    const Plane planes[2] = {{codes, scales, zeros, centers, k},
                             {high_codes, high_scales, high_zeros, high_centers, k_high}};
    const int64_t tiles = n / TILE_N;
#pragma omp parallel num_threads(threads)
    {
        // codes mode: a group of two channel tiles, unpacked; weights mode: two channel tiles
        const int64_t blocks = dequantize_weights ? k / BLOCK_K : group / BLOCK_K;
        std::vector<uint8_t> storage(2 * blocks * BLOCK_BYTES + 64);
        const uintptr_t aligned = (reinterpret_cast<uintptr_t>(storage.data()) + 63) & ~uintptr_t(63);
        uint8_t* buffer = reinterpret_cast<uint8_t*>(aligned);
        alignas(64) float sums[2 * TILE_ROWS * 2 * TILE_N];
        configure(int(std::min<int64_t>(rows, TILE_ROWS)), int(std::clamp<int64_t>(rows - TILE_ROWS, 0, TILE_ROWS)));
        const int count = high_codes ? 2 : 1;
        const bool two_row_tiles = rows > TILE_ROWS;
#pragma omp for schedule(static)
        for (int64_t pair = 0; pair < (tiles + 1) / 2; pair++) {
            const int64_t t0 = 2 * pair;
            const bool two_tiles = t0 + 1 < tiles;
            if (dequantize_weights) {
                const Plane* high = count == 2 ? &planes[1] : nullptr;
                if (two_tiles && two_row_tiles) multiply_dequantized<true, true>(p, planes[0], high, t0, buffer, sums);
                else if (two_tiles) multiply_dequantized<true, false>(p, planes[0], high, t0, buffer, sums);
                else if (two_row_tiles) multiply_dequantized<false, true>(p, planes[0], high, t0, buffer, sums);
                else multiply_dequantized<false, false>(p, planes[0], high, t0, buffer, sums);
                continue;
            }
            for (int64_t m = 0; m < rows; m++)
                std::fill_n(p.floats() + m * ldy + t0 * TILE_N, (two_tiles ? 2 : 1) * TILE_N, 0.f);
            for (int q = 0; q < count; q++) {
                if (two_tiles)
                    multiply_plane<true>(p, planes[q], t0, buffer, sums);
                else
                    multiply_plane<false>(p, planes[q], t0, buffer, sums);
            }
        }
        _tile_release();
    }
    return 0;
#else
    return 2;
#endif
}
