// Matrix-vector products with a float16 weight for CPUs: y = x W^T (+ b) at one or a few rows, the batch-1
// decode step of dense bfloat16 models (qrun/cpu_linear.py). Built and documented by kernels/cpu_half_gemv.py.
//
// The product is bound by reading W. Each thread streams its share of W's rows, four at a time, converting 16
// float16 values per instruction and accumulating in float32 against the rows of x (held as float32), so each
// weight is read once for every row of x.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "cpu_kernels.h"

namespace {

enum Kind { F32 = 0, BF16 = 1 };

inline float half_to_float(uint16_t bits) {
    _Float16 value;
    std::memcpy(&value, &bits, sizeof(value));
    return float(value);
}

inline void store(void* y, int kind, int64_t i, float value) {
    if (kind == F32) {
        static_cast<float*>(y)[i] = value;
        return;
    }
    static_cast<uint16_t*>(y)[i] = qrun_bfloat16_bits(value);
}

constexpr int64_t MAX_ROWS = 4;
constexpr int64_t CHANNELS = 4;  // weight rows streamed together
constexpr int64_t PREFETCH = 1024;  // weights (2 KiB) ahead of the stream: 18.9 -> 21 GB/s on two Xeon cores

// sums[c * ROWS + r] = W[c, :] . x[r, :] for the CHANNELS rows of W from w. Fixed counts, so the
// accumulators stay in registers.
template <int64_t ROWS>
void dot_channels(const uint16_t* w, int64_t k, const float* x, float* sums) {
    int64_t start = 0;
#if defined(__AVX512F__)
    // Independent sums per row (CHAINS of them, added at the end): with one, each multiply-add waits for the last
    // (4 cycles), which capped a thread at ~20 GB/s of float16 weights in cache.
    constexpr int64_t CHAINS = ROWS >= 4 ? 1 : 4 / ROWS, STEP = 16 * CHAINS;
    __m512 acc[CHANNELS][ROWS][CHAINS];
    for (int64_t c = 0; c < CHANNELS; c++)
        for (int64_t r = 0; r < ROWS; r++)
            for (int64_t u = 0; u < CHAINS; u++) acc[c][r][u] = _mm512_setzero_ps();
    const int64_t body = k / STEP * STEP, tail = k / 16 * 16;
    for (int64_t c = 0; c < CHANNELS; c++) {  // one weight row at a time: one sequential stream per thread
        const uint16_t* row = w + c * k;
        const auto fma16 = [&](int64_t i, int64_t u) {
            _mm_prefetch(reinterpret_cast<const char*>(row + i + PREFETCH), _MM_HINT_T0);
            const __m512 weights = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i)));
            for (int64_t r = 0; r < ROWS; r++)
                acc[c][r][u] = _mm512_fmadd_ps(weights, _mm512_loadu_ps(x + r * k + i), acc[c][r][u]);
        };
        for (int64_t i = 0; i < body; i += STEP)
            for (int64_t u = 0; u < CHAINS; u++) fma16(i + 16 * u, u);
        for (int64_t i = body; i < tail; i += 16) fma16(i, 0);
    }
    for (int64_t c = 0; c < CHANNELS; c++)
        for (int64_t r = 0; r < ROWS; r++) {
            __m512 total = acc[c][r][0];
            for (int64_t u = 1; u < CHAINS; u++) total = _mm512_add_ps(total, acc[c][r][u]);
            sums[c * ROWS + r] = _mm512_reduce_add_ps(total);
        }
    start = tail;
#else
    for (int64_t c = 0; c < CHANNELS * ROWS; c++) sums[c] = 0.f;
#endif
    for (int64_t c = 0; c < CHANNELS; c++)
        for (int64_t i = start; i < k; i++) {
            const float weight = half_to_float(w[c * k + i]);
            for (int64_t r = 0; r < ROWS; r++) sums[c * ROWS + r] += weight * x[r * k + i];
        }
}

template <int64_t ROWS>
void half_gemv(const float* x, const uint16_t* w, const uint16_t* bias, void* y, int kind, int64_t ldy, int64_t n,
               int64_t k, int threads) {
    const int64_t blocks = n / CHANNELS;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t block = 0; block <= blocks; block++) {
        const int64_t first = block * CHANNELS, count = std::min(CHANNELS, n - first);
        if (count <= 0) continue;
        float sums[CHANNELS * ROWS] = {};
        if (count == CHANNELS) {
            dot_channels<ROWS>(w + first * k, k, x, sums);
        } else {  // the last few channels
            for (int64_t c = 0; c < count; c++)
                for (int64_t i = 0; i < k; i++)
                    for (int64_t r = 0; r < ROWS; r++)
                        sums[c * ROWS + r] += half_to_float(w[(first + c) * k + i]) * x[r * k + i];
        }
        for (int64_t c = 0; c < count; c++) {
            const float offset = bias ? half_to_float(bias[first + c]) : 0.f;
            for (int64_t r = 0; r < ROWS; r++) store(y, kind, r * ldy + first + c, sums[c * ROWS + r] + offset);
        }
    }
}

}  // namespace

// x: [rows, k] float32 (kind 0) or bfloat16 (kind 1), rows ldx elements apart; w: float16 [n, k]; bias: float16
// [n] or null; y: [rows, n] in x's kind, rows ldy apart. Returns 0, or 1 for more than MAX_ROWS rows.
extern "C" int qrun_half_gemv(const void* x, int kind, int64_t ldx, const uint16_t* w, const uint16_t* bias, void* y,
                              int64_t ldy, int64_t rows, int64_t n, int64_t k, int threads) {
    if (rows < 1 || rows > MAX_ROWS || (kind != F32 && kind != BF16)) return 1;
    std::vector<float> inputs(rows * k);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < k; i++) {
            if (kind == F32) {
                inputs[r * k + i] = static_cast<const float*>(x)[r * ldx + i];
            } else {
                const uint32_t bits = uint32_t(static_cast<const uint16_t*>(x)[r * ldx + i]) << 16;
                std::memcpy(&inputs[r * k + i], &bits, sizeof(float));
            }
        }
    switch (rows) {
        case 1: half_gemv<1>(inputs.data(), w, bias, y, kind, ldy, n, k, threads); break;
        case 2: half_gemv<2>(inputs.data(), w, bias, y, kind, ldy, n, k, threads); break;
        case 3: half_gemv<3>(inputs.data(), w, bias, y, kind, ldy, n, k, threads); break;
        default: half_gemv<4>(inputs.data(), w, bias, y, kind, ldy, n, k, threads); break;
    }
    return 0;
}
