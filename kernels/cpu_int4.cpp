// Dequantization of torch's CPU int4-packed weights (aten._convert_weight_to_int4pack_for_cpu)
// into a plain bfloat16 [N, K] matrix, for matmuls of many rows (kernels/cpu_int4.py).
//
// The packed layout is [N / 64][K][32] bytes: output channel n of a 64-wide block is the low
// nibble of byte n % 32 when n % 64 < 32, the high nibble otherwise. cpu_int4.py checks that
// torch still packs this way before using the kernel. Values: w = (code - 8) * scale + zero,
// (scale, zero) bfloat16 [K / group][N][2].

#include <cstdint>
#include <cstring>

#include "cpu_kernels.h"

namespace {

inline float bf16_to_float(uint16_t bits) {
    const uint32_t wide = uint32_t(bits) << 16;
    float value;
    std::memcpy(&value, &wide, sizeof(value));
    return value;
}

constexpr int64_t BLOCK_N = 64;

}  // namespace

// out [N, K] bfloat16 = the dequantized weight (accumulate: out[:, :K] += it, for the upper
// digits of wider codes). 0: done; 1: N not a multiple of BLOCK_N or K not of group.
extern "C" int qrun_dequantize_int4pack(const uint8_t* packed, const uint16_t* scale_zero, uint16_t* out,
                                        int64_t n_total, int64_t k_total, int64_t out_stride, int64_t group,
                                        int accumulate, int threads) {
    if (n_total % BLOCK_N != 0 || k_total % group != 0) return 1;
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int64_t n = 0; n < n_total; n++) {
        const int64_t block = n / BLOCK_N, lane = n % BLOCK_N;
        const int shift = lane < BLOCK_N / 2 ? 0 : 4;
        const uint8_t* codes = packed + block * k_total * (BLOCK_N / 2) + lane % (BLOCK_N / 2);
        uint16_t* row = out + n * out_stride;
        for (int64_t g = 0; g < k_total / group; g++) {
            const uint16_t* sz = scale_zero + (g * n_total + n) * 2;
            const float scale = bf16_to_float(sz[0]), offset = bf16_to_float(sz[1]) - 8 * scale;
            for (int64_t k = g * group; k < (g + 1) * group; k++) {
                float value = float((codes[k * (BLOCK_N / 2)] >> shift) & 15) * scale + offset;
                if (accumulate) value += bf16_to_float(row[k]);
                row[k] = qrun_bfloat16_bits(value);
            }
        }
    }
    return 0;
}
