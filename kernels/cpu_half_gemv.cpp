// Matrix-vector products with a float16 weight for CPUs: y = x W^T (+ b) at one or a few rows, the small-batch
// decode steps of dense bfloat16 models (qrun/cpu_linear.py). Built and documented by kernels/cpu_half_gemv.py.
//
// The product is bound by reading W. Each thread reads its share of W's rows as four streams side by side,
// converting 16 float16 values per instruction and accumulating in float32 against the rows of x (held as
// float32), so each weight is read once for every row of x.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__F16C__) && defined(__FMA__))
#include <immintrin.h>
#endif

#include "cpu_kernels.h"

namespace {

inline float half_to_float(uint16_t bits) {
    _Float16 value;
    std::memcpy(&value, &bits, sizeof(value));
    return float(value);
}

inline void store(void* y, int kind, int64_t i, float value) {
    if (kind == QRUN_F32) {
        static_cast<float*>(y)[i] = value;
        return;
    }
    static_cast<uint16_t*>(y)[i] = qrun_bfloat16_bits(value);
}

constexpr int64_t MAX_ROWS = 8;

// One vector of float32 sums, and the float16 weights and float32 inputs it multiplies, on this ISA.
#if defined(__AVX512F__)
#define QRUN_HALF_LANES 1
struct Lanes {
    using Floats = __m512;
    static constexpr int64_t WIDTH = 16;
    static Floats zero() { return _mm512_setzero_ps(); }
    static Floats halves(const uint16_t* at) {
        return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(at)));
    }
    static Floats floats(const float* at) { return _mm512_loadu_ps(at); }
    static Floats fma(Floats a, Floats b, Floats c) { return _mm512_fmadd_ps(a, b, c); }
    static float sum(Floats v) { return _mm512_reduce_add_ps(v); }
};
#elif defined(__AVX2__) && defined(__F16C__) && defined(__FMA__)
#define QRUN_HALF_LANES 1
struct Lanes {
    using Floats = __m256;
    static constexpr int64_t WIDTH = 8;
    static Floats zero() { return _mm256_setzero_ps(); }
    static Floats halves(const uint16_t* at) {
        return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(at)));
    }
    static Floats floats(const float* at) { return _mm256_loadu_ps(at); }
    static Floats fma(Floats a, Floats b, Floats c) { return _mm256_fmadd_ps(a, b, c); }
    static float sum(Floats v) {
        const __m128 halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
        const __m128 pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
        return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
    }
};
#endif

// The sums a thread keeps in registers, STREAMS x ROWS: past four rows it reads two streams side by side rather than
// pass over its weights twice, each pass converting them to float again (dense SmolLM2's C++ steps on a 2-core Xeon
// at 5, 6 and 8 rows: 13.38, 14.65 and 19.47 ms so, against 14.96, 16.39 and 18.42 in two passes of four streams, and
// 17.7-18.7 on oneDNN; one-off probes, each pair in one process).
// AVX2, with half AVX-512's vector registers, keeps 8 beside the weights and inputs.
#if defined(QRUN_HALF_LANES) && !defined(__AVX512F__)
constexpr int64_t MAX_SUMS = 8;
#else
constexpr int64_t MAX_SUMS = 16;
#endif

// A thread reads STREAMS weight rows together, each from its own part of the thread's rows: a core keeps more reads in
// flight over several sequential streams than over one, and how many it reads fastest differs by CPU (4 vs 1: 23.5 vs
// 19.4 GB/s reading SmolLM2's float16 weights matrix by matrix on two Xeon cores; 2 beat 4 on a 2-core EPYC), so the
// count is a parameter (kernels/read_streams.py measures it at load).
// Weights ahead of each stream fetched into L1 (2 KiB) and into L2 (8 KiB), as the 4-bit matmul's (its reason in
// cpu_quant_matmul.cpp).
constexpr int64_t PREFETCH = 1024, PREFETCH_L2 = 4096;

inline float dot_tail(const uint16_t* w, const float* x, int64_t from, int64_t k) {
    float sum = 0.f;
    for (int64_t i = from; i < k; i++) sum += half_to_float(w[i]) * x[i];
    return sum;
}

// sums[s * ROWS + r] = W[channels[s], :] . x[r, :] for STREAMS channels of W, read side by side. Fixed counts, so
// the accumulators stay in registers.
template <int64_t ROWS, int64_t STREAMS>
void dot_channels(const uint16_t* w, const int64_t* channels, int64_t k, const float* x, float* sums) {
    static_assert(ROWS * STREAMS <= MAX_SUMS);
    int64_t start = 0;
#if defined(QRUN_HALF_LANES)
    typename Lanes::Floats acc[STREAMS][ROWS];
    for (int64_t s = 0; s < STREAMS; s++)
        for (int64_t r = 0; r < ROWS; r++) acc[s][r] = Lanes::zero();
    const int64_t body = k / Lanes::WIDTH * Lanes::WIDTH;
    for (int64_t i = 0; i < body; i += Lanes::WIDTH)
        for (int64_t s = 0; s < STREAMS; s++) {
            const uint16_t* row = w + channels[s] * k;
            if (i % 32 == 0) {  // once a 64-byte line
                _mm_prefetch(reinterpret_cast<const char*>(row + i + PREFETCH), _MM_HINT_T0);
                _mm_prefetch(reinterpret_cast<const char*>(row + i + PREFETCH_L2), _MM_HINT_T1);
            }
            const typename Lanes::Floats weights = Lanes::halves(row + i);
            for (int64_t r = 0; r < ROWS; r++) acc[s][r] = Lanes::fma(weights, Lanes::floats(x + r * k + i), acc[s][r]);
        }
    for (int64_t s = 0; s < STREAMS; s++)
        for (int64_t r = 0; r < ROWS; r++) sums[s * ROWS + r] = Lanes::sum(acc[s][r]);
    start = body;
#else
    for (int64_t c = 0; c < STREAMS * ROWS; c++) sums[c] = 0.f;
#endif
    for (int64_t s = 0; s < STREAMS; s++)
        for (int64_t r = 0; r < ROWS; r++) sums[s * ROWS + r] += dot_tail(w + channels[s] * k, x + r * k, start, k);
}

template <int64_t ROWS, int64_t STREAMS>
void half_gemv(const float* x, const uint16_t* w, const uint16_t* bias, void* y, int kind, int64_t ldy, int64_t n,
               int64_t k, int threads) {
    const auto finish = [=](int64_t channel, float sum, int64_t r) {
        store(y, kind, r * ldy + channel, sum + (bias ? half_to_float(bias[channel]) : 0.f));
    };
    // by value: what each thread reads again and again (QrunTeam::run says why)
    qrun_parallel(threads, [=](int64_t part, int64_t parts) {
        const int64_t first = n * part / parts, last = n * (part + 1) / parts, share = (last - first) / STREAMS;
        float sums[STREAMS * ROWS];
        for (int64_t j = 0; j < share; j++) {
            int64_t channels[STREAMS];
            for (int64_t s = 0; s < STREAMS; s++) channels[s] = first + s * share + j;
            dot_channels<ROWS, STREAMS>(w, channels, k, x, sums);
            for (int64_t s = 0; s < STREAMS; s++)
                for (int64_t r = 0; r < ROWS; r++) finish(channels[s], sums[s * ROWS + r], r);
        }
        for (int64_t channel = first + STREAMS * share; channel < last; channel++)  // the last few
            for (int64_t r = 0; r < ROWS; r++) finish(channel, dot_tail(w + channel * k, x + r * k, 0, k), r);
    });
}

template <int64_t ROWS>
void half_gemv(const float* x, const uint16_t* w, const uint16_t* bias, void* y, int kind, int64_t ldy, int64_t n,
               int64_t k, int streams, int threads) {
    // as many of the streams asked for as the sums' registers hold
    if constexpr (ROWS * 4 <= MAX_SUMS)
        if (streams == 4) return half_gemv<ROWS, 4>(x, w, bias, y, kind, ldy, n, k, threads);
    if constexpr (ROWS * 2 <= MAX_SUMS)
        if (streams >= 2) return half_gemv<ROWS, 2>(x, w, bias, y, kind, ldy, n, k, threads);
    half_gemv<ROWS, 1>(x, w, bias, y, kind, ldy, n, k, threads);
}

}  // namespace

// x: [rows, k] float32 (kind 0) or bfloat16 (kind 1), rows ldx elements apart; w: float16 [n, k]; bias: float16
// [n] or null; y: [rows, n] in x's kind, rows ldy apart; each thread reads read_streams (1, 2 or 4) runs of W's rows
// side by side (the same result whatever the count). Returns 0, or 1 for more than MAX_ROWS rows or another stream
// count.
extern "C" int qrun_half_gemv(const void* x, int kind, int64_t ldx, const uint16_t* w, const uint16_t* bias, void* y,
                              int64_t ldy, int64_t rows, int64_t n, int64_t k, int read_streams, int threads) {
    if (rows < 1 || rows > MAX_ROWS || (kind != QRUN_F32 && kind != QRUN_BF16) ||
        (read_streams != 1 && read_streams != 2 && read_streams != 4))
        return 1;
    std::vector<float> inputs(rows * k);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t i = 0; i < k; i++) {
            if (kind == QRUN_F32) {
                inputs[r * k + i] = static_cast<const float*>(x)[r * ldx + i];
            } else {
                const uint32_t bits = uint32_t(static_cast<const uint16_t*>(x)[r * ldx + i]) << 16;
                std::memcpy(&inputs[r * k + i], &bits, sizeof(float));
            }
        }
    switch (rows) {
        case 1: half_gemv<1>(inputs.data(), w, bias, y, kind, ldy, n, k, read_streams, threads); break;
        case 2: half_gemv<2>(inputs.data(), w, bias, y, kind, ldy, n, k, read_streams, threads); break;
        case 3: half_gemv<3>(inputs.data(), w, bias, y, kind, ldy, n, k, read_streams, threads); break;
        case 4: half_gemv<4>(inputs.data(), w, bias, y, kind, ldy, n, k, read_streams, threads); break;
        case 5: half_gemv<5>(inputs.data(), w, bias, y, kind, ldy, n, k, read_streams, threads); break;
        case 6: half_gemv<6>(inputs.data(), w, bias, y, kind, ldy, n, k, read_streams, threads); break;
        case 7: half_gemv<7>(inputs.data(), w, bias, y, kind, ldy, n, k, read_streams, threads); break;
        default: half_gemv<8>(inputs.data(), w, bias, y, kind, ldy, n, k, read_streams, threads); break;
    }
    return 0;
}
