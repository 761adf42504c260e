// Paged decode attention for CPUs: every sequence of a step that decodes one token attends over
// its cached keys and values, read in place from the cache blocks in their stored dtype.
// Built and loaded by kernels/cpu_attention.py, which documents the layout and the reasons.
//
// Work is split over (sequence, KV head) pairs; each pair's G = Hq / Hkv query heads share one
// pass over the keys (scores) and one over the values (weighted sum), in float32. head_dim is a
// template parameter for the common sizes, so the compiler unrolls and vectorises the row loops.

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

enum KVKind { F32 = 0, BF16 = 1, F16 = 2, INT8 = 3, INT4 = 4 };

inline float half_to_float(const _Float16* value) {
#if defined(__F16C__)
    uint16_t bits;
    std::memcpy(&bits, value, sizeof(bits));
    return _cvtsh_ss(bits);
#else
    return float(*value);
#endif
}

// Elements sharing one (scale, zero) in the quantized kinds: kv_group_size in kernels/kv_quant.py.
template <int kind, int64_t dim>
constexpr int64_t group_size() {
    const int64_t preferred = kind == INT8 ? 64 : 32;
    return dim % preferred == 0 ? preferred : dim;
}

// Row `index` of a cache ([slots * Hkv] rows of head_dim values) as floats. `scales` holds the
// quantized kinds' (scale, zero) per group of each row (kernels/kv_quant.py).
template <int kind, int64_t dim>
inline void load_row(const void* data, int64_t index, const _Float16* scales, float* out) {
    constexpr int64_t group = group_size<kind, dim>();
    if constexpr (kind == F32) {
        std::memcpy(out, static_cast<const float*>(data) + index * dim, dim * sizeof(float));
    } else if constexpr (kind == BF16) {
        const uint16_t* row = static_cast<const uint16_t*>(data) + index * dim;
        for (int64_t d = 0; d < dim; d++) {
            uint32_t bits = uint32_t(row[d]) << 16;
            std::memcpy(&out[d], &bits, sizeof(float));
        }
    } else if constexpr (kind == F16) {
        const _Float16* row = static_cast<const _Float16*>(data) + index * dim;
#if defined(__F16C__)
        if constexpr (dim % 8 == 0) {
            for (int64_t d = 0; d < dim; d += 8)
                _mm256_storeu_ps(out + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + d))));
            return;
        }
#endif
        for (int64_t d = 0; d < dim; d++) out[d] = half_to_float(row + d);
    } else if constexpr (kind == INT8) {
        const int8_t* row = static_cast<const int8_t*>(data) + index * dim;
        const _Float16* scale_zero = scales + index * (dim / group) * 2;
        for (int64_t g = 0; g < dim / group; g++) {
            const float step = half_to_float(scale_zero + 2 * g), zero = half_to_float(scale_zero + 2 * g + 1);
            for (int64_t d = g * group; d < (g + 1) * group; d++) out[d] = float(row[d]) * step + zero;
        }
    } else {  // INT4: in each group, byte j holds element j (low nibble) and element j + group / 2
        const int64_t half = group / 2;
        const uint8_t* row = static_cast<const uint8_t*>(data) + index * (dim / 2);
        const _Float16* scale_zero = scales + index * (dim / group) * 2;
        for (int64_t g = 0; g < dim / group; g++) {
            const float step = half_to_float(scale_zero + 2 * g), zero = half_to_float(scale_zero + 2 * g + 1);
            const uint8_t* bytes = row + g * half;
            float* values = out + g * group;
            for (int64_t j = 0; j < half; j++) values[j] = float(bytes[j] & 15) * step + zero;
            for (int64_t j = 0; j < half; j++) values[j + half] = float(bytes[j] >> 4) * step + zero;
        }
    }
}

struct Step {
    const float* q;
    float* out;
    const void* k_cache;
    const void* v_cache;
    const _Float16* k_scales;
    const _Float16* v_scales;
    const int32_t* block_tables;
    int64_t table_width;
    const int32_t* seq_lens;
    const int32_t* query_start_loc;
    int64_t num_seqs, num_q_heads, num_kv_heads, block_shift, group;
    float scale;
    int threads;
};

template <int kind, int64_t dim>
void decode_attention(const Step& step) {
    const int64_t heads_per_kv = step.num_q_heads / step.num_kv_heads;
    const int64_t block_mask = (int64_t(1) << step.block_shift) - 1;
#pragma omp parallel num_threads(step.threads)
    {
        alignas(64) float row[dim];
        std::vector<float> scores, queries(heads_per_kv * dim), acc(heads_per_kv * dim), inverse_sum(heads_per_kv);
#pragma omp for schedule(dynamic, 1)
        for (int64_t item = 0; item < step.num_seqs * step.num_kv_heads; item++) {
            const int64_t seq = item / step.num_kv_heads, head = item % step.num_kv_heads;
            const int64_t token = step.query_start_loc[seq];
            if (step.query_start_loc[seq + 1] - token != 1) continue;  // a prefill chunk: not this kernel's
            const int64_t length = step.seq_lens[seq];
            const int32_t* table = step.block_tables + seq * step.table_width;
            auto row_of = [&](int64_t t) {
                return ((int64_t(table[t >> step.block_shift]) << step.block_shift) + (t & block_mask))
                       * step.num_kv_heads + head;
            };
            const int64_t first_q = (token * step.num_q_heads + head * heads_per_kv) * dim;
            for (int64_t i = 0; i < heads_per_kv * dim; i++) queries[i] = step.q[first_q + i] * step.scale;
            scores.resize(heads_per_kv * length);
            for (int64_t t = 0; t < length; t++) {
                load_row<kind, dim>(step.k_cache, row_of(t), step.k_scales, row);
                for (int64_t g = 0; g < heads_per_kv; g++) {
                    const float* query = &queries[g * dim];
                    float dot = 0.f;
                    for (int64_t d = 0; d < dim; d++) dot += query[d] * row[d];
                    scores[g * length + t] = dot;
                }
            }
            for (int64_t g = 0; g < heads_per_kv; g++) {
                float* s = &scores[g * length];
                float top = -FLT_MAX, sum = 0.f;
                for (int64_t t = 0; t < length; t++) top = std::max(top, s[t]);
                for (int64_t t = 0; t < length; t++) {
                    s[t] = std::exp(s[t] - top);
                    sum += s[t];
                }
                inverse_sum[g] = 1.f / sum;
            }
            std::fill(acc.begin(), acc.end(), 0.f);
            for (int64_t t = 0; t < length; t++) {
                load_row<kind, dim>(step.v_cache, row_of(t), step.v_scales, row);
                for (int64_t g = 0; g < heads_per_kv; g++) {
                    const float p = scores[g * length + t];
                    float* a = &acc[g * dim];
                    for (int64_t d = 0; d < dim; d++) a[d] += p * row[d];
                }
            }
            for (int64_t g = 0; g < heads_per_kv; g++)
                for (int64_t d = 0; d < dim; d++) step.out[first_q + g * dim + d] = acc[g * dim + d] * inverse_sum[g];
        }
    }
}

template <int kind, int64_t dim>
int decode_attention_checked(const Step& step) {
    if ((kind == INT8 || kind == INT4) && step.group != group_size<kind, dim>()) return 3;
    decode_attention<kind, dim>(step);
    return 0;
}

template <int kind>
int decode_attention_for_dim(const Step& step, int64_t dim) {
    switch (dim) {
        case 64: return decode_attention_checked<kind, 64>(step);
        case 80: return decode_attention_checked<kind, 80>(step);
        case 96: return decode_attention_checked<kind, 96>(step);
        case 128: return decode_attention_checked<kind, 128>(step);
        case 256: return decode_attention_checked<kind, 256>(step);
    }
    return 2;
}

}  // namespace

// 0: done; 1: unknown cache kind; 2: a head_dim without an instantiation (the caller checks
// `HEAD_DIMS` in cpu_attention.py first); 3: quantized groups other than kv_group_size's.
extern "C" int qrun_decode_attention(int kv_kind, const float* q, float* out, const void* k_cache,
                                     const void* v_cache, const void* k_scales, const void* v_scales,
                                     const int32_t* block_tables, int64_t table_width, const int32_t* seq_lens,
                                     const int32_t* query_start_loc, int64_t num_seqs, int64_t num_q_heads,
                                     int64_t num_kv_heads, int64_t dim, int64_t block_shift, int64_t group,
                                     float scale, int threads) {
    const Step step{q, out, k_cache, v_cache, static_cast<const _Float16*>(k_scales),
                    static_cast<const _Float16*>(v_scales), block_tables, table_width, seq_lens, query_start_loc,
                    num_seqs, num_q_heads, num_kv_heads, block_shift, group, scale, threads};
    switch (kv_kind) {
        case F32: return decode_attention_for_dim<F32>(step, dim);
        case BF16: return decode_attention_for_dim<BF16>(step, dim);
        case F16: return decode_attention_for_dim<F16>(step, dim);
        case INT8: return decode_attention_for_dim<INT8>(step, dim);
        case INT4: return decode_attention_for_dim<INT4>(step, dim);
    }
    return 1;
}
