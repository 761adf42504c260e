// Each row's index of its largest value, the first on ties and the first NaN where a row holds one (as torch's max
// and argmax answer): greedy sampling's choice over a vocabulary of logits. Documented by kernels/cpu_argmax.py.

#include <cmath>
#include <cstdint>

#include "cpu_kernels.h"

namespace {

int64_t first_nan(const float* row, int64_t width) {
    for (int64_t i = 0; i < width; i++)
        if (std::isnan(row[i])) return i;
    return -1;
}

int64_t first_max_of_row(const float* row, int64_t width) {
    int64_t i = 0, best = 0;
    float top = width ? row[0] : 0.f;
#if defined(__AVX512F__)
    if (width >= 16) {  // per lane: its largest value and where it first was; NaNs noted on the way
        __m512 tops = _mm512_loadu_ps(row);
        __m512i where = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), at = where;
        __mmask16 nans = _mm512_cmp_ps_mask(tops, tops, _CMP_UNORD_Q);
        for (i = 16; i + 16 <= width; i += 16) {
            at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
            const __m512 values = _mm512_loadu_ps(row + i);
            nans |= _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
            const __mmask16 larger = _mm512_cmp_ps_mask(values, tops, _CMP_GT_OQ);
            tops = _mm512_mask_blend_ps(larger, tops, values);
            where = _mm512_mask_blend_epi32(larger, where, at);
        }
        if (nans) return first_nan(row, width);
        top = _mm512_reduce_max_ps(tops);
        const __mmask16 holding = _mm512_cmp_ps_mask(tops, _mm512_set1_ps(top), _CMP_EQ_OQ);
        best = _mm512_mask_reduce_min_epi32(holding, where);
    }
#endif
    for (; i < width; i++) {
        if (std::isnan(row[i])) return first_nan(row, width);
        if (row[i] > top) top = row[i], best = i;
    }
    return best;
}

}  // namespace

// out[r] = the first index of row r's largest value (its first NaN, if any) for rows [rows, width] float32, rows `ld`
// floats apart; width < 2^31.
extern "C" void qrun_first_max(const float* x, int64_t ld, int64_t rows, int64_t width, int64_t* out, int threads) {
    qrun_parallel_for(rows, threads, rows * width >= (1 << 18),
                      [&](int64_t r) { out[r] = first_max_of_row(x + r * ld, width); });
}
