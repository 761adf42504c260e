// A step's new keys and values quantized into their slots of an int8 or int4 paged cache, one pass per token and
// head: kernels/kv_quant.py's quantize_kv_ref element for element (the same float32 operations and float16
// roundings, so the same bytes). Documented by kernels/cpu_kv_store.py.

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "cpu_kernels.h"

namespace {

constexpr float SCALE_LIMIT = 65504.f;  // float16's largest finite value
constexpr float MIN_STEP = 5.9604644775390625e-08f;  // 2^-24, the smallest positive float16

inline float as_half(float value) { return float(_Float16(value)); }  // rounded to nearest even

// One group of `group` values (clamped) into `data` (int8: group bytes; int4: group / 2, element j in the low
// nibble of byte j, element j + group / 2 in its high one) and its (scale, zero) in float16.
void quantize_group(const float* x, int64_t group, int bits, uint8_t* data, _Float16* scale_zero) {
    float clamped[256];
    float low = SCALE_LIMIT, high = -SCALE_LIMIT, top = 0.f;
    for (int64_t i = 0; i < group; i++) {
        clamped[i] = std::min(std::max(x[i], -SCALE_LIMIT), SCALE_LIMIT);
        low = std::min(low, clamped[i]);
        high = std::max(high, clamped[i]);
        top = std::max(top, std::fabs(clamped[i]));
    }
    if (bits == 8) {
        const float step = as_half(std::max(top / 127.f, MIN_STEP));
        scale_zero[0] = _Float16(step);
        scale_zero[1] = _Float16(0.f);
        for (int64_t i = 0; i < group; i++)
            data[i] = uint8_t(int8_t(std::min(std::max(std::floor(clamped[i] / step + 0.5f), -127.f), 127.f)));
        return;
    }
    const float step = as_half(std::max((high - low) / 15.f, MIN_STEP)), zero = as_half(low);
    scale_zero[0] = _Float16(step);
    scale_zero[1] = _Float16(zero);
    const auto code = [&](int64_t i) {
        return uint8_t(std::min(std::max(std::floor((clamped[i] - zero) / step + 0.5f), 0.f), 15.f));
    };
    for (int64_t j = 0; j < group / 2; j++) data[j] = uint8_t(code(j) | (code(j + group / 2) << 4));
}

}  // namespace

// keys, values: float32 [tokens, heads, dim] (contiguous); token t goes to slot slots[t] of caches laid out
// [blocks, block_size, heads, dim * bits / 8] with scales [blocks, block_size, heads, dim / group, 2] float16.
// 0: done; 1: sizes the kernel does not take.
extern "C" int qrun_store_kv_quantized(const float* keys, const float* values, const int64_t* slots, int64_t tokens,
                                       int64_t heads, int64_t dim, int64_t group, int bits, uint8_t* k_cache,
                                       uint8_t* v_cache, uint16_t* k_scales, uint16_t* v_scales) {
    if ((bits != 8 && bits != 4) || group < 2 || group > 256 || dim % group || group % 2) return 1;
    const int64_t packed = dim * bits / 8, groups = dim / group;
    for (int64_t t = 0; t < tokens; t++)
        for (int64_t h = 0; h < heads && slots[t] >= 0; h++) {  // a negative slot: a padding token
            const int64_t row = slots[t] * heads + h;
            for (int64_t g = 0; g < groups; g++) {
                const int64_t at = (t * heads + h) * dim + g * group, scale_at = (row * groups + g) * 2;
                const int64_t data_at = row * packed + g * group * bits / 8;
                quantize_group(keys + at, group, bits, k_cache + data_at,
                               reinterpret_cast<_Float16*>(k_scales + scale_at));
                quantize_group(values + at, group, bits, v_cache + data_at,
                               reinterpret_cast<_Float16*>(v_scales + scale_at));
            }
        }
    return 0;
}
