// Logprobs of sampled tokens and of each row's likeliest tokens: kernels/logprobs.py's top_logprobs_ref in two
// passes over the row, which sits in L2 (its largest value; then the sum of e^(x - largest) beside the selection of
// its top_n). Documented by kernels/cpu_logprobs.py.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu_kernels.h"

namespace {

constexpr float INF = std::numeric_limits<float>::infinity();
constexpr float NOT_A_NUMBER = std::numeric_limits<float>::quiet_NaN();

// The n largest values met so far, largest first, each with its token; a row is offered in token order, so of equal
// values the lower token stays first (a later one must be larger to enter). Empty slots hold -inf and token -1.
class Best {
  public:
    Best(float* values, int64_t* ids, int64_t n) : values_(values), ids_(ids), n_(n) {
        std::fill(values_, values_ + n_, -INF);
        std::fill(ids_, ids_ + n_, int64_t(-1));
    }

    float floor() const { return n_ ? values_[n_ - 1] : INF; }

    void offer(float value, int64_t token) {
        if (!(value > floor())) return;
        int64_t at = n_ - 1;
        for (; at > 0 && values_[at - 1] < value; at--) {
            values_[at] = values_[at - 1];
            ids_[at] = ids_[at - 1];
        }
        values_[at] = value;
        ids_[at] = token;
    }

  private:
    float* values_;
    int64_t* ids_;
    int64_t n_;
};

// The sum of e^(x - top) over the row (float64, top finite), offering each value to `best`.
double exp_sum_and_best(const float* x, int64_t vocab, float top, Best& best) {
    double total = 0.0;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();
    for (; i + 16 <= vocab; i += 16) {
        const __m512 v = _mm512_loadu_ps(x + i);
        const __m512 e = qrun_exp_nonpositive16(_mm512_sub_ps(v, _mm512_set1_ps(top)));
        low = _mm512_add_pd(low, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        high = _mm512_add_pd(high, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
        for (__mmask16 above = _mm512_cmp_ps_mask(v, _mm512_set1_ps(best.floor()), _CMP_GT_OQ); above;
             above &= above - 1) {
            const int lane = __builtin_ctz(above);
            best.offer(x[i + lane], i + lane);  // raises the floor: the lanes after are checked again
        }
    }
    total = _mm512_reduce_add_pd(_mm512_add_pd(low, high));
#endif
    for (; i < vocab; i++) {
        total += qrun_exp_nonpositive(x[i] - top);
        best.offer(x[i], i);
    }
    return total;
}

// Row `x`'s log-softmax at `token`, and its top_n largest values with their tokens, as top_logprobs_ref.
float row_logprobs(const float* x, int64_t vocab, int64_t token, int64_t top_n, float* values, int64_t* ids) {
    Best best(values, ids, top_n);
    int64_t first;  // the row's first largest value, or its first NaN
    qrun_first_max(x, vocab, 1, vocab, &first, 1, 0);
    const float top = x[first];
    if (std::isnan(top) || top == -INF) {  // log-softmax is NaN throughout
        std::fill(values, values + top_n, NOT_A_NUMBER);
        return NOT_A_NUMBER;
    }
    if (top == INF) {  // the limit: equal shares of the infinite tokens, none for the rest
        int64_t infinite = 0;
        for (int64_t i = 0; i < vocab; i++) infinite += x[i] == INF;
        const float share = -std::log(float(infinite));
        for (int64_t i = 0; i < vocab; i++)
            if (x[i] == INF) best.offer(share, i);
        return x[token] == INF ? share : -INF;
    }
    const float log_total = float(std::log(exp_sum_and_best(x, vocab, top, best)));
    for (int64_t j = 0; j < top_n && ids[j] >= 0; j++) values[j] = (values[j] - top) - log_total;
    return (x[token] - top) - log_total;
}

}  // namespace

// Of each row r of logits [rows, vocab] (rows `ld` floats apart) whose token tokens[r] is not negative: chosen[r] its
// log-softmax at that token, top_values / top_ids [r * top_n, (r + 1) * top_n) its top_n largest values, largest
// first (of equal values the lower token first), and their tokens; slots past the row's finite values hold -inf and
// token -1. A row whose token is negative is not asked for: its outputs are left as they are. vocab < 2^31.
extern "C" void qrun_top_logprobs(const float* logits, int64_t ld, int64_t rows, int64_t vocab, const int64_t* tokens,
                                  int64_t top_n, float* chosen, float* top_values, int64_t* top_ids, int threads) {
    qrun_parallel_for(rows, threads, rows > 1, [&](int64_t r) {
        if (tokens[r] < 0) return;
        chosen[r] = row_logprobs(logits + r * ld, vocab, tokens[r], top_n, top_values + r * top_n,
                                 top_ids + r * top_n);
    });
}
