// A token drawn from each row of logits under its temperature, top-k, top-p and min-p: kernels/draw.py's draw_ref in
// a few passes over the row, which sits in L2. Documented by kernels/cpu_draw.py.
//
// A row's masses are e^(x - max) for x = logit / temperature (its softmax times a constant, which no share depends
// on). Top-k and top-p keep a prefix of the row sorted by mass (largest first, then lowest token), so only the tokens
// that prefix can reach are sorted: a histogram of the masses by their top bits (positive floats order as their
// bits) finds the highest bins that hold the top-k's count or more than top-p's share of the mass, and those bins'
// tokens are the candidates.

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "cpu_kernels.h"

namespace {

constexpr int BIN_SHIFT = 20;                   // a float's sign, exponent and top 3 mantissa bits
constexpr int BINS = (0x3F800000 >> BIN_SHIFT) + 1;  // masses lie in [0, 1]

struct Candidate {
    float mass;
    int32_t token;
};

int bin_of(float mass) { return std::min(int(std::bit_cast<uint32_t>(mass) >> BIN_SHIFT), BINS - 1); }

// The tokens of `mass` [vocab] at `floor` or above in the highest bins that, together, hold `count` tokens or more
// than `share` of `total` (whichever bin comes first from the top), sorted by mass, largest first, then by token.
std::vector<Candidate> candidates(const float* mass, int64_t vocab, float floor, int64_t count, double share,
                                  double total) {
    std::vector<Candidate> above;
    for (int64_t i = 0; i < vocab; i++)
        if (mass[i] >= floor) above.push_back({mass[i], int32_t(i)});
    std::vector<int64_t> counts(BINS, 0);
    std::vector<double> masses(BINS, 0.0);
    for (const Candidate& c : above) {
        counts[bin_of(c.mass)]++;
        masses[bin_of(c.mass)] += c.mass;
    }
    int lowest = BINS - 1;
    int64_t counted = counts[lowest];
    // a slack past the share, so that rounding in the nucleus's own sums cannot reach a token left out here
    for (double held = masses[lowest]; lowest > 0 && counted < count && held <= share * total * (1 + 1e-6);) {
        lowest--;
        counted += counts[lowest];
        held += masses[lowest];
    }
    std::erase_if(above, [&](const Candidate& c) { return bin_of(c.mass) < lowest; });
    std::sort(above.begin(), above.end(), [](const Candidate& a, const Candidate& b) {
        return a.mass > b.mass || (a.mass == b.mass && a.token < b.token);
    });
    return above;
}

// The highest of a few floors at or above which `mass` [vocab] holds `count` tokens (0 where none does): its top-k
// lie at or above it, and most of a vocabulary below.
float top_k_floor(const float* mass, int64_t vocab, int64_t count) {
    for (const float floor : {0x1p-8f, 0x1p-16f, 0x1p-24f}) {
        int64_t at_least = 0;
        for (int64_t i = 0; i < vocab; i++) at_least += mass[i] >= floor;
        if (at_least >= count) return floor;
    }
    return 0.f;
}

// The first token whose cumulative mass (in token order, float64 sums) passes `uniform` of the kept tokens' total:
// over `kept` (sorted by token), else over every token of `mass` at min_mass or more.
int64_t inverse_cdf(const float* mass, int64_t vocab, float min_mass, const std::vector<Candidate>* kept,
                    double uniform) {
    if (kept) {
        double total = 0.0;
        for (const Candidate& c : *kept) total += c.mass;
        const double target = uniform * total;
        double sum = 0.0;
        for (const Candidate& c : *kept)
            if ((sum += c.mass) > target) return c.token;
        return kept->back().token;  // uniform * total rounded up to total
    }
    // block sums first, so that the token-order scan runs over one block
    constexpr int64_t BLOCK = 512;
    const int64_t blocks = (vocab + BLOCK - 1) / BLOCK;
    std::vector<double> block_sums(blocks, 0.0);
    double total = 0.0;
    for (int64_t b = 0; b < blocks; b++) {
        double sum = 0.0;
        for (int64_t i = b * BLOCK; i < std::min(vocab, (b + 1) * BLOCK); i++)
            sum += mass[i] >= min_mass ? double(mass[i]) : 0.0;
        block_sums[b] = sum;
        total += sum;
    }
    const double target = uniform * total;
    double sum = 0.0;
    int64_t last = -1;
    for (int64_t b = 0; b < blocks; b++) {
        if (sum + block_sums[b] <= target) {
            sum += block_sums[b];
            continue;
        }
        for (int64_t i = b * BLOCK; i < std::min(vocab, (b + 1) * BLOCK); i++)
            if (mass[i] >= min_mass && mass[i] > 0.f) {
                last = i;
                if ((sum += mass[i]) > target) return i;
            }
    }
    if (last >= 0) return last;
    for (int64_t i = vocab - 1; i >= 0; i--)  // uniform * total rounded up to total: the last token with mass
        if (mass[i] >= min_mass && mass[i] > 0.f) return i;
    return -1;
}

// mass[i] = logits[i] / temperature; their largest, NaN if one is.
float scaled(const float* logits, int64_t vocab, float temperature, float* mass) {
    float top = -std::numeric_limits<float>::infinity();
    bool nan = false;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512 tops = _mm512_set1_ps(top);
    __mmask16 nans = 0;
    for (; i + 16 <= vocab; i += 16) {
        const __m512 x = _mm512_div_ps(_mm512_loadu_ps(logits + i), _mm512_set1_ps(temperature));
        _mm512_storeu_ps(mass + i, x);
        nans |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
        tops = _mm512_max_ps(tops, x);
    }
    top = _mm512_reduce_max_ps(tops);
    nan = nans;
#endif
    for (; i < vocab; i++) {
        mass[i] = logits[i] / temperature;
        top = std::max(top, mass[i]);
        nan |= std::isnan(mass[i]);
    }
    return nan ? std::numeric_limits<float>::quiet_NaN() : top;
}

// mass[i] = e^(mass[i] - top) for a finite top; their sum, in float64: the top-p floor and the nucleus's cut take
// it as the row's mass, and a float32 sum of a vocabulary can be off by more than their slack.
double exponentiated(float* mass, int64_t vocab, float top) {
    double total = 0.0;
    int64_t i = 0;
#if defined(__AVX512F__)
    __m512d low = _mm512_setzero_pd(), high = _mm512_setzero_pd();
    for (; i + 16 <= vocab; i += 16) {
        const __m512 e = qrun_exp_nonpositive16(_mm512_sub_ps(_mm512_loadu_ps(mass + i), _mm512_set1_ps(top)));
        _mm512_storeu_ps(mass + i, e);
        low = _mm512_add_pd(low, _mm512_cvtps_pd(_mm512_castps512_ps256(e)));
        high = _mm512_add_pd(high, _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1))));
    }
    total = _mm512_reduce_add_pd(_mm512_add_pd(low, high));
#endif
    for (; i < vocab; i++) total += mass[i] = qrun_exp_nonpositive(mass[i] - top);
    return total;
}

int64_t draw_row(const float* logits, int64_t vocab, float temperature, int64_t top_k, float top_p, float min_p,
                 double uniform, float* mass) {
    const float top = scaled(logits, vocab, temperature, mass);
    if (std::isnan(top) || top == -std::numeric_limits<float>::infinity()) return -1;
    double total = 0.0;
    if (top == std::numeric_limits<float>::infinity()) {  // the limit: equal shares of the infinite tokens
        for (int64_t i = 0; i < vocab; i++) total += mass[i] = mass[i] == top ? 1.f : 0.f;
    } else {
        total = exponentiated(mass, vocab, top);
    }
    // min-p: against the largest mass, which is 1
    const bool limited = top_k < vocab || top_p < 1.f;
    if (!limited) return inverse_cdf(mass, vocab, min_p, nullptr, uniform);
    const int64_t k = std::min(top_k, vocab);
    // without a top-k, a token below (1 - top_p) / vocab of the mass (and every less likely one: less than 1 - top_p
    // in all) has more than top_p before it
    std::vector<Candidate> kept =
        k < vocab ? candidates(mass, vocab, top_k_floor(mass, vocab, k), k, 1.0, total)
                  : candidates(mass, vocab, float((1.0 - top_p) * total / vocab * (1 - 1e-6)), vocab, top_p, total);
    if (int64_t(kept.size()) > k) kept.resize(k);
    // the nucleus: a token stays while the mass before it is at most top_p of the top-k's (without a top-k: the
    // row's); the first always stays
    double norm = total;
    if (k < vocab) {
        norm = 0.0;
        for (const Candidate& c : kept) norm += c.mass;
    }
    double before = 0.0;
    size_t keep = 0;
    while (keep < kept.size() && (keep == 0 || before <= double(top_p) * norm)) before += kept[keep++].mass;
    kept.resize(keep);
    std::erase_if(kept, [&](const Candidate& c) { return c.mass < min_p; });  // never the first: its mass is 1
    std::sort(kept.begin(), kept.end(), [](const Candidate& a, const Candidate& b) { return a.token < b.token; });
    return inverse_cdf(mass, vocab, min_p, &kept, uniform);
}

}  // namespace

// out[r] = a token drawn from row r of logits [rows, vocab] (rows `ld` floats apart) by kernels/draw.py's rule, with
// row r's temperature, top_k (vocab or more: no limit), top_p, min_p and uniform in [0, 1); -1 for a row
// without mass (every logit -inf, or a NaN) and for a row at temperature 0, which is not drawn. vocab < 2^31.
extern "C" void qrun_draw(const float* logits, int64_t ld, int64_t rows, int64_t vocab, const float* temperature,
                          const int64_t* top_k, const float* top_p, const float* min_p, const double* uniforms,
                          int64_t* out, int threads) {
    qrun_parallel_for(rows, threads, rows > 1, [&](int64_t r) {
        if (!(temperature[r] > 0)) {
            out[r] = -1;
            return;
        }
        thread_local std::vector<float> mass;
        mass.resize(vocab);
        out[r] = draw_row(logits + r * ld, vocab, temperature[r], top_k[r], top_p[r], min_p[r], uniforms[r],
                          mass.data());
    });
}
