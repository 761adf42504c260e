// Paged attention for CPUs: every row of a step attends over its sequence's cached keys and values, read in place
// from the cache blocks in their stored dtype. Built and loaded by kernels/cpu_attention.py, which documents the
// layout and the reasons.
//
// Decode rows (one query in their sequence): work is split over chunks of each row's tokens (all KV heads); per
// chunk, each query head's scores from one pass over the keys, its softmax weights, one pass over the values, in
// float32; chunks merged after (see chunk_tokens). Prefill chunks: 16 queries a vector's lanes (see KEYS).
// head_dim is a template parameter for the common sizes, so the row loops unroll and vectorise.

#include <algorithm>
#include <array>
#include <atomic>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"

#if defined(__F16C__) || defined(__AVX512F__)
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
// row_vectors's fallback: the kinds and CPUs it does not convert in registers.
template <int kind, int64_t dim>
inline void load_row(const void* data, int64_t index, const _Float16* scales, float* out) {
    constexpr int64_t group = group_size<kind, dim>();
    if constexpr (kind == F32) {
        std::memcpy(out, static_cast<const float*>(data) + index * dim, dim * sizeof(float));
    } else if constexpr (kind == BF16) {  // bfloat16 bits are a float's upper half
        using Halves = uint16_t __attribute__((vector_size(32)));
        using Words = uint32_t __attribute__((vector_size(64)));
        const uint16_t* row = static_cast<const uint16_t*>(data) + index * dim;
        for (int64_t d = 0; d < dim; d += 16) {
            Halves halves;
            std::memcpy(&halves, row + d, sizeof(halves));
            const Words words = __builtin_convertvector(halves, Words) << 16;
            std::memcpy(out + d, &words, sizeof(words));
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
        constexpr int64_t half = group / 2;
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

using Floats = qrun_floats;

// Row `index` of a cache as dim / 16 vectors of floats, converted in registers where the kind allows (AVX512; int4
// where a group's halves are whole vectors), else through load_row.
template <int kind, int64_t dim>
inline void row_vectors(const void* data, int64_t index, const _Float16* scales, Floats* out) {
    constexpr int64_t vectors = dim / 16, group = group_size<kind, dim>();
#if defined(__AVX512F__)
    if constexpr (kind == BF16 || kind == F16) {
        const __m256i* row = reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(data) + index * dim);
        for (int64_t v = 0; v < vectors; v++) {
            const __m256i halves = _mm256_loadu_si256(row + v);
            if constexpr (kind == BF16)  // bfloat16 bits are a float's upper half
                out[v] = Floats(_mm512_slli_epi32(_mm512_cvtepu16_epi32(halves), 16));
            else
                out[v] = Floats(_mm512_cvtph_ps(halves));
        }
        return;
    }
    if constexpr (kind == INT8 || (kind == INT4 && group % 32 == 0)) {
        const _Float16* scale_zero = scales + index * (dim / group) * 2;
        for (int64_t v = 0; v < vectors; v++) {
            const int64_t g = v * 16 / group, at = v * 16 % group;
            __m512 values;
            if constexpr (kind == INT8) {
                const auto* row = reinterpret_cast<const __m128i*>(static_cast<const int8_t*>(data) + index * dim);
                values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row + v)));
            } else {  // in each group, byte j holds element j (low nibble) and element j + group / 2
                constexpr int64_t half = group / 2;
                const uint8_t* bytes = static_cast<const uint8_t*>(data) + index * (dim / 2) + g * half + at % half;
                __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes));
                if (at >= half) packed = _mm_srli_epi16(packed, 4);
                values = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(packed, _mm_set1_epi8(15))));
            }
            out[v] = Floats(_mm512_fmadd_ps(values, _mm512_set1_ps(half_to_float(scale_zero + 2 * g)),
                                            _mm512_set1_ps(half_to_float(scale_zero + 2 * g + 1))));
        }
        return;
    }
#endif
    if constexpr (kind == F32) {
        const float* row = static_cast<const float*>(data) + index * dim;
        for (int64_t v = 0; v < vectors; v++) out[v] = qrun_load_floats(row + v * 16);
    } else {
        alignas(64) float row[dim];
        load_row<kind, dim>(data, index, scales, row);
        for (int64_t v = 0; v < vectors; v++) out[v] = qrun_load_floats(row + v * 16);
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

// A work item is a chunk of one decode row's sequence (chunk_tokens), every KV head: its keys and values are read as
// they lie (a token's heads side by side), a long sequence spreads over the threads (each chunk's softmax is merged
// after, as flash-decoding does). Tokens pass LANES at a time; the next LANES tokens' rows are fetched meanwhile
// (blocks are scattered, which the hardware's prefetchers do not follow), the values' by the keys' pass as well as by
// their own, and a chunk's first LANES tokens' before it starts (16 sequences of 380 tokens, cold caches, a 2-core
// Xeon: 518 -> 421 us a layer; fetching the values only in the keys' pass: 720). Each row is converted to floats once,
// in registers, for a pack of up to pack_size() query heads sharing its KV head (their queries or sums in registers
// too).
constexpr int64_t CHUNK = 128, MAX_CHUNK = 512, LANES = 16, UNSPLIT = 96;

// The cores this process may run on (its affinity), read once: what a long sequence's chunks are spread over. Not
// the threads a step runs on now, which the engine lowers while another process holds a core: a sequence's
// attention must not change with them.
inline int64_t attention_cores() {
    static const int64_t cores = std::max(1, omp_get_num_procs());
    return cores;
}

// Tokens a chunk of a length-token sequence holds: the sequence whole up to UNSPLIT tokens (a second thread to wake
// and wait for costs more than it saves: 8 against 13 us at 20 tokens), else halves rounded up to LANES, at most
// CHUNK; a sequence of more than CHUNK tokens a core gets longer chunks, a core's share up to MAX_CHUNK, as each chunk
// costs to start and to merge (one-off probes: C++ steps with this rule against chunks of at most CHUNK, alternating
// in one process on a 2-core Xeon, 4.0 bpw: one row of 300 tokens 1.02x, of 1,300 1.08x, of 2,048 1.09x; 16 rows of
// 300 1.04x, 4 of 1,000 1.09x, 32 of 500 1.06x; dense: one row of 2,048 1.09x, 32 of 500 1.05x). Where that leaves
// more chunks than cores their count is rounded up to a multiple of the cores, so a sequence alone spreads evenly
// (1,300 tokens as 512 + 512 + 276 on two cores ran 0.99x; now 4 x 336). So a sequence of 200 tokens is 112 + 88, not
// 128 + 72, for the two threads of a single stream (its chunks' sums merged in another order: the same attention to
// float32's rounding). It depends on the length and the process's cores alone, so a sequence's attention is the same
// whatever else the batch holds, and whatever threads the step runs on.
inline int64_t chunk_tokens(int64_t length) {
    if (length <= UNSPLIT) return std::max<int64_t>(length, 1);
    const auto round_up = [](int64_t n, int64_t to) { return (n + to - 1) / to * to; };
    const int64_t cores = attention_cores(), half = (length + 1) / 2;
    const int64_t most = std::min(std::clamp((length + cores - 1) / cores, CHUNK, MAX_CHUNK), half);
    int64_t chunks = (length + most - 1) / most;
    if (chunks > cores) chunks = round_up(chunks, cores);
    return round_up((length + chunks - 1) / chunks, LANES);
}

// Whether a decode pass reads a row of the kind as decode_row_vectors's unpacks (floats in unpacked_dim's order).
template <int kind, int64_t dim>
constexpr bool unpacked_rows() {
#if defined(__AVX512BW__)  // the 16-bit unpacks
    return kind == BF16 && dim % 32 == 0;
#else
    return false;
#endif
}

// The row element in lane `lane` of decode_row_vectors's vector `v` where the kind's rows are unpacked: each 32
// bfloat16 values give two vectors, their 128-bit lanes' low four and high four words.
constexpr int64_t unpacked_dim(int64_t v, int64_t lane) { return v / 2 * 32 + lane / 4 * 8 + v % 2 * 4 + lane % 4; }

// Row `index` of a cache as dim / 16 vectors of floats for a decode pass. bfloat16 rows are unpacked beside a zero word
// (the float's bits, in unpacked_dim's order): two unpacks per 32 values, where row_vectors widens each 16 with a load
// and then shifts them, a vector operation beside the passes' FMAs. One row of 96 or 2,000 tokens in the caches, one
// thread: 1.11-1.14x with fused_multiply_add's chains; C++ steps of the 4.0-bpw model 1.01x at one row of 200 tokens,
// 1.03x at one of 2,048, 1.05x at 16 rows of 500 (one-off probes, the old path alternating in one process).
template <int kind, int64_t dim>
inline void decode_row_vectors(const void* data, int64_t index, const _Float16* scales, Floats* out) {
#if defined(__AVX512BW__)
    if constexpr (unpacked_rows<kind, dim>()) {
        const __m512i* row = reinterpret_cast<const __m512i*>(static_cast<const uint16_t*>(data) + index * dim);
        for (int64_t v = 0; v < dim / 32; v++) {
            const __m512i words = _mm512_loadu_si512(row + v);
            out[2 * v] = Floats(_mm512_unpacklo_epi16(_mm512_setzero_si512(), words));
            out[2 * v + 1] = Floats(_mm512_unpackhi_epi16(_mm512_setzero_si512(), words));
        }
        return;
    }
#endif
    row_vectors<kind, dim>(data, index, scales, out);
}

// `rows` rows of dim floats put into decode_row_vectors's order (to_decode), times factor, or taken back out of it:
// the queries once a chunk, the values' weighted sums once the chunk is done.
template <int kind, int64_t dim, bool to_decode>
void reorder_rows(const float* in, float* out, int64_t rows, float factor) {
#if defined(__AVX512F__)
    if constexpr (unpacked_rows<kind, dim>()) {
        // per 32 floats, as indices into the pair of vectors they are: where each output lane's float comes from
        alignas(64) static const std::array<std::array<int32_t, 32>, 2> from = [] {
            std::array<std::array<int32_t, 32>, 2> indices{};
            for (int32_t i = 0; i < 32; i++) {
                const int32_t unpacked = int32_t(unpacked_dim(i / LANES, i % LANES));
                indices[0][i] = unpacked;  // decode order from rows
                indices[1][unpacked] = i;  // rows from decode order
            }
            return indices;
        }();
        const int32_t* indices = from[to_decode ? 0 : 1].data();
        const __m512i low = _mm512_load_si512(indices), high = _mm512_load_si512(indices + 16);
        const __m512 scale = _mm512_set1_ps(factor);
        for (int64_t at = 0; at < rows * dim; at += 32) {
            const __m512 a = _mm512_loadu_ps(in + at), b = _mm512_loadu_ps(in + at + 16);
            _mm512_storeu_ps(out + at, _mm512_mul_ps(_mm512_permutex2var_ps(a, low, b), scale));
            _mm512_storeu_ps(out + at + 16, _mm512_mul_ps(_mm512_permutex2var_ps(a, high, b), scale));
        }
        return;
    }
#endif
    for (int64_t i = 0; i < rows * dim; i++) out[i] = in[i] * factor;
}

template <int64_t dim>
constexpr int64_t pack_size() {  // the pack's vectors (pack_size * dim / 16) fit in half the registers
#if defined(__AVX512F__)
    return std::max<int64_t>(1, 256 / dim);  // 32 of 16 floats
#else
    return std::max<int64_t>(1, 64 / dim);  // 16 of 8 floats (AVX2)
#endif
}

// Fetch rows [index, index + count) of a cache into cache: L1 (locality 3) or L2 (2), as __builtin_prefetch's.
template <int kind, int64_t dim, int locality = 3>
inline void prefetch_rows(const void* data, int64_t index, int64_t count, const _Float16* scales) {
    constexpr int64_t bytes = kind == F32 ? 4 * dim : kind == INT8 ? dim : kind == INT4 ? dim / 2 : 2 * dim;
    const char* rows = static_cast<const char*>(data) + index * bytes;
    for (int64_t at = 0; at < count * bytes; at += 64) __builtin_prefetch(rows + at, 0, locality);
    if constexpr (kind == INT8 || kind == INT4) {
        constexpr int64_t scale_bytes = dim / group_size<kind, dim>() * 2 * sizeof(_Float16);
        const char* scale_rows = reinterpret_cast<const char*>(scales) + index * scale_bytes;
        for (int64_t at = 0; at < count * scale_bytes; at += 64) __builtin_prefetch(scale_rows + at, 0, locality);
    }
}

// out[t] = sum of parts[t][0..LANES) for LANES rows of LANES partial sums (one dot product's lanes per row).
inline void sum_lanes(const float* parts, float* out) {
#if defined(__AVX512F__)
    __m512 v[16];
    for (int t = 0; t < 16; t++) v[t] = _mm512_loadu_ps(parts + t * 16);
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++)  // per 128-bit lane: [a0 + a2, b0 + b2, a1 + a3, b1 + b3]
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int j = 0; j < 4; j++)  // per 128-bit lane: the lane's sums of rows 4j .. 4j + 3
        quads[j] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(pairs[2 * j], pairs[2 * j + 1], _MM_SHUFFLE(3, 2, 3, 2)));
    const auto halves = [](__m512 a, __m512 b) {
        return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    };
    const __m512 low = halves(quads[0], quads[1]), high = halves(quads[2], quads[3]);
    _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(2, 0, 2, 0)),
                                        _mm512_shuffle_f32x4(low, high, _MM_SHUFFLE(3, 1, 3, 1))));
#elif defined(__AVX2__)
    for (int half = 0; half < 2; half++) {  // rows 8 half .. 8 half + 7
        __m256 c[8];
        for (int t = 0; t < 8; t++) {
            const float* row = parts + (8 * half + t) * 16;
            c[t] = _mm256_add_ps(_mm256_loadu_ps(row), _mm256_loadu_ps(row + 8));
        }
        // per 128-bit lane: the sums of that lane's four columns of rows 0-3 (first) and 4-7 (second)
        const __m256 first = _mm256_hadd_ps(_mm256_hadd_ps(c[0], c[1]), _mm256_hadd_ps(c[2], c[3]));
        const __m256 second = _mm256_hadd_ps(_mm256_hadd_ps(c[4], c[5]), _mm256_hadd_ps(c[6], c[7]));
        _mm256_storeu_ps(out + 8 * half, _mm256_add_ps(_mm256_permute2f128_ps(first, second, 0x20),
                                                       _mm256_permute2f128_ps(first, second, 0x31)));
    }
#else
    for (int t = 0; t < LANES; t++) {
        float sum = 0.f;
        for (int i = 0; i < LANES; i++) sum += parts[t * LANES + i];
        out[t] = sum;
    }
#endif
}

// One chunk's attention for each query head: the maximum score, the sum of e^(score - maximum) and the values
// weighted by those, for decode_attention to merge across chunks.
struct Partial {
    float* top;  // [num_q_heads]
    float* sum;  // [num_q_heads]
    float* acc;  // [num_q_heads, dim]
};

// The LANES tokens of a chunk from token t0 (count of them real) as rows of one cache, and the first of a pack of
// query heads that share KV head `kv_head` (the pack's size is the functions' `heads`).
struct Pass {
    const void* cache;
    const _Float16* scales;
    const int64_t* slots;  // [count]
    int64_t count, kv_heads, kv_head, first;
};

// a * b + c as one FMA a lane, in this order: -fassociative-math would rather split a dot product's chain of them
// into two chains and an add, one more floating-point instruction beside them.
inline Floats fused_multiply_add(Floats a, Floats b, Floats c) {
#if defined(__AVX512F__)
    return Floats(_mm512_fmadd_ps(__m512(a), __m512(b), __m512(c)));
#else
    return a * b + c;
#endif
}

// floats' e^x lanewise (x <= 0), as qrun_exp_nonpositive
inline Floats exp_nonpositive(Floats x) {
#if defined(__AVX512F__)
    return Floats(qrun_exp_nonpositive16(__m512(x)));
#elif defined(__AVX2__) && defined(__FMA__)
    return {Floats::Half(qrun_exp_nonpositive8(__m256(x.lo))), Floats::Half(qrun_exp_nonpositive8(__m256(x.hi)))};
#else
    for (int64_t i = 0; i < LANES; i++) x[i] = qrun_exp_nonpositive(x[i]);
    return x;
#endif
}

// The sum of x's lanes.
inline float sum_of_lanes(Floats x) {
#if defined(__AVX512F__)
    return _mm512_reduce_add_ps(__m512(x));
#else
    float sum = 0.f;
    for (int64_t i = 0; i < LANES; i++) sum += x[i];
    return sum;
#endif
}

// scores[j][t] = queries[j] . row t for the pack's heads j (rows of `scores` MAX_CHUNK + LANES apart); -FLT_MAX past
// count.
template <int kind, int64_t dim, int64_t heads>
void score_pack(const Pass& pass, const float* queries, float* scores) {
    constexpr int64_t vectors = dim / LANES;
    Floats q[heads][vectors];
    for (int64_t j = 0; j < heads; j++)
        for (int64_t v = 0; v < vectors; v++) q[j][v] = qrun_load_floats(queries + (pass.first + j) * dim + v * LANES);
    alignas(64) Floats parts[heads][LANES];
    for (int64_t t = 0; t < LANES; t++) {
        Floats row[vectors] = {};
        if (t < pass.count)
            decode_row_vectors<kind, dim>(pass.cache, pass.slots[t] * pass.kv_heads + pass.kv_head, pass.scales, row);
        for (int64_t j = 0; j < heads; j++) {
            Floats lanes = q[j][0] * row[0];
            for (int64_t v = 1; v < vectors; v++) lanes = fused_multiply_add(q[j][v], row[v], lanes);
            parts[j][t] = lanes;
        }
    }
    for (int64_t j = 0; j < heads; j++) {
        float* out = scores + (pass.first + j) * (MAX_CHUNK + LANES);
        sum_lanes(reinterpret_cast<const float*>(parts[j]), out);
        for (int64_t t = pass.count; t < LANES; t++) out[t] = -FLT_MAX;
    }
}

// sums[j] += sum over t of weights[j][t] * row t for the pack's heads j (weights: rows MAX_CHUNK + LANES apart).
template <int kind, int64_t dim, int64_t heads>
void accumulate_pack(const Pass& pass, const float* weights, float* sums) {
    constexpr int64_t vectors = dim / LANES;
    Floats acc[heads][vectors];
    for (int64_t j = 0; j < heads; j++)
        for (int64_t v = 0; v < vectors; v++) acc[j][v] = qrun_load_floats(sums + (pass.first + j) * dim + v * LANES);
    for (int64_t t = 0; t < pass.count; t++) {
        Floats row[vectors];
        decode_row_vectors<kind, dim>(pass.cache, pass.slots[t] * pass.kv_heads + pass.kv_head, pass.scales, row);
        for (int64_t j = 0; j < heads; j++) {
            const Floats weight = Floats{} + weights[(pass.first + j) * (MAX_CHUNK + LANES) + t];
            for (int64_t v = 0; v < vectors; v++) acc[j][v] += weight * row[v];
        }
    }
    for (int64_t j = 0; j < heads; j++)
        for (int64_t v = 0; v < vectors; v++) qrun_store_floats(sums + (pass.first + j) * dim + v * LANES, acc[j][v]);
}

// f(std::integral_constant<int64_t, heads>) for a runtime heads in 1 .. most: the pack functions' instantiations.
template <int64_t most, typename F>
void with_heads(int64_t heads, const F& f) {
    if constexpr (most > 1)
        if (heads < most) return with_heads<most - 1>(heads, f);
    f(std::integral_constant<int64_t, most>{});
}

// Tokens [begin, end) of a sequence (its block table: table) for every query head; queries scaled. scores: [heads]
// rows of MAX_CHUNK + LANES.
template <int kind, int64_t dim>
void attend_chunk(const Step& step, const float* queries, const int32_t* table, int64_t begin, int64_t end,
                  float* scores, const Partial& partial, bool fetch_up_front) {
    const int64_t block_mask = (int64_t(1) << step.block_shift) - 1, kv_heads = step.num_kv_heads;
    const int64_t heads = step.num_q_heads, heads_per_kv = heads / kv_heads, length = end - begin;
    const auto slot_of = [&](int64_t t) {
        t += begin;
        return (int64_t(table[t >> step.block_shift]) << step.block_shift) + (t & block_mask);
    };
    // the query heads sharing a KV head, in packs of at most pack_size as equal as can be (3 as one pack, 8 as 4 + 4)
    const int64_t packs = (heads_per_kv + pack_size<dim>() - 1) / pack_size<dim>();
    const auto pack_heads = [&](int64_t p) { return heads_per_kv / packs + (p < heads_per_kv % packs); };
    // Where each thread attends one chunk (fetch_up_front), every key and value row of it toward L2 before the keys'
    // pass, which fetches them into L1 LANES tokens ahead: in a decode step the rows are cold (the layers' weights have
    // streamed through every cache since), and so many fetches at once keep the memory busy (one row, 9 heads over 3
    // KV heads, cold caches, a 2-core EPYC: 200 tokens 28-30 -> 19 us, 400 tokens 39-57 -> 27-48). With more chunks
    // than threads the burst only queues behind the hardware's own fetches of the chunk before (30 layers' cold
    // caches, a 2-core Xeon, variants alternating in one process: 1 row of 1,000 tokens, 4 of 300, 32 of 300 and 16
    // of 150 1.03-1.07x faster without it; 1 row of 100 and of 300, one chunk a thread, 0.82-0.85x).
    for (int64_t t = 0; t < length && fetch_up_front; t++) {
        prefetch_rows<kind, dim, 2>(step.k_cache, slot_of(t) * kv_heads, kv_heads, step.k_scales);
        prefetch_rows<kind, dim, 2>(step.v_cache, slot_of(t) * kv_heads, kv_heads, step.v_scales);
    }
    // f(heads, pass, t0) for every LANES tokens from t0, KV head and pack of query heads
    const auto each_pass = [&](const void* cache, const _Float16* scales, const auto& f) {
        int64_t slots[LANES];
        const bool keys = cache == step.k_cache;
        for (int64_t t = 0; t < std::min(LANES, length) && keys; t++) {
            prefetch_rows<kind, dim>(cache, slot_of(t) * kv_heads, kv_heads, scales);
            prefetch_rows<kind, dim>(step.v_cache, slot_of(t) * kv_heads, kv_heads, step.v_scales);
        }
        for (int64_t t0 = 0; t0 < length; t0 += LANES) {
            const int64_t count = std::min(LANES, length - t0);
            for (int64_t t = 0; t < count; t++) slots[t] = slot_of(t0 + t);
            for (int64_t t = t0 + LANES; t < std::min(t0 + 2 * LANES, length); t++) {
                prefetch_rows<kind, dim>(cache, slot_of(t) * kv_heads, kv_heads, scales);
                if (keys) prefetch_rows<kind, dim>(step.v_cache, slot_of(t) * kv_heads, kv_heads, step.v_scales);
            }
            for (int64_t kv_head = 0; kv_head < kv_heads; kv_head++)
                for (int64_t p = 0, first = kv_head * heads_per_kv; p < packs; first += pack_heads(p), p++)
                    with_heads<pack_size<dim>()>(pack_heads(p), [&](auto heads) {
                        f(heads, Pass{cache, scales, slots, count, kv_heads, kv_head, first}, t0);
                    });
        }
    };
    each_pass(step.k_cache, step.k_scales, [&]<typename Heads>(Heads, const Pass& pass, int64_t t0) {
        score_pack<kind, dim, Heads::value>(pass, queries, scores + t0);
    });
    const int64_t padded = (length + LANES - 1) / LANES * LANES;  // score_pack wrote -FLT_MAX past length
    for (int64_t head = 0; head < heads; head++) {
        float* s = scores + head * (MAX_CHUNK + LANES);
        Floats tops = Floats{} - FLT_MAX;
        for (int64_t t = 0; t < padded; t += LANES) {
            const Floats values = qrun_load_floats(s + t);
            tops = qrun_select(values > tops, values, tops);
        }
        float top = -FLT_MAX;
        for (int64_t i = 0; i < LANES; i++) top = std::max(top, tops[i]);
        // 16 scores at a time (the padding's -FLT_MAX gives 0)
        Floats sums = Floats{};
        for (int64_t t = 0; t < padded; t += LANES) {
            const Floats weights = exp_nonpositive(qrun_load_floats(s + t) - top);
            qrun_store_floats(s + t, weights);
            sums += weights;
        }
        const float sum = sum_of_lanes(sums);
        partial.top[head] = top;
        partial.sum[head] = sum;
    }
    std::fill_n(partial.acc, heads * dim, 0.f);
    each_pass(step.v_cache, step.v_scales, [&]<typename Heads>(Heads, const Pass& pass, int64_t t0) {
        accumulate_pack<kind, dim, Heads::value>(pass, scores + t0, partial.acc);
    });
    if constexpr (unpacked_rows<kind, dim>()) reorder_rows<kind, dim, false>(partial.acc, partial.acc, heads, 1.f);
}

// Every decode row of the step; prefill rows (query length > 1) are left to the caller.
template <int kind, int64_t dim>
void decode_attention(const Step& step) {
    const int64_t heads = step.num_q_heads;
    // work items: (decode row's sequence, chunk of its tokens); chunk_start[i]: sequence i's first chunk. Buffers the
    // calling thread keeps between calls: a decode step at batch 1 makes 30 of them. The threads sharing the work
    // reach the caller's through pointers to them (a thread_local name is each thread's own).
    thread_local std::vector<int64_t> kept_chunk_start;
    thread_local std::vector<float> kept_partials;
    std::vector<int64_t>& chunk_start = kept_chunk_start;
    std::vector<float>& partials = kept_partials;
    chunk_start.assign(step.num_seqs + 1, 0);
    for (int64_t seq = 0; seq < step.num_seqs; seq++) {
        const bool decodes = step.query_start_loc[seq + 1] - step.query_start_loc[seq] == 1;
        const int64_t length = step.seq_lens[seq], tokens = chunk_tokens(length);
        chunk_start[seq + 1] = chunk_start[seq] + (decodes ? (length + tokens - 1) / tokens : 0);
    }
    const int64_t chunks = chunk_start[step.num_seqs], per_chunk = heads * (dim + 2);
    partials.resize(chunks * per_chunk);  // per chunk: top[heads], sum[heads], acc[heads, dim], all written
    const auto partial_of = [at = partials.data(), per_chunk, heads](int64_t chunk) {
        float* first = at + chunk * per_chunk;
        return Partial{first, first + heads, first + 2 * heads};
    };
    // the chunks taken one at a time by the threads that attend (the chunks of a long sequence and a short one differ),
    // each thread with query and score buffers it keeps; by value what each reads again and again (QrunTeam::run says
    // why)
    std::atomic<int64_t> next_chunk{0};
    const bool fetch_up_front = chunks <= step.threads;  // one chunk a thread (attend_chunk says why)
    const auto attend = [&next_chunk, step, heads, chunks, fetch_up_front, partial_of, starts = chunk_start.data(),
                         ends = chunk_start.data() + chunk_start.size()](int, int) {
        thread_local std::vector<float> queries, scores;
        queries.resize(heads * dim);
        scores.resize(heads * (MAX_CHUNK + LANES));
        for (int64_t chunk; (chunk = next_chunk.fetch_add(1, std::memory_order_relaxed)) < chunks;) {
            const int64_t* after = std::upper_bound(starts, ends, chunk);
            const int64_t seq = after - starts - 1;
            const int64_t tokens = chunk_tokens(step.seq_lens[seq]), begin = (chunk - starts[seq]) * tokens;
            const float* q = step.q + step.query_start_loc[seq] * heads * dim;
            reorder_rows<kind, dim, true>(q, queries.data(), heads, step.scale);
            attend_chunk<kind, dim>(step, queries.data(), step.block_tables + seq * step.table_width, begin,
                                    std::min<int64_t>(begin + tokens, step.seq_lens[seq]), scores.data(),
                                    partial_of(chunk), fetch_up_front);
        }
    };
    // one chunk (a short context at batch 1) on the calling thread, without a region (qrun_parallel_for says why)
    if (chunks > 1)
        qrun_parallel(int(std::min<int64_t>(chunks, step.threads)), attend);
    else
        attend(0, 1);
    // each decode row's heads: its chunks merged, in chunk order
    qrun_parallel_for(step.num_seqs * heads, step.threads, chunks * heads * dim >= (1 << 14), [&](int64_t item) {
        const int64_t seq = item / heads, head = item % heads;
        const int64_t first = chunk_start[seq], last = chunk_start[seq + 1];
        if (first == last) return;  // a prefill chunk: not this kernel's
        float top = -FLT_MAX;
        for (int64_t c = first; c < last; c++) top = std::max(top, partial_of(c).top[head]);
        float sum = 0.f, out[dim] = {};
        for (int64_t c = first; c < last; c++) {
            const Partial part = partial_of(c);
            const float weight = last - first == 1 ? 1.f : std::exp(part.top[head] - top);
            sum += weight * part.sum[head];
            for (int64_t d = 0; d < dim; d++) out[d] += weight * part.acc[head * dim + d];
        }
        float* row_out = step.out + (step.query_start_loc[seq] * heads + head) * dim;
        for (int64_t d = 0; d < dim; d++) row_out[d] = out[d] / sum;
    });
}

// Prefill chunks: rows whose sequence has more than one query this step. Unlike a decode row, a chunk's many queries
// share every key and value they read, so the work is a matrix product: lanes hold 16 query vectors (rows x the query
// heads of one KV head) rather than 16 tokens, and every score, softmax step and weighted sum is a lanewise FMA with
// a key's or value's element broadcast; no horizontal sums and no transposes of the cache (only of the queries, once
// per item). A work item is up to item_lane_groups() x 16 query vectors: rows_per_item rows of one chunk, one KV
// head. Keys pass KEYS at a time from the sequence's first, each read once per item (a tile: FloatTile, BfloatTile,
// AmxTile); each query vector's softmax is online over them (flash attention). So a query's result depends on its
// position and the cache alone, never on how its prompt was cut into chunks or items: chunked prefill attends exactly
// as a whole prompt does.
constexpr int64_t KEYS = 16;

template <int64_t dim>
constexpr int64_t item_lane_groups() {  // the item's queries, sums and K/V tile stay within L1 (~32 KB at dim 64)
    return std::max<int64_t>(1, 192 / dim);
}

struct PrefillItem {
    int64_t seq, kv_head, first_row, rows;
};

// Each query vector's weighted sum of values so far, its elements as lanes (sums[d], lane j: query vector j).
template <int64_t dim>
struct LaneSums : std::array<Floats, dim> {
    void clear() { this->fill(Floats{}); }
    float element(int64_t lane, int64_t d) const { return (*this)[d][lane]; }
};

// A tile of KEYS keys and values as the float path multiplies them: rows converted to floats once per item, their
// elements broadcast against query vectors in lanes (queries: [dim] vectors, lane j = query vector j).
template <int kind, int64_t dim>
struct FloatTile {
    using Queries = const Floats*;
    using Sums = LaneSums<dim>;
    alignas(64) Floats keys[KEYS][dim / LANES], values[KEYS][dim / LANES];

    static Queries prepare(const Floats* queries) { return queries; }
    static void begin() {}
    static void end() {}

    // rows[t]: the cache row of key t (count of them; the rest pad as zeros)
    void load(const Step& step, const int64_t* rows, int64_t count) {
        for (int64_t t = 0; t < KEYS; t++) {
            if (t < count) {
                row_vectors<kind, dim>(step.k_cache, rows[t], step.k_scales, keys[t]);
                row_vectors<kind, dim>(step.v_cache, rows[t], step.v_scales, values[t]);
            } else {
                std::fill_n(keys[t], dim / LANES, Floats{});
            }
        }
    }

    // scores[t] = the queries' dot products with key t
    void score(Queries queries, Floats* scores) const {
        const float* key_values = reinterpret_cast<const float*>(keys);
        for (int64_t t = 0; t < KEYS; t++) scores[t] = Floats{};
        for (int64_t d = 0; d < dim; d++) {
            const Floats q = queries[d];
            for (int64_t t = 0; t < KEYS; t++) scores[t] += q * key_values[t * dim + d];
        }
    }

    // sums[d] = sums[d] * rescale + sum over t < here of weights[t] * value t's element d
    void accumulate(const Floats* weights, int64_t here, Floats rescale, Sums& sums) const {
        const float* value_values = reinterpret_cast<const float*>(values);
        for (int64_t d0 = 0; d0 < dim; d0 += LANES) {
            Floats acc[LANES];
            for (int64_t i = 0; i < LANES; i++) acc[i] = sums[d0 + i] * rescale;
            for (int64_t t = 0; t < here; t++) {
                const Floats weight = weights[t];
                for (int64_t i = 0; i < LANES; i++) acc[i] += weight * value_values[t * dim + d0 + i];
            }
            for (int64_t i = 0; i < LANES; i++) sums[d0 + i] = acc[i];
        }
    }
};

#if defined(__AVX512BF16__)
// A bfloat16 cache's tile multiplied two products an instruction (vdpbf16ps), at half the float path's instructions:
// queries and the softmax weights rounded to bfloat16 (as a GPU's flash attention multiplies them), keys read where
// they lie (a pair of a row's elements broadcast against the queries' pairs), values interleaved two tokens a pair.
template <int64_t dim>
struct BfloatTile {
    using Queries = std::array<__m512bh, dim / 2>;  // lane j: query vector j's elements 2p, 2p + 1
    using Sums = LaneSums<dim>;
    const uint32_t* keys[KEYS];  // each key's row: dim / 2 pairs
    alignas(64) uint32_t value_pairs[KEYS / 2][dim];  // [t / 2][d]: value t's element d, value t + 1's above it
    alignas(64) uint16_t zeros[dim] = {};

    // 16 lanes of (a, b) as bfloat16 pairs, a in the low half
    static __m512bh pairs(__m512 a, __m512 b) {
        const __m512i both = __m512i(_mm512_cvtne2ps_pbh(b, a));  // a's 16 values, then b's
        const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                               22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
        return __m512bh(_mm512_permutexvar_epi16(order, both));
    }

    static void begin() {}
    static void end() {}

    static Queries prepare(const Floats* queries) {
        Queries prepared;
        for (int64_t p = 0; p < dim / 2; p++) prepared[p] = pairs(__m512(queries[2 * p]), __m512(queries[2 * p + 1]));
        return prepared;
    }

    // FloatTile::load's contract; keys past count read zeros, and so do values
    void load(const Step& step, const int64_t* rows, int64_t count) {
        const auto row_of = [&](const void* cache, int64_t t) {
            return t < count ? static_cast<const uint16_t*>(cache) + rows[t] * dim : zeros;
        };
        const __m512i low = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38,
                                             6, 37, 5, 36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
        const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
        for (int64_t t = 0; t < KEYS; t += 2) {
            keys[t] = reinterpret_cast<const uint32_t*>(row_of(step.k_cache, t));
            keys[t + 1] = reinterpret_cast<const uint32_t*>(row_of(step.k_cache, t + 1));
            const uint16_t *first = row_of(step.v_cache, t), *second = row_of(step.v_cache, t + 1);
            for (int64_t d = 0; d < dim; d += 32) {  // 32 elements of each row: 32 pairs
                const __m512i a = _mm512_loadu_si512(first + d), b = _mm512_loadu_si512(second + d);
                _mm512_store_si512(value_pairs[t / 2] + d, _mm512_permutex2var_epi16(a, low, b));
                _mm512_store_si512(value_pairs[t / 2] + d + 16, _mm512_permutex2var_epi16(a, high, b));
            }
        }
    }

    // FloatTile::score's, in pairs of elements
    void score(const Queries& queries, Floats* scores) const {
        __m512 acc[KEYS];
        for (int64_t t = 0; t < KEYS; t++) acc[t] = _mm512_setzero_ps();
        for (int64_t p = 0; p < dim / 2; p++)
            for (int64_t t = 0; t < KEYS; t++)
                acc[t] = _mm512_dpbf16_ps(acc[t], queries[p], __m512bh(_mm512_set1_epi32(int(keys[t][p]))));
        for (int64_t t = 0; t < KEYS; t++) scores[t] = Floats(acc[t]);
    }

    // FloatTile::accumulate's, in pairs of tokens
    void accumulate(const Floats* weights, int64_t here, Floats rescale, Sums& sums) const {
        __m512bh weight_pairs[KEYS / 2];
        for (int64_t t = 0; t < here; t += 2) {  // an odd last weight pairs with a zero weight
            const __m512 next = t + 1 < here ? __m512(weights[t + 1]) : _mm512_setzero_ps();
            weight_pairs[t / 2] = pairs(__m512(weights[t]), next);
        }
        for (int64_t d0 = 0; d0 < dim; d0 += LANES) {
            __m512 acc[LANES];
            for (int64_t i = 0; i < LANES; i++) acc[i] = __m512(sums[d0 + i] * rescale);
            for (int64_t t = 0; t < here; t += 2)
                for (int64_t i = 0; i < LANES; i++)
                    acc[i] = _mm512_dpbf16_ps(acc[i], weight_pairs[t / 2],
                                              __m512bh(_mm512_set1_epi32(int(value_pairs[t / 2][d0 + i]))));
            for (int64_t i = 0; i < LANES; i++) sums[d0 + i] = Floats(acc[i]);
        }
    }
};
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define QRUN_ATTENTION_AMX 1

// v[c] = column c of the 16 x 16 dwords whose row r is v[r].
inline void transpose16(__m512i v[16]) {
    __m512i t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(v[i], v[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(v[i], v[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // v[i + j], 128-bit lane L: column 4L + j of rows i .. i + 3
        v[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        v[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        v[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        v[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i x0 = _mm512_shuffle_i32x4(v[j], v[4 + j], 0x44), x1 = _mm512_shuffle_i32x4(v[j], v[4 + j], 0xEE);
        const __m512i x2 = _mm512_shuffle_i32x4(v[8 + j], v[12 + j], 0x44);
        const __m512i x3 = _mm512_shuffle_i32x4(v[8 + j], v[12 + j], 0xEE);
        t[j] = _mm512_shuffle_i32x4(x0, x2, 0x88);
        t[4 + j] = _mm512_shuffle_i32x4(x0, x2, 0xDD);
        t[8 + j] = _mm512_shuffle_i32x4(x1, x3, 0x88);
        t[12 + j] = _mm512_shuffle_i32x4(x1, x3, 0xDD);
    }
    std::copy_n(t, 16, v);
}

// Each query vector's weighted sum of values so far as a row of its own, as the tile unit's sums come out.
template <int64_t dim>
struct RowSums {
    alignas(64) float rows[LANES][dim];

    void clear() { std::fill_n(&rows[0][0], LANES * dim, 0.f); }
    float element(int64_t lane, int64_t d) const { return rows[lane][d]; }
};

// BfloatTile's products on the AMX tile unit (tdpbf16ps), with its roundings (queries and softmax weights in
// bfloat16, every sum in float32): the scores of KEYS keys against 16 query vectors come out a key a row, as the lanes
// want them (keys x queries, one product per 32 elements of head_dim, the keys read where they lie where a tile's
// keys are one block's); the weighted values (queries x elements, one product per 16 elements) are summed into the
// query vectors' rows (RowSums), rescaled in memory between tiles where the maximum moved.
template <int64_t dim>
struct AmxTile {
    using Queries = typename BfloatTile<dim>::Queries;  // pairs of elements a row: the scores' second operand
    using Sums = RowSums<dim>;
    static_assert(dim % 32 == 0 && KEYS == 16, "tiles of 16 keys, head_dim in 32-element blocks");

    BfloatTile<dim> loaded;  // the tile's key rows where they lie, its values in pairs of tokens
    const uint16_t* keys;  // key t's row at keys + t * key_stride elements: the scores' first operand
    int64_t key_stride;
    alignas(64) uint16_t copied_keys[KEYS][dim];  // where the tile's keys are not evenly spaced in the cache

    // Tiles: 0 the scores (keys x queries, float32), 1 keys (x 32 elements), 2 queries' pairs; 3 sums (queries x 16
    // elements, float32), 4 weights (queries x keys, bfloat16), 5 values' pairs of tokens (x 16 elements).
    static void begin() {
        QrunTileConfig config;
        for (int tile = 0; tile < 6; tile++) {
            config.rows[tile] = tile == 5 ? KEYS / 2 : 16;
            config.bytes_per_row[tile] = tile == 4 ? KEYS * 2 : 64;
        }
        _tile_loadconfig(&config);
    }
    static void end() { _tile_release(); }

    static Queries prepare(const Floats* queries) { return BfloatTile<dim>::prepare(queries); }

    // FloatTile::load's contract; keys past count read zeros, and so do values
    void load(const Step& step, const int64_t* rows, int64_t count) {
        loaded.load(step, rows, count);
        const auto row = [&](int64_t t) { return reinterpret_cast<const uint16_t*>(loaded.keys[t]); };
        keys = row(0);
        key_stride = step.num_kv_heads * dim;
        bool even = count == KEYS;
        for (int64_t t = 1; t < KEYS && even; t++) even = row(t) == keys + t * key_stride;
        if (even) return;
        for (int64_t t = 0; t < KEYS; t++) std::copy_n(row(t), dim, copied_keys[t]);
        keys = &copied_keys[0][0];
        key_stride = dim;
    }

    // FloatTile::score's: scores[t], lane j = key t . query vector j
    void score(const Queries& queries, Floats* scores) const {
        _tile_zero(0);
        for (int64_t block = 0; block < dim / 32; block++) {
            _tile_loadd(1, keys + block * 32, key_stride * 2);
            _tile_loadd(2, &queries[block * 16], 64);
            _tile_dpbf16ps(0, 1, 2);
        }
        _tile_stored(0, scores, 64);
    }

    // FloatTile::accumulate's, on rows of sums
    void accumulate(const Floats* weights, int64_t here, Floats rescale, Sums& sums) const {
        if (_mm512_cmp_ps_mask(__m512(rescale), _mm512_set1_ps(1.f), _CMP_NEQ_UQ)) {
            alignas(64) float factors[LANES];
            _mm512_store_ps(factors, __m512(rescale));
            for (int64_t j = 0; j < LANES; j++)
                for (int64_t d = 0; d < dim; d += 16)
                    _mm512_store_ps(sums.rows[j] + d,
                                    _mm512_mul_ps(_mm512_load_ps(sums.rows[j] + d), _mm512_set1_ps(factors[j])));
        }
        __m512i columns[KEYS];  // weights a key a row, then a query a row
        for (int64_t t = 0; t < KEYS; t++)
            columns[t] = t < here ? _mm512_castps_si512(__m512(weights[t])) : _mm512_setzero_si512();
        transpose16(columns);
        alignas(64) uint16_t weight_rows[LANES][KEYS];
        for (int64_t j = 0; j < LANES; j += 2)
            _mm512_store_si512(weight_rows[j], __m512i(_mm512_cvtne2ps_pbh(_mm512_castsi512_ps(columns[j + 1]),
                                                                          _mm512_castsi512_ps(columns[j]))));
        _tile_loadd(4, weight_rows, KEYS * 2);
        for (int64_t d = 0; d < dim; d += 16) {
            _tile_loadd(3, sums.rows[0] + d, dim * 4);
            _tile_loadd(5, &loaded.value_pairs[0][d], dim * 4);
            _tile_dpbf16ps(3, 4, 5);
            _tile_stored(3, sums.rows[0] + d, dim * 4);
        }
    }
};
#endif

// One item: queries [lanes groups][dim] (lanes: query vectors j = row * group + head), their positions (-1: no
// query), into out.
template <typename Tile, int64_t dim>
void attend_prefill_item(const Step& step, const PrefillItem& item) {
    constexpr int64_t groups_most = item_lane_groups<dim>();
    const int64_t heads = step.num_q_heads, kv_heads = step.num_kv_heads, group = heads / kv_heads;
    const int64_t chunk_start = step.query_start_loc[item.seq], length = step.seq_lens[item.seq];
    const int64_t first_position = length - (step.query_start_loc[item.seq + 1] - chunk_start) + item.first_row;
    const int64_t vectors = item.rows * group, lane_groups = (vectors + LANES - 1) / LANES;
    const auto offset_of = [&](int64_t j) {  // query vector j's first element in q and out
        return ((chunk_start + item.first_row + j / group) * heads + item.kv_head * group + j % group) * dim;
    };
    const int32_t* table = step.block_tables + item.seq * step.table_width;
    const int64_t block_mask = (int64_t(1) << step.block_shift) - 1;
    const auto slot_of = [&](int64_t t) {
        return (int64_t(table[t >> step.block_shift]) << step.block_shift) + (t & block_mask);
    };
    alignas(64) Floats queries[groups_most][dim], weights[KEYS];
    typename Tile::Sums sums[groups_most];
    typename Tile::Queries prepared[groups_most];
    Floats positions[groups_most], tops[groups_most], totals[groups_most];
    int64_t last_position[groups_most];
    for (int64_t g = 0; g < lane_groups; g++) {
        for (int64_t lane = 0; lane < LANES; lane++) {
            const int64_t j = g * LANES + lane;
            for (int64_t d = 0; d < dim; d++)
                queries[g][d][lane] = j < vectors ? step.q[offset_of(j) + d] * step.scale : 0.f;
            positions[g][lane] = j < vectors ? float(first_position + j / group) : -1.f;
        }
        prepared[g] = Tile::prepare(queries[g]);
        last_position[g] = first_position + std::min(vectors - 1, (g + 1) * LANES - 1) / group;
        tops[g] = Floats{} - FLT_MAX;
        totals[g] = Floats{};
        sums[g].clear();
    }
    Tile tile;
    const int64_t end = last_position[lane_groups - 1] + 1;
    for (int64_t k0 = 0; k0 < end; k0 += KEYS) {
        const int64_t count = std::min(KEYS, end - k0);
        int64_t rows[KEYS];
        for (int64_t t = 0; t < count; t++) rows[t] = slot_of(k0 + t) * kv_heads + item.kv_head;
        tile.load(step, rows, count);
        for (int64_t g = 0; g < lane_groups; g++) {
            if (k0 > last_position[g]) continue;  // every key of the tile is after this group's queries
            const int64_t here = std::min(count, last_position[g] + 1 - k0);
            Floats scores[KEYS];
            tile.score(prepared[g], scores);
            Floats top = tops[g];
            for (int64_t t = 0; t < KEYS; t++) {  // causal: a lane's query sees the keys up to its own position
                scores[t] = t < here ? qrun_select(positions[g] >= float(k0 + t), scores[t], Floats{} - FLT_MAX)
                                     : Floats{} - FLT_MAX;
                top = qrun_select(scores[t] > top, scores[t], top);
            }
            const Floats rescale = exp_nonpositive(tops[g] - top);
            Floats total = totals[g] * rescale;
            for (int64_t t = 0; t < here; t++) {
                weights[t] = exp_nonpositive(scores[t] - top);
                total += weights[t];
            }
            tops[g] = top;
            totals[g] = total;
            tile.accumulate(weights, here, rescale, sums[g]);
        }
    }
    for (int64_t g = 0; g < lane_groups; g++)
        for (int64_t lane = 0; lane < LANES && g * LANES + lane < vectors; lane++) {
            float* out = step.out + offset_of(g * LANES + lane);
            const float total = totals[g][lane];
            for (int64_t d = 0; d < dim; d++) out[d] = sums[g].element(lane, d) / total;
        }
}

// Items one at a time to whichever thread is free, on the held team where a C++ step holds one (a prefill chunk of
// a few rows beside decode rows), else in an OpenMP region.
template <typename Tile, int64_t dim>
void attend_prefill_items(const Step& step, const std::vector<PrefillItem>& items, int threads) {
    std::atomic<size_t> next{0};
    qrun_parallel(threads, [&](int64_t, int64_t) {
        Tile::begin();
        for (size_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < items.size();)
            attend_prefill_item<Tile, dim>(step, items[i]);
        Tile::end();
    });
}

// Every prefill chunk's rows of the step; decode rows are decode_attention's.
template <int kind, int64_t dim>
void prefill_attention(const Step& step) {
    const int64_t group = step.num_q_heads / step.num_kv_heads;
    const int64_t rows_per_item = std::max<int64_t>(1, item_lane_groups<dim>() * LANES / group);
    thread_local std::vector<PrefillItem> kept_items;
    std::vector<PrefillItem>& items = kept_items;
    items.clear();
    for (int64_t seq = 0; seq < step.num_seqs; seq++) {
        const int64_t rows = step.query_start_loc[seq + 1] - step.query_start_loc[seq];
        if (rows <= 1) continue;
        for (int64_t first = 0; first < rows; first += rows_per_item)
            for (int64_t kv_head = 0; kv_head < step.num_kv_heads; kv_head++)
                items.push_back({seq, kv_head, first, std::min(rows_per_item, rows - first)});
    }
    if (items.empty()) return;
    // the longest first (an item's work grows with its last query's position), so the threads finish together
    const auto work = [&](const PrefillItem& item) {
        return step.seq_lens[item.seq] - (step.query_start_loc[item.seq + 1] - step.query_start_loc[item.seq]) +
               item.first_row + item.rows;
    };
    std::stable_sort(items.begin(), items.end(), [&](const auto& a, const auto& b) { return work(a) > work(b); });
    const int threads = int(std::clamp<int64_t>(int64_t(items.size()), 1, step.threads));
#if defined(__AVX512BF16__)
    if constexpr (kind == BF16 && dim % 32 == 0) {
#if defined(QRUN_ATTENTION_AMX)
        if (qrun_tiles_permitted()) return attend_prefill_items<AmxTile<dim>, dim>(step, items, threads);
#endif
        return attend_prefill_items<BfloatTile<dim>, dim>(step, items, threads);
    }
#endif
    attend_prefill_items<FloatTile<kind, dim>, dim>(step, items, threads);
}

template <int kind, int64_t dim>
int attention_checked(const Step& step, bool prefill_chunks) {
    if ((kind == INT8 || kind == INT4) && step.group != group_size<kind, dim>()) return 3;
    decode_attention<kind, dim>(step);
    if (prefill_chunks) prefill_attention<kind, dim>(step);
    return 0;
}

template <int kind>
int attention_for_dim(const Step& step, int64_t dim, bool prefill_chunks) {
    switch (dim) {
        case 64: return attention_checked<kind, 64>(step, prefill_chunks);
        case 80: return attention_checked<kind, 80>(step, prefill_chunks);
        case 96: return attention_checked<kind, 96>(step, prefill_chunks);
        case 128: return attention_checked<kind, 128>(step, prefill_chunks);
        case 256: return attention_checked<kind, 256>(step, prefill_chunks);
    }
    return 2;
}

}  // namespace

// 0: done; 1: unknown cache kind; 2: a head_dim without an instantiation (the caller checks
// `HEAD_DIMS` in cpu_attention.py first); 3: quantized groups other than kv_group_size's.
// prefill_chunks 0 leaves the rows of sequences with more than one query to the caller.
extern "C" int qrun_paged_attention(int kv_kind, const float* q, float* out, const void* k_cache,
                                    const void* v_cache, const void* k_scales, const void* v_scales,
                                    const int32_t* block_tables, int64_t table_width, const int32_t* seq_lens,
                                    const int32_t* query_start_loc, int64_t num_seqs, int64_t num_q_heads,
                                    int64_t num_kv_heads, int64_t dim, int64_t block_shift, int64_t group,
                                    float scale, int prefill_chunks, int threads) {
    const Step step{q, out, k_cache, v_cache, static_cast<const _Float16*>(k_scales),
                    static_cast<const _Float16*>(v_scales), block_tables, table_width, seq_lens, query_start_loc,
                    num_seqs, num_q_heads, num_kv_heads, block_shift, group, scale, threads};
    const bool prefill = prefill_chunks != 0;
    switch (kv_kind) {
        case F32: return attention_for_dim<F32>(step, dim, prefill);
        case BF16: return attention_for_dim<BF16>(step, dim, prefill);
        case F16: return attention_for_dim<F16>(step, dim, prefill);
        case INT8: return attention_for_dim<INT8>(step, dim, prefill);
        case INT4: return attention_for_dim<INT4>(step, dim, prefill);
    }
    return 1;
}
