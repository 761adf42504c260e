// Rotary position embedding of query and key heads for CPUs: rotary.py's apply_rotary_ref in one pass over the rows,
// read in place from the fused q/k/v projection's output. Documented by kernels/cpu_rotary.py.

#include <cstdint>

#include "cpu_kernels.h"

namespace {

// out [tokens, heads, dim] (contiguous) = x rotated, x's token rows `ld` elements apart (heads side by side).
template <int kind>
void rotary_rows(const void* x, int64_t ld, void* out, const int64_t* positions, const float* cos_sin,
                 int64_t tokens, int64_t heads, int64_t dim, int threads) {
    const int64_t width = kind == QRUN_F32 ? 4 : 2, half = dim / 2;
    qrun_parallel_for(tokens, threads, tokens * heads * dim >= (1 << 15), [&](int64_t t) {
        const float* cos = cos_sin + positions[t] * dim;
        const float* sin = cos + half;
        for (int64_t h = 0; h < heads; h++) {
            const char* row = static_cast<const char*>(x) + (t * ld + h * dim) * width;
            char* rotated = static_cast<char*>(out) + (t * heads + h) * dim * width;
            for (int64_t d = 0; d < half; d++) {
                float first, second;
                qrun_rotary_pair(qrun_load_value<kind>(row, d), qrun_load_value<kind>(row, d + half), cos[d], sin[d],
                                 first, second);
                qrun_store_value<kind>(rotated, d, first);
                qrun_store_value<kind>(rotated, d + half, second);
            }
        }
    });
}

}  // namespace

// out [tokens, heads, dim] (contiguous) = x [tokens, heads, dim] rotated at positions (int64 [tokens]) by cos_sin
// (float32 [max_positions, dim]: cos in the first dim / 2 columns, sin in the last), x float32 (kind 0) or bfloat16
// (kind 1) with its token rows ld elements apart. 0: done; 1: an unknown kind or an odd dim.
extern "C" int qrun_apply_rotary(int kind, const void* x, int64_t ld, void* out, const int64_t* positions,
                                 const float* cos_sin, int64_t tokens, int64_t heads, int64_t dim, int threads) {
    if (dim % 2) return 1;
    return qrun_with_kind(kind, [&](auto k) {
        rotary_rows<decltype(k)::value>(x, ld, out, positions, cos_sin, tokens, heads, dim, threads);
    });
}
