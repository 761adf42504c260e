// The serving benchmark's probes of this machine (qrun/bench.py): how fast it reads and how fast it multiplies.
//
// The float32 sum of a buffer, read as this library's kernels read weights: each thread's share in `streams` runs
// side by side, fetched ahead into L1 and L2 as cpu_quant_matmul.cpp's prefetch_ahead fetches. It measures how fast
// this machine reads a decode step's bytes, for the serving benchmark's roofline (measure_read_bandwidth): torch's
// sum reads one run per thread, and on a 2-core Xeon VM read 273 MB at ~30 GB/s where the dense model's decode step,
// four runs per thread, read its 273 MB at ~39.
//
// Chains of multiply-adds on 16-float vectors (measure_arithmetic_rate): the arithmetic the decode kernels' FMAs run
// at, which a VM's host can slow apart from its memory.

#include <cstdint>
#include <vector>

#include "cpu_kernels.h"

namespace {

constexpr int64_t PREFETCH_FLOATS = 256, PREFETCH_L2_FLOATS = 2048;  // 1 KiB and 8 KiB ahead, as the kernels fetch

// The sum of [first, last) of x in STREAMS equal runs read side by side, 16 floats at a time, the rest after.
template <int STREAMS>
double sum_side_by_side(const float* x, int64_t first, int64_t last) {
    double total = 0.0;
    int64_t done = first;
#if defined(__AVX512F__)
    const int64_t run = (last - first) / STREAMS / 64 * 64;  // whole groups of four vectors
    __m512 sums[STREAMS][4];
    for (int s = 0; s < STREAMS; s++)
        for (int v = 0; v < 4; v++) sums[s][v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < run; i += 64)
        for (int s = 0; s < STREAMS; s++) {
            const float* at = x + first + s * run + i;
            for (int v = 0; v < 4; v++) {
                _mm_prefetch(reinterpret_cast<const char*>(at + 16 * v + PREFETCH_FLOATS), _MM_HINT_T0);
                _mm_prefetch(reinterpret_cast<const char*>(at + 16 * v + PREFETCH_L2_FLOATS), _MM_HINT_T1);
                sums[s][v] = _mm512_add_ps(sums[s][v], _mm512_loadu_ps(at + 16 * v));
            }
        }
    for (int s = 0; s < STREAMS; s++)
        for (int v = 0; v < 4; v++) total += _mm512_reduce_add_ps(sums[s][v]);
    done = first + STREAMS * run;
#elif defined(__AVX2__)
    // the same lines, each as two 8-float halves summed before they join its stream's sum, so a stream's four sums fit
    // AVX2's 16 registers (before, the whole buffer went through the scalar loop below: 27.9 GB/s on a 2-core Xeon
    // held to AVX2, where this reads 31.5-31.9 and the AVX-512 build 31.4-32.2; the AVX-512 loop above written with
    // qrun_floats, eight sums a stream, read 11.2-11.3: one-off probes)
    const int64_t run = (last - first) / STREAMS / 64 * 64;
    __m256 sums[STREAMS][4];
    for (int s = 0; s < STREAMS; s++)
        for (int v = 0; v < 4; v++) sums[s][v] = _mm256_setzero_ps();
    for (int64_t i = 0; i < run; i += 64)
        for (int s = 0; s < STREAMS; s++) {
            const float* at = x + first + s * run + i;
            for (int v = 0; v < 4; v++) {
                _mm_prefetch(reinterpret_cast<const char*>(at + 16 * v + PREFETCH_FLOATS), _MM_HINT_T0);
                _mm_prefetch(reinterpret_cast<const char*>(at + 16 * v + PREFETCH_L2_FLOATS), _MM_HINT_T1);
                const __m256 line = _mm256_add_ps(_mm256_loadu_ps(at + 16 * v), _mm256_loadu_ps(at + 16 * v + 8));
                sums[s][v] = _mm256_add_ps(sums[s][v], line);
            }
        }
    alignas(32) float lanes[8];
    for (int s = 0; s < STREAMS; s++)
        for (int v = 0; v < 4; v++) {
            _mm256_store_ps(lanes, sums[s][v]);
            for (float lane : lanes) total += lane;
        }
    done = first + STREAMS * run;
#endif
    float rest = 0.f;
    for (int64_t i = done; i < last; i++) rest += x[i];
    return total + rest;
}

}  // namespace

// x[0 .. n)'s sum, each of `threads` threads reading its share in `streams` (1, 2, 4 or 8) runs side by side.
extern "C" double qrun_read_sum(const float* x, int64_t n, int streams, int threads) {
    std::vector<double> parts(std::max(threads, 1), 0.0);
    qrun_parallel(threads, [&](int64_t part, int64_t count) {
        const int64_t first = n * part / count, last = n * (part + 1) / count;
        switch (streams) {
            case 1: parts[part] = sum_side_by_side<1>(x, first, last); break;
            case 2: parts[part] = sum_side_by_side<2>(x, first, last); break;
            case 4: parts[part] = sum_side_by_side<4>(x, first, last); break;
            default: parts[part] = sum_side_by_side<8>(x, first, last); break;
        }
    });
    double total = 0.0;
    for (double p : parts) total += p;
    return total;
}

// rounds x CHAINS multiply-adds of 16-float vectors on each of `threads` threads, in CHAINS independent chains (one
// 512-bit FMA each with AVX-512, two 256-bit ones with AVX2), enough to keep every FMA port busy; the chains' sum, so
// that none of them is left out.
extern "C" double qrun_multiply_adds(int64_t rounds, int threads) {
    constexpr int CHAINS = 12;
    std::vector<double> parts(std::max(threads, 1), 0.0);
    qrun_parallel(threads, [&](int64_t part, int64_t) {
        qrun_floats chains[CHAINS];
        for (int c = 0; c < CHAINS; c++) chains[c] = qrun_floats{} + (1.f + float(c + part) * 1e-7f);
        // read anew each round, so that the compiler (free to reassociate here) cannot fold rounds into fewer
        volatile float opaque_factor = 0.9999999f;
        const qrun_floats term = qrun_floats{} + 1e-8f;
        for (int64_t r = 0; r < rounds; r++) {
            const qrun_floats factor = qrun_floats{} + opaque_factor;
            for (int c = 0; c < CHAINS; c++) chains[c] = chains[c] * factor + term;
        }
        double sum = 0.0;
        for (int c = 0; c < CHAINS; c++)
            for (int lane = 0; lane < 16; lane++) sum += chains[c][lane];
        parts[part] = sum;
    });
    double total = 0.0;
    for (double p : parts) total += p;
    return total;
}
