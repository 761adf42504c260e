// Each row's index of its largest value, the first on ties and the first NaN where a row holds one (as torch's max
// and argmax answer): greedy sampling's choice over a vocabulary of logits. Documented by kernels/cpu_argmax.py.

#include <cmath>
#include <cstdint>
#include <vector>

#include "cpu_kernels.h"

namespace {

// What a span [begin, end) of a row holds: its largest value and where that first is, its first NaN (-1: none), and
// whether it holds an infinity.
struct Span {
    float top = -INFINITY;
    int64_t best = -1, first_nan = -1;
    bool infinite = false;
};

int64_t first_nan(const float* row, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; i++)
        if (std::isnan(row[i])) return i;
    return -1;
}

// Each lane keeps its largest value and where it first was; NaNs and infinities are noted on the way, so a row is
// read once. With AVX2 the lanes are 8: a scalar loop there took ~1% of a 4.0-bpw SmolLM2 decode step at one row on a
// 2-core Zen 3 EPYC (perf).
Span scan(const float* row, int64_t begin, int64_t end) {
    Span span;
    int64_t i = begin;
    bool nans = false;
#if defined(__AVX512F__)
    if (end - begin >= 16) {
        __m512 tops = _mm512_loadu_ps(row + i);
        __m512i at = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                      _mm512_set1_epi32(int32_t(i)));
        __m512i where = at;
        __mmask16 nan_lanes = _mm512_cmp_ps_mask(tops, tops, _CMP_UNORD_Q);
        __mmask16 infinite_lanes = _mm512_cmp_ps_mask(_mm512_abs_ps(tops), _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
        for (i += 16; i + 16 <= end; i += 16) {
            at = _mm512_add_epi32(at, _mm512_set1_epi32(16));
            const __m512 values = _mm512_loadu_ps(row + i);
            nan_lanes |= _mm512_cmp_ps_mask(values, values, _CMP_UNORD_Q);
            infinite_lanes |= _mm512_cmp_ps_mask(_mm512_abs_ps(values), _mm512_set1_ps(INFINITY), _CMP_EQ_OQ);
            const __mmask16 larger = _mm512_cmp_ps_mask(values, tops, _CMP_GT_OQ);
            tops = _mm512_mask_blend_ps(larger, tops, values);
            where = _mm512_mask_blend_epi32(larger, where, at);
        }
        nans = nan_lanes;
        span.infinite = infinite_lanes;
        span.top = _mm512_reduce_max_ps(tops);
        span.best = _mm512_mask_reduce_min_epi32(_mm512_cmp_ps_mask(tops, _mm512_set1_ps(span.top), _CMP_EQ_OQ), where);
    }
#elif defined(__AVX2__)
    if (end - begin >= 16) {  // two sets of 8 lanes, whose chains of compares and blends run side by side
        __m256 tops[2] = {_mm256_loadu_ps(row + i), _mm256_loadu_ps(row + i + 8)};
        __m256i at = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(int32_t(i)));
        __m256i where[2] = {at, _mm256_add_epi32(at, _mm256_set1_epi32(8))};
        const __m256 magnitude = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
        const auto not_finite = [magnitude](__m256 v) {  // not below infinity in magnitude, or unordered: NaN
            return _mm256_cmp_ps(_mm256_and_ps(v, magnitude), _mm256_set1_ps(INFINITY), _CMP_NLT_UQ);
        };
        __m256 unusual = _mm256_or_ps(not_finite(tops[0]), not_finite(tops[1]));
        for (i += 16; i + 16 <= end; i += 16) {
            at = _mm256_add_epi32(at, _mm256_set1_epi32(16));
            for (int j = 0; j < 2; j++) {
                const __m256 values = _mm256_loadu_ps(row + i + 8 * j);
                unusual = _mm256_or_ps(unusual, not_finite(values));
                const __m256 larger = _mm256_cmp_ps(values, tops[j], _CMP_GT_OQ);
                tops[j] = _mm256_blendv_ps(tops[j], values, larger);
                const __m256i lanes = j ? _mm256_add_epi32(at, _mm256_set1_epi32(8)) : at;
                where[j] = _mm256_castps_si256(
                    _mm256_blendv_ps(_mm256_castsi256_ps(where[j]), _mm256_castsi256_ps(lanes), larger));
            }
        }
        if (_mm256_movemask_ps(unusual))  // a NaN or an infinity in the vectors: which, read again one at a time
            for (int64_t v = begin; v < i; v++) nans |= std::isnan(row[v]), span.infinite |= std::isinf(row[v]);
        float lane_tops[16];
        int32_t lane_where[16];
        for (int j = 0; j < 2; j++) {
            _mm256_storeu_ps(lane_tops + 8 * j, tops[j]);
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(lane_where + 8 * j), where[j]);
        }
        for (int lane = 0; lane < 16; lane++)
            if (span.best < 0 || lane_tops[lane] > span.top ||
                (lane_tops[lane] == span.top && lane_where[lane] < span.best))
                span.top = lane_tops[lane], span.best = lane_where[lane];
    }
#endif
    for (; i < end; i++) {
        nans |= std::isnan(row[i]);
        span.infinite |= std::isinf(row[i]);
        if (span.best < 0 || row[i] > span.top) span.top = row[i], span.best = i;
    }
    if (nans) span.first_nan = first_nan(row, begin, end);
    return span;
}

// A row's answer from its spans in order: its first NaN, else its first largest value; -1 where not_finite_as_none
// and it holds a NaN or an infinity.
int64_t answer(const Span* spans, int64_t count, bool not_finite_as_none) {
    Span whole;
    for (int64_t s = 0; s < count; s++) {
        const Span& span = spans[s];
        if (whole.first_nan < 0) whole.first_nan = span.first_nan;
        whole.infinite |= span.infinite;
        if (span.best >= 0 && (whole.best < 0 || span.top > whole.top)) whole.top = span.top, whole.best = span.best;
    }
    if (not_finite_as_none && (whole.first_nan >= 0 || whole.infinite)) return -1;
    return whole.first_nan >= 0 ? whole.first_nan : whole.best;
}

}  // namespace

// out[r] = the first index of row r's largest value (its first NaN, if any; -1 where not_finite_as_none and the row
// holds a NaN or an infinity) for rows [rows, width] float32, rows `ld` floats apart; width < 2^31. Rows fewer than
// the threads are each split over them in runs of 16 values, as a product of channel tiles splits its columns
// (kernels/cpu_quant_matmul.cpp's few_rows): a step's logits are then read by the threads that stored them, where
// they still sit (a 4.0-bpw SmolLM2's 49,152 logits at one row, on a held team of two threads across a Zen 3 EPYC's
// core complexes).
extern "C" void qrun_first_max(const float* x, int64_t ld, int64_t rows, int64_t width, int64_t* out, int threads,
                               int not_finite_as_none) {
    if (rows >= threads || rows * width < (1 << 15)) {
        qrun_parallel_for(rows, threads, rows * width >= (1 << 18), [&](int64_t r) {
            const Span whole = scan(x + r * ld, 0, width);
            out[r] = answer(&whole, 1, not_finite_as_none);
        });
        return;
    }
    // kept between calls (a decode step makes one); the threads reach the caller's through a pointer, as a
    // thread_local name is each thread's own
    thread_local std::vector<Span> kept;
    kept.assign(rows * threads, Span{});
    Span* const spans = kept.data();
    const int64_t runs = (width + 15) / 16;
    qrun_parallel(threads, [&](int part, int parts) {
        const int64_t begin = std::min(width, 16 * (runs * part / parts)),
                      end = std::min(width, 16 * (runs * (part + 1) / parts));
        for (int64_t r = 0; r < rows; r++) spans[r * threads + part] = scan(x + r * ld, begin, end);
    });
    for (int64_t r = 0; r < rows; r++) out[r] = answer(spans + r * threads, threads, not_finite_as_none);
}
