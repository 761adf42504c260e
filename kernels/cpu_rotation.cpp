// The input rotation x -> (x * signs) F of kernels/rotation.py for CPUs, and its inverse x -> (x F) * signs; and
// rotation.py's reflect, x -> x - 2 (x . u) u per head.
// F = F_odd (x) H: the Hartley transform of K's odd part (kernels/rotation.py's outermost factor) times the
// Sylvester-Hadamard matrix of its power-of-two part, which is what the Kronecker product of rotation.py's
// power-of-two factors is. Built and documented by kernels/cpu_rotation.py.
//
// torch runs it as one small matmul per factor; at one to a few rows each is a BLAS call whose thread start-up
// costs more than its work. Here a row, viewed as [odd, 2^m], is rotated in float32 on its thread's stack: a
// fast Walsh-Hadamard transform of each of its odd rows (m passes of additions, 16 values per instruction: 512
// rows of 576 took 0.19 ms against 0.45 with the passes as scalar loops), then the odd factor mixing them (16
// columns per sum held in a register: 512 rows of 576 / 1536 then took ~0.12-0.15 / ~0.28-0.33 ms on two Xeon
// cores against ~0.19 / ~0.36).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_kernels.h"

namespace {

// x <- x H for the n x n Sylvester-Hadamard matrix H, n a power of two.
void walsh_hadamard(float* x, int64_t n) {
    for (int64_t h = 1; h < n; h *= 2)
        for (int64_t i = 0; i < n; i += 2 * h)
            for (int64_t j = i; j < i + h; j++) {
                const float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
}

// The same for n a multiple of 16, 16 values at a time: butterflies of strides 1-8 within a vector (its values
// paired by a shuffle: x[j] + x[j ^ h], or x[j ^ h] - x[j] where bit h of j is set), wider ones between vectors.
void walsh_hadamard_vectors(float* x, int64_t n) {
    using Floats = qrun_floats;
    const auto sign = [](int h) {
        Floats s;
        for (int j = 0; j < 16; j++) s[j] = j & h ? -1.f : 1.f;
        return s;
    };
    const Floats sign1 = sign(1), sign2 = sign(2), sign4 = sign(4), sign8 = sign(8);
    for (int64_t v = 0; v < n; v += 16) {
        Floats a = qrun_load_floats(x + v);
        a = qrun_swap_lanes<1>(a) + a * sign1;
        a = qrun_swap_lanes<2>(a) + a * sign2;
        a = qrun_swap_lanes<4>(a) + a * sign4;
        a = qrun_swap_lanes<8>(a) + a * sign8;
        qrun_store_floats(x + v, a);
    }
    for (int64_t h = 16; h < n; h *= 2)
        for (int64_t i = 0; i < n; i += 2 * h)
            for (int64_t j = i; j < i + h; j += 16) {
                const Floats a = qrun_load_floats(x + j), b = qrun_load_floats(x + j + h);
                const Floats sum = a + b, difference = a - b;
                qrun_store_floats(x + j, sum);
                qrun_store_floats(x + j + h, difference);
            }
}

// Columns q .. q + 16 V of one row of mix_odd's b, from that row of F (`weights`): V sums side by side, each in a
// register, each a chain of dependent additions.
template <int V>
void mix_columns(const float* a, const float* weights, int64_t odd, int64_t n, int64_t q, float* row) {
    qrun_floats sums[V];
    for (int v = 0; v < V; v++) sums[v] = weights[0] * qrun_load_floats(a + q + 16 * v);
    for (int64_t j = 1; j < odd; j++)
        for (int v = 0; v < V; v++) sums[v] += weights[j] * qrun_load_floats(a + j * n + q + 16 * v);
    for (int v = 0; v < V; v++) qrun_store_floats(row + q + 16 * v, sums[v]);
}

// b[i, :] = sum_j F[i, j] a[j, :] for a, b [odd, n], F [odd, odd]. 16 columns at a time with the sums in registers
// where n allows (accumulating into b in memory, a store and a load per product, took 3/4 of the rotation's time),
// 64 at a time where n allows that (four chains of additions in flight instead of one: 512 bfloat16 rows of 576 in
// ~0.77x the time).
void mix_odd(const float* a, const float* factor, int64_t odd, int64_t n, float* b) {
    const int64_t vectorised = n / 16 * 16, wide = n / 64 * 64;
    for (int64_t i = 0; i < odd; i++) {
        const float* weights = factor + i * odd;
        for (int64_t q = 0; q < wide; q += 64) mix_columns<4>(a, weights, odd, n, q, b + i * n);
        for (int64_t q = wide; q < vectorised; q += 16) mix_columns<1>(a, weights, odd, n, q, b + i * n);
        for (int64_t q = vectorised; q < n; q++) {
            float sum = 0.f;
            for (int64_t j = 0; j < odd; j++) sum += weights[j] * a[j * n + q];
            b[i * n + q] = sum;
        }
    }
}

// Row r of x rotated into out (qrun_rotate's arguments, n = k / odd), through the float buffers a and b [k].
template <int kind, bool inverse>
void rotate_row(const void* x, int64_t ldx, void* out, int64_t ldout, const float* signs, const float* odd_factor,
                int64_t odd, int64_t n, int64_t r, float* a, float* b) {
    const int64_t k = n * odd, width = kind == QRUN_F32 ? 4 : 2;
    const float norm = 1.f / std::sqrt(float(n));  // H / sqrt(n) is orthogonal
    const char* in = static_cast<const char*>(x) + r * ldx * width;
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= k; i += 16) {
        const __m512 scaled = _mm512_mul_ps(qrun_load16<kind>(in, i), _mm512_set1_ps(norm));
        _mm512_storeu_ps(a + i, inverse ? scaled : _mm512_mul_ps(scaled, _mm512_loadu_ps(signs + i)));
    }
#endif
    for (; i < k; i++) a[i] = qrun_load_value<kind>(in, i) * (inverse ? 1.f : signs[i]) * norm;
    for (int64_t p = 0; p < odd; p++) {
        if (n % 16 == 0)
            walsh_hadamard_vectors(a + p * n, n);
        else
            walsh_hadamard(a + p * n, n);
    }
    float* rotated = a;
    if (odd > 1) {
        mix_odd(a, odd_factor, odd, n, b);
        rotated = b;
    }
    char* dst = static_cast<char*>(out) + r * ldout * width;
    i = 0;
#if defined(__AVX512F__)
    for (; i + 16 <= k; i += 16) {
        const __m512 values = _mm512_loadu_ps(rotated + i);
        qrun_store16<kind>(dst, i, inverse ? _mm512_mul_ps(values, _mm512_loadu_ps(signs + i)) : values);
    }
#endif
    for (; i < k; i++) qrun_store_value<kind>(dst, i, inverse ? rotated[i] * signs[i] : rotated[i]);
}

// Rows of x rotated into out (qrun_rotate's arguments, n = k / odd); out may be x. A few rows (a decode step's one,
// ~60 a step for a 4.0-bpw SmolLM2, or its heads of 64) run on the calling thread, with buffers each thread keeps: a
// parallel region and two fresh buffers cost as much as their arithmetic.
template <int kind, bool inverse>
void rotate_rows(const void* x, int64_t ldx, void* out, int64_t ldout, const float* signs, const float* odd_factor,
                 int64_t odd, int64_t n, int64_t rows, int threads) {
    const int64_t k = n * odd;
    if (rows <= 0) return;
    qrun_parallel_for(rows, threads, rows * k >= (1 << 14), [&](int64_t r) {
        thread_local std::vector<float> a, b;
        a.resize(k);
        b.resize(k);
        rotate_row<kind, inverse>(x, ldx, out, ldout, signs, odd_factor, odd, n, r, a.data(), b.data());
    });
}

// Each head row of x [rows][heads][dim] reflected into out: x - 2 (x . u) u with its KV head's u (heads / kv_heads
// query heads share one), in float32.
template <int kind>
void reflect_rows(const void* x, void* out, const float* u, int64_t rows, int64_t heads, int64_t kv_heads,
                  int64_t dim, int threads) {
    const int64_t items = rows * heads, group = heads / kv_heads;
    qrun_parallel_for(items, threads, items * dim >= (1 << 16), [&](int64_t item) {
        const float* normal = u + item % heads / group * dim;
        const int64_t at = item * dim;
        float dot = 0.f;
        for (int64_t d = 0; d < dim; d++) dot += qrun_load_value<kind>(x, at + d) * normal[d];
        for (int64_t d = 0; d < dim; d++)
            qrun_store_value<kind>(out, at + d, qrun_load_value<kind>(x, at + d) - 2.f * dot * normal[d]);
    });
}

}  // namespace

// x, out: [rows, heads, dim] float32 (kind 0) or bfloat16 (kind 1), contiguous (out may be x); u: float32 [kv_heads,
// dim], heads a multiple of kv_heads. Returns 0, or 1 for an unknown kind or heads not a multiple of kv_heads.
extern "C" int qrun_reflect(const void* x, void* out, int kind, const float* u, int64_t rows, int64_t heads,
                            int64_t kv_heads, int64_t dim, int threads) {
    if (kv_heads <= 0 || heads % kv_heads != 0 || (kind != QRUN_F32 && kind != QRUN_BF16)) return 1;
    (kind == QRUN_F32 ? reflect_rows<QRUN_F32> : reflect_rows<QRUN_BF16>)(x, out, u, rows, heads, kv_heads, dim,
                                                                          threads);
    return 0;
}

// x, out: [rows, k] float32 (kind 0) or bfloat16 (kind 1), rows `ldx` / `ldout` elements apart (out may be x);
// signs: float32 [k]; odd_factor: float32 [odd, odd] (null when odd is 1), k / odd a power of two; inverse: x F
// times the signs (rotation.py's unrotate). Returns 0, or 1 for a k that is not odd * 2^m or an unknown kind.
extern "C" int qrun_rotate(const void* x, int64_t ldx, void* out, int64_t ldout, int kind, const float* signs,
                           const float* odd_factor, int64_t odd, int64_t rows, int64_t k, int inverse, int threads) {
    const int64_t n = odd > 0 ? k / odd : 0;
    if (n <= 0 || n * odd != k || (n & (n - 1)) != 0 || (odd > 1 && odd_factor == nullptr)) return 1;
    const auto run = [&](auto rotate) { rotate(x, ldx, out, ldout, signs, odd_factor, odd, n, rows, threads); };
    return qrun_with_kind(kind, [&](auto element) {
        constexpr int row_kind = decltype(element)::value;
        inverse ? run(rotate_rows<row_kind, true>) : run(rotate_rows<row_kind, false>);
    });
}
