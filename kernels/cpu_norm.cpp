// RMSNorm of rows, optionally after the residual add that precedes it: one pass per row (add, statistics, scale)
// where torch makes one op of each. Rounds as torch's rms_norm (kernels/norm.py's reference): the sum to the rows'
// dtype, then the scaled row once. Documented by kernels/cpu_norm.py.

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"

namespace {

template <int KIND>
void rms_norm_rows(const void* x, const void* residual, const void* weight, void* out, void* sum, int64_t rows,
                   int64_t hidden, float eps, int threads) {
    const int64_t width = KIND == QRUN_F32 ? 4 : 2;  // bytes per element
    qrun_parallel_for(rows, threads, rows * hidden >= (1 << 16), [&](int64_t r) {
        const char* x_row = static_cast<const char*>(x) + r * hidden * width;
        const char* res_row = residual ? static_cast<const char*>(residual) + r * hidden * width : nullptr;
        char* sum_row = sum ? static_cast<char*>(sum) + r * hidden * width : nullptr;
        char* out_row = static_cast<char*>(out) + r * hidden * width;
        float squares = 0.f;
        int64_t i = 0;
#if defined(__AVX512F__)
        __m512 vector_squares = _mm512_setzero_ps();
        for (; i + 16 <= hidden; i += 16) {
            __m512 value = qrun_load16<KIND>(x_row, i);
            if (res_row) {
                value = qrun_round16<KIND>(_mm512_add_ps(value, qrun_load16<KIND>(res_row, i)));
                qrun_store16<KIND>(sum_row, i, value);
            }
            vector_squares = _mm512_fmadd_ps(value, value, vector_squares);
        }
        squares = _mm512_reduce_add_ps(vector_squares);
#endif
        for (; i < hidden; i++) {
            float value = qrun_load_value<KIND>(x_row, i);
            if (res_row) {
                value = qrun_round_value<KIND>(value + qrun_load_value<KIND>(res_row, i));
                qrun_store_value<KIND>(sum_row, i, value);
            }
            squares += value * value;
        }
        const float inverse = 1.f / std::sqrt(squares / float(hidden) + eps);
        const void* values = res_row ? static_cast<const void*>(sum_row) : static_cast<const void*>(x_row);
        i = 0;
#if defined(__AVX512F__)
        for (; i + 16 <= hidden; i += 16)
            qrun_store16<KIND>(out_row, i, _mm512_mul_ps(_mm512_mul_ps(qrun_load16<KIND>(values, i),
                                                                       _mm512_set1_ps(inverse)),
                                                         qrun_load16<KIND>(weight, i)));
#endif
        for (; i < hidden; i++)
            qrun_store_value<KIND>(out_row, i,
                                   qrun_load_value<KIND>(values, i) * inverse * qrun_load_value<KIND>(weight, i));
    });
}

}  // namespace

// out [rows, hidden] = RMSNorm(x (+ residual)) * weight, all of one kind (0 float32, 1 bfloat16) and contiguous;
// with a residual, sum = x + residual as well. 0: done; 1: an unknown kind.
extern "C" int qrun_rms_norm(int kind, const void* x, const void* residual, const void* weight, void* out, void* sum,
                             int64_t rows, int64_t hidden, float eps, int threads) {
    return qrun_with_kind(kind, [&](auto k) {
        rms_norm_rows<decltype(k)::value>(x, residual, weight, out, sum, rows, hidden, eps, threads);
    });
}
