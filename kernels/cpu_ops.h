// cpu_ops.cpp's ops with their outputs given by the caller: the torch ops allocate them and call these; the C++
// model (cpu_model.cpp) passes tensors it keeps between steps, so a decode step at one row makes no allocation of
// its own. Each checks its arguments as the op does.

#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>

namespace qrun_ops {

using Optional = std::optional<at::Tensor>;

// out = RMSNorm(x (+ residual)) * weight and, with a residual, sum = x + residual (sum may be residual itself);
// all of x's dtype (float32 or bfloat16) and shape, contiguous.
void add_rms_norm_into(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                       at::Tensor& out, at::Tensor& sum);

// out [rows, k] (contiguous, x's dtype) = x rotated (inverse: rotated back); kernels/cpu_rotation.py.
void rotate_into(const at::Tensor& x, const at::Tensor& signs, const Optional& odd_factor, bool inverse,
                 at::Tensor& out);

// out [rows, index.numel()] (contiguous, x's dtype) = x[:, index]: act order's input gather.
void gather_columns_into(const at::Tensor& x, const at::Tensor& index, at::Tensor& out);

// y [rows, n] (contiguous, x's dtype) = x W^T (+ bias) with a float16 W, 1 to 4 rows, each thread reading
// read_streams (1, 2 or 4) runs of W's rows side by side: kernels/cpu_half_gemv.cpp.
void half_gemv_into(const at::Tensor& x, const at::Tensor& weight, const Optional& bias, int64_t read_streams,
                    at::Tensor& y);

// Whether quant_matmul multiplies x's rows on the VNNI kernel (not AMX tiles or oneDNN; see its thresholds).
bool quant_matmul_on_vnni(int64_t rows, at::ScalarType dtype, int64_t tile_rows, int64_t dequantize_rows);

// An [n, k] weight's planes as the kernels read them (kernels/cpu_quant_matmul.py's layout), checked once where they
// are made: the C++ model's layer keeps the VNNI kernel's with its linear, the ops make them for each call. The tensors
// they point into must outlive them.
struct QuantPlanes {
    qrun_plane low, high;  // high.codes null: one plane
    int64_t n = 0, group = 0, input_digits = 1, read_streams = 4;

    const qrun_plane* high_or_null() const { return high.codes ? &high : nullptr; }
};

// The planes of an [out_features, k] weight, checked against the layout (its widths follow from the codes' sizes);
// `op` names the caller in what a mismatch raises.
QuantPlanes quant_planes(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                        const at::Tensor& centers, int64_t group, int64_t out_features, const Optional& high_codes,
                        const Optional& high_scales, const Optional& high_zeros, const Optional& high_centers,
                        int64_t k_high, const char* op);

// quant_planes for the VNNI kernel, with its rounding of inputs and read streams.
QuantPlanes vnni_planes(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                       const at::Tensor& centers, int64_t group, int64_t out_features, const Optional& high_codes,
                       const Optional& high_scales, const Optional& high_zeros, const Optional& high_centers,
                       int64_t k_high, int64_t input_digits, int64_t read_streams);

// The VNNI kernel's y = x W^T (+ x[:, :k_high] W_high^T) for float32 or bfloat16 x [rows, k] (contiguous) into y
// [rows, n] of x's dtype, its float32 sums rounded once to bfloat16 as they are stored; or, for bfloat16 x, into
// float32 y holding those bfloat16 values (the product as its bfloat16 result widened, in one pass). gated (n a
// multiple of 32; y of x's dtype): y [rows, n / 2] = silu of the product's first n / 2 columns times its last, as
// kernels/cpu_activation.cpp computes it from the rounded product, with no pass of its own.
void quant_matmul_vnni(const QuantPlanes& planes, const at::Tensor& x, at::Tensor& y, bool gated = false);
void warm_quant_matmul(const QuantPlanes& planes, int64_t rows, bool gated);

// out (bfloat16, values' shape, contiguous) = float32 values rounded to nearest even, as torch rounds.
void to_bfloat16_into(const at::Tensor& values, at::Tensor& out);

// out [tokens, heads * dim] float32 = every decode row's attention over the paged cache, and every prefill chunk's
// with prefill_chunks (else those rows are left as they are): queries float32 [tokens, heads * dim] contiguous;
// block_tables, seq_lens and query_start_loc int32 and contiguous (kernels/cpu_attention.py).
void paged_attention_into(const at::Tensor& queries, int64_t heads, int64_t dim, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, double scale, const Optional& k_scales,
                          const Optional& v_scales, bool prefill_chunks, at::Tensor& out);

}  // namespace qrun_ops
