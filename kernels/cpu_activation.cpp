// SiLU-gated activation for CPUs: activation.py's silu_and_mul_ref, silu(gate) * up, in one pass over the rows, read
// in place from the fused gate/up projection. Documented by kernels/cpu_activation.py.

#include <cstdint>

#include "cpu_kernels.h"

namespace {

// As the reference rounds: the SiLU to the rows' dtype, then the product.
template <int kind>
void silu_and_mul_rows(const void* gate, const void* up, int64_t ld, void* out, int64_t rows, int64_t width,
                       int threads) {
    const int64_t bytes = kind == QRUN_F32 ? 4 : 2;
    qrun_parallel_for(rows, threads, rows * width >= (1 << 16), [&](int64_t r) {
        const char* gate_row = static_cast<const char*>(gate) + r * ld * bytes;
        const char* up_row = static_cast<const char*>(up) + r * ld * bytes;
        char* out_row = static_cast<char*>(out) + r * width * bytes;
        int64_t i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= width; i += 16)
            qrun_store16<kind>(out_row, i,
                               qrun_gated16<kind>(qrun_load16<kind>(gate_row, i), qrun_load16<kind>(up_row, i)));
#elif defined(__AVX2__) && defined(__FMA__)
        if constexpr (kind == QRUN_F32) {
            const float* gates = reinterpret_cast<const float*>(gate_row);
            const float* ups = reinterpret_cast<const float*>(up_row);
            for (; i + 8 <= width; i += 8)
                _mm256_storeu_ps(reinterpret_cast<float*>(out_row) + i,
                                 _mm256_mul_ps(qrun_silu8(_mm256_loadu_ps(gates + i)), _mm256_loadu_ps(ups + i)));
        }
#endif
        for (; i < width; i++) {
            const float activated = qrun_round_value<kind>(qrun_silu(qrun_load_value<kind>(gate_row, i)));
            qrun_store_value<kind>(out_row, i, activated * qrun_load_value<kind>(up_row, i));
        }
    });
}

}  // namespace

// out [rows, width] (contiguous) = silu(gate) * up, gate and up [rows, width] float32 (kind 0) or bfloat16 (kind 1)
// with their rows ld elements apart. 0: done; 1: an unknown kind.
extern "C" int qrun_silu_and_mul(int kind, const void* gate, const void* up, int64_t ld, void* out, int64_t rows,
                                 int64_t width, int threads) {
    return qrun_with_kind(kind, [&](auto k) {
        silu_and_mul_rows<decltype(k)::value>(gate, up, ld, out, rows, width, threads);
    });
}
