// The C++ CPU kernels as torch ops (torch.ops.qrun.*): one dispatch of a few microseconds from
// eager code, and one call Inductor keeps inside a compiled graph. The kernels themselves
// (cpu_attention.cpp, cpu_int4.cpp, cpu_kv_store.cpp, cpu_norm.cpp, ...) are plain C++; their
// Python modules document them.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/linear.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <tuple>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_ops.h"

namespace {

const void* pointer(const std::optional<at::Tensor>& tensor) {
    return tensor.has_value() ? tensor->data_ptr() : nullptr;
}

int kv_kind(const at::Tensor& cache, bool quantized) {
    if (quantized) return cache.scalar_type() == at::kChar ? 3 : 4;  // int8, or int4 packed in uint8
    switch (cache.scalar_type()) {
        case at::kFloat: return 0;
        case at::kBFloat16: return 1;
        case at::kHalf: return 2;
        default: TORCH_CHECK(false, "paged_attention: no kernel for a ", cache.scalar_type(), " cache");
    }
}

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& seq_lens,
                           const at::Tensor& query_start_loc, double scale, const std::optional<at::Tensor>& k_scales,
                           const std::optional<at::Tensor>& v_scales) {
    TORCH_CHECK(q.dim() == 3, "paged_attention: q must be [tokens, heads, head_dim], got ", q.sizes());
    const at::Tensor queries = q.to(at::kFloat).contiguous();
    at::Tensor out = at::empty_like(queries);
    at::Tensor flat = out.view({q.size(0), -1});
    qrun_ops::paged_attention_into(queries.view({q.size(0), -1}), q.size(1), q.size(2), k_cache, v_cache,
                                   block_tables.to(at::kInt).contiguous(), seq_lens.to(at::kInt).contiguous(),
                                   query_start_loc.to(at::kInt).contiguous(), scale, k_scales, v_scales,
                                   /*prefill_chunks=*/true, flat);
    return out;
}

at::Tensor paged_attention_shape(const at::Tensor& q, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&, double, const std::optional<at::Tensor>&,
                                 const std::optional<at::Tensor>&) {
    return at::empty_symint(q.sym_sizes(), q.options().dtype(at::kFloat));
}

void dequantize_int4pack(const at::Tensor& packed, const at::Tensor& scale_zero, int64_t group, at::Tensor& out,
                         bool accumulate) {
    const int64_t n = packed.size(0), k = packed.size(1) * 2;
    TORCH_CHECK(out.scalar_type() == at::kBFloat16 && out.stride(1) == 1 && out.size(0) == n && out.size(1) >= k,
                "dequantize_int4pack writes a bfloat16 [", n, ", >= ", k, "] matrix with contiguous rows");
    const int status = qrun_dequantize_int4pack(
        static_cast<const uint8_t*>(packed.data_ptr()), static_cast<const uint16_t*>(scale_zero.data_ptr()),
        static_cast<uint16_t*>(out.data_ptr()), n, k, out.stride(0), group, accumulate, at::get_num_threads());
    TORCH_CHECK(status == 0, "cannot dequantize an int4-packed [", n, ", ", k, "] weight in groups of ", group);
}

void dequantize_int4pack_shape(const at::Tensor&, const at::Tensor&, int64_t, at::Tensor&, bool) {}

// at::Tensor::to costs ~3 us of dispatch and iterator set-up here, as much as the kernel on a
// small matrix; rounding to nearest even as torch does, vectorised, on torch's threads for big outputs (a head's
// 49152 logits a row).
at::Tensor to_bfloat16(const at::Tensor& values) {
    at::Tensor out = at::empty(values.sizes(), values.options().dtype(at::kBFloat16));
    qrun_ops::to_bfloat16_into(values, out);
    return out;
}

at::Tensor dequantize_planes(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                             const at::Tensor& centers, int64_t group, int64_t out_features,
                             const std::optional<at::Tensor>& high_codes, const std::optional<at::Tensor>& high_scales,
                             const std::optional<at::Tensor>& high_zeros,
                             const std::optional<at::Tensor>& high_centers, int64_t k_high) {
    const qrun_ops::QuantPlanes planes = qrun_ops::quant_planes(codes, scales, zeros, centers, group, out_features,
                                                               high_codes, high_scales, high_zeros, high_centers,
                                                               k_high, "dequantize_planes");
    const int64_t k = planes.low.k;
    at::Tensor out = at::empty({k, out_features}, codes.options().dtype(at::kBFloat16));  // input-major
    const int status = qrun_dequantize_planes(&planes.low, planes.high_or_null(), out_features, group,
                                              static_cast<uint16_t*>(out.data_ptr()), out_features,
                                              at::get_num_threads());
    TORCH_CHECK(status == 0, "dequantize_planes: cannot unpack a [", out_features, ", ", k, "] weight in groups of ",
                group);
    return out.t();
}

// y = x W^T (+ x[:, :k_high] W_high^T) on AMX tiles, x bfloat16: in weights mode bfloat16 (each sum rounded once as it
// is stored), in codes mode float32 (its sums grow group by group in y).
at::Tensor quant_matmul_tiles(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                              const at::Tensor& zeros, const at::Tensor& centers, int64_t group, int64_t out_features,
                              const std::optional<at::Tensor>& high_codes, const std::optional<at::Tensor>& high_scales,
                              const std::optional<at::Tensor>& high_zeros,
                              const std::optional<at::Tensor>& high_centers, int64_t k_high, bool dequantize_weights) {
    const int64_t k = x.size(1);
    const qrun_ops::QuantPlanes planes = qrun_ops::quant_planes(codes, scales, zeros, centers, group, out_features,
                                                               high_codes, high_scales, high_zeros, high_centers,
                                                               k_high, "quant_matmul");
    TORCH_CHECK(x.stride(1) == 1 && planes.low.k == k, "quant_matmul: x ", x.sizes(), " does not match the packed [",
                out_features, ", ", planes.low.k, "] weight");
    at::Tensor y = at::empty({x.size(0), out_features}, x.options().dtype(dequantize_weights ? at::kBFloat16
                                                                                             : at::kFloat));
    const int status = qrun_quant_matmul_tiles(static_cast<const uint16_t*>(x.data_ptr()), x.stride(0), &planes.low,
                                               planes.high_or_null(), y.data_ptr(), dequantize_weights, y.stride(0),
                                               x.size(0), out_features, group, dequantize_weights,
                                               at::get_num_threads());
    TORCH_CHECK(status == 0, "qrun_quant_matmul_tiles cannot multiply [", x.size(0), ", ", k, "] by a [",
                out_features, ", ", k, "] weight in groups of ", group, " (status ", status, ")");
    return y;
}

// Which kernel multiplies (kernels/cpu_quant_matmul.py: tile_rows, tile_dequantize_rows, dequantize_rows): bfloat16
// rows from dequantize_rows on (0: never) oneDNN on the dequantized weight, from tile_rows on (0: never) the AMX
// kernel, in weights mode from tile_dequantize_rows on (0: never); else the VNNI kernel, reading read_streams runs of
// weights side by side at one or two rows.
at::Tensor quant_matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                        const at::Tensor& zeros, const at::Tensor& centers, int64_t group, int64_t out_features,
                        const std::optional<at::Tensor>& high_codes, const std::optional<at::Tensor>& high_scales,
                        const std::optional<at::Tensor>& high_zeros, const std::optional<at::Tensor>& high_centers,
                        int64_t k_high, int64_t input_digits, int64_t tile_rows, int64_t tile_dequantize_rows,
                        int64_t dequantize_rows, int64_t read_streams) {
    // bfloat16 rows, many: AMX tiles or oneDNN
    if (!qrun_ops::quant_matmul_on_vnni(x.size(0), x.scalar_type(), tile_rows, dequantize_rows)) {
        if (dequantize_rows > 0 && x.size(0) >= dequantize_rows)
            return at::linear(x, dequantize_planes(codes, scales, zeros, centers, group, out_features, high_codes,
                                                   high_scales, high_zeros, high_centers, k_high));
        const at::Tensor y = quant_matmul_tiles(x.contiguous(), codes, scales, zeros, centers, group, out_features,
                                                high_codes, high_scales, high_zeros, high_centers, k_high,
                                                tile_dequantize_rows > 0 && x.size(0) >= tile_dequantize_rows);
        return y.scalar_type() == at::kBFloat16 ? y : to_bfloat16(y);
    }
    const at::Tensor rows = (x.scalar_type() == at::kBFloat16 ? x : x.to(at::kFloat)).contiguous();
    at::Tensor y = at::empty({rows.size(0), out_features}, rows.options());
    qrun_ops::quant_matmul_vnni(qrun_ops::vnni_planes(codes, scales, zeros, centers, group, out_features, high_codes,
                                                      high_scales, high_zeros, high_centers, k_high, input_digits,
                                                      read_streams),
                                rows, y);
    return rows.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

at::Tensor quant_matmul_shape(const at::Tensor& x, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, int64_t, c10::SymInt out_features, const std::optional<at::Tensor>&,
                              const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                              const std::optional<at::Tensor>&, int64_t, int64_t, int64_t, int64_t, int64_t,
                              int64_t) {
    return at::empty_symint({x.sym_size(0), out_features}, x.options());
}

bool quant_matmul_available() { return qrun_quant_matmul_available() != 0; }

bool quant_matmul_tiles_available() { return qrun_quant_matmul_tiles_available() != 0; }

// out[:, j] = x[:, index[j]]: act order's input gather (kernels/cpu_quant_matmul.py's gather_columns). torch's
// index_select along columns took 0.50 ms for 512 x 576 bfloat16 values, this copy by element 0.07 ms (32 rows: 32
// and 7 us; one row the same) on two Xeon cores.
template <typename Element>
void gather_rows(const Element* x, int64_t ldx, const int64_t* index, int64_t columns, Element* out, int64_t rows) {
    qrun_parallel_for(rows, at::get_num_threads(), rows * columns >= (1 << 14), [&](int64_t r) {
        const Element* __restrict row = x + r * ldx;
        Element* __restrict to = out + r * columns;
        for (int64_t j = 0; j < columns; j++) to[j] = row[index[j]];
    });
}

at::Tensor gather_columns(const at::Tensor& x, const at::Tensor& index) {
    at::Tensor out = at::empty({x.size(0), index.numel()}, x.options());
    qrun_ops::gather_columns_into(x, index, out);
    return out;
}

at::Tensor gather_columns_shape(const at::Tensor& x, const at::Tensor& index) {
    return at::empty_symint({x.sym_size(0), index.sym_size(0)}, x.options());
}

// odd_factor: rotation.py's factor for K's odd part, or None where K is a power of two. inverse: unrotate.
at::Tensor rotate_or_unrotate(const at::Tensor& x, const at::Tensor& signs, const std::optional<at::Tensor>& odd_factor,
                              bool inverse) {
    at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
    qrun_ops::rotate_into(x, signs, odd_factor, inverse, out);
    return out;
}

at::Tensor rotate(const at::Tensor& x, const at::Tensor& signs, const std::optional<at::Tensor>& odd_factor) {
    return rotate_or_unrotate(x, signs, odd_factor, false);
}

at::Tensor unrotate(const at::Tensor& x, const at::Tensor& signs, const std::optional<at::Tensor>& odd_factor) {
    return rotate_or_unrotate(x, signs, odd_factor, true);
}

// x: float32 or bfloat16 [rows, heads, dim]; u: float32 [kv_heads, dim] (rotation.py's reflect)
at::Tensor reflect(const at::Tensor& x, const at::Tensor& u) {
    TORCH_CHECK(x.dim() == 3 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                "reflect: x must be float32 or bfloat16 [rows, heads, head_dim], got ", x.scalar_type(), " ",
                x.sizes());
    TORCH_CHECK(u.scalar_type() == at::kFloat && u.dim() == 2 && u.size(1) == x.size(2) && u.size(0) > 0 &&
                    x.size(1) % u.size(0) == 0,
                "reflect: u must be float32 [kv_heads, ", x.size(2), "] with kv_heads dividing ", x.size(1),
                " heads, got ", u.scalar_type(), " ", u.sizes());
    const at::Tensor rows = x.contiguous(), normals = u.contiguous();
    at::Tensor out = at::empty_like(rows);
    const int status = qrun_reflect(rows.data_ptr(), out.data_ptr(), x.scalar_type() == at::kFloat ? 0 : 1,
                                    normals.data_ptr<float>(), x.size(0), x.size(1), u.size(0), x.size(2),
                                    at::get_num_threads());
    TORCH_CHECK(status == 0, "reflect: ", x.size(1), " heads are not a multiple of ", u.size(0), " KV heads");
    return out;
}

at::Tensor half_gemv(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias,
                     int64_t read_streams) {
    at::Tensor y = at::empty({x.size(0), weight.size(0)}, x.options());
    qrun_ops::half_gemv_into(x, weight, bias, read_streams, y);
    return y;
}

at::Tensor half_gemv_shape(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>&, int64_t) {
    return at::empty_symint({x.sym_size(0), weight.sym_size(0)}, x.options());
}

void store_kv_quantized(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
                        const at::Tensor& slot_mapping, at::Tensor& k_scales, at::Tensor& v_scales) {
    TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k_cache.dim() == 4 && k_cache.size(2) == k.size(1),
                "store_kv: keys and values must be [tokens, ", k_cache.size(2), " heads, dim], got ", k.sizes(),
                " and ", v.sizes());
    const int64_t dim = k.size(2), groups = k_scales.size(-2);
    const int bits = k_cache.scalar_type() == at::kChar ? 8 : 4;
    const bool laid_out = k_cache.is_contiguous() && v_cache.is_contiguous() && k_scales.is_contiguous() &&
                          v_scales.is_contiguous() && k_cache.sizes() == v_cache.sizes() &&
                          (k_cache.scalar_type() == at::kChar || k_cache.scalar_type() == at::kByte) &&
                          k_cache.size(3) == dim * bits / 8 && k_scales.scalar_type() == at::kHalf &&
                          k_scales.sizes() == v_scales.sizes() && groups > 0 && dim % groups == 0;
    TORCH_CHECK(laid_out, "store_kv: not an int8/int4 cache with float16 scales of head_dim ", dim);
    const at::Tensor keys = k.to(at::kFloat).contiguous(), values = v.to(at::kFloat).contiguous();
    const at::Tensor slots = slot_mapping.to(at::kLong).contiguous();
    const int status = qrun_store_kv_quantized(
        keys.data_ptr<float>(), values.data_ptr<float>(), slots.data_ptr<int64_t>(), k.size(0), k.size(1), dim,
        dim / groups, bits, static_cast<uint8_t*>(k_cache.data_ptr()), static_cast<uint8_t*>(v_cache.data_ptr()),
        static_cast<uint16_t*>(k_scales.data_ptr()), static_cast<uint16_t*>(v_scales.data_ptr()));
    TORCH_CHECK(status == 0, "store_kv: no kernel for groups of ", dim / groups, " at ", bits, " bits");
}

void store_kv_quantized_shape(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&, const at::Tensor&,
                              at::Tensor&, at::Tensor&) {}

// One implementation for both ops; residual may be undefined (no add, no sum).
std::tuple<at::Tensor, at::Tensor> norm_rows(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                                             double eps) {
    at::Tensor out = at::empty_like(x), sum = residual.defined() ? at::empty_like(x) : at::Tensor();
    qrun_ops::add_rms_norm_into(x, residual, weight, eps, out, sum);
    return {out, sum};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
    return std::get<0>(norm_rows(x, at::Tensor(), weight, eps));
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                const at::Tensor& weight, double eps) {
    return norm_rows(x, residual, weight, eps);
}

at::Tensor rms_norm_shape(const at::Tensor& x, const at::Tensor&, double) { return at::empty_like(x); }

std::tuple<at::Tensor, at::Tensor> add_rms_norm_shape(const at::Tensor& x, const at::Tensor&, const at::Tensor&,
                                                      double) {
    return {at::empty_like(x), at::empty_like(x)};
}

at::Tensor rotate_shape(const at::Tensor& x, const at::Tensor&, const std::optional<at::Tensor>&) {
    return at::empty_like(x);
}

// q [tokens, heads, dim] and k [tokens, kv_heads, dim] (float32 or bfloat16, each token's heads contiguous, tokens
// any stride apart) rotated into new contiguous tensors (kernels/cpu_rotary.py).
std::tuple<at::Tensor, at::Tensor> apply_rotary(const at::Tensor& q, const at::Tensor& k, const at::Tensor& positions,
                                                const at::Tensor& cos_sin) {
    const at::Tensor pos = positions.to(at::kLong).contiguous(), table = cos_sin.contiguous();
    TORCH_CHECK(table.scalar_type() == at::kFloat && table.dim() == 2 && pos.dim() == 1,
                "apply_rotary: cos_sin must be float32 [positions, head_dim] and positions one-dimensional");
    at::Tensor rotated[2];
    const at::Tensor* heads[2] = {&q, &k};
    for (int i = 0; i < 2; i++) {
        const at::Tensor& x = *heads[i];
        TORCH_CHECK((x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) && x.dim() == 3 &&
                        x.size(0) == pos.size(0) && x.size(2) == table.size(1) && x.stride(2) == 1 &&
                        x.stride(1) == x.size(2),
                    "apply_rotary: q and k must be float32 or bfloat16 [", pos.size(0), ", heads, ", table.size(1),
                    "] with each token's heads contiguous, got ", x.scalar_type(), " ", x.sizes(), " strides ",
                    x.strides());
        rotated[i] = at::empty(x.sizes(), x.options());
        const int status = qrun_apply_rotary(x.scalar_type() == at::kFloat ? 0 : 1, x.data_ptr(), x.stride(0),
                                             rotated[i].data_ptr(), pos.data_ptr<int64_t>(), table.data_ptr<float>(),
                                             x.size(0), x.size(1), x.size(2), at::get_num_threads());
        TORCH_CHECK(status == 0, "apply_rotary: no kernel for an odd head_dim ", x.size(2));
    }
    return {rotated[0], rotated[1]};
}

std::tuple<at::Tensor, at::Tensor> apply_rotary_shape(const at::Tensor& q, const at::Tensor& k, const at::Tensor&,
                                                      const at::Tensor&) {
    return {at::empty_symint(q.sym_sizes(), q.options()), at::empty_symint(k.sym_sizes(), k.options())};
}

at::Tensor reflect_shape(const at::Tensor& x, const at::Tensor&) { return at::empty_like(x); }

// silu(gate) * up for [rows, width] views with contiguous rows the same distance apart (kernels/cpu_activation.py).
at::Tensor silu_and_mul(const at::Tensor& gate, const at::Tensor& up) {
    const bool floats = gate.scalar_type() == at::kFloat || gate.scalar_type() == at::kBFloat16;
    const bool shaped = gate.dim() == 2 && up.sizes() == gate.sizes();
    const bool rows_alike = shaped && (gate.size(1) == 1 || (gate.stride(1) == 1 && up.stride(1) == 1)) &&
                            (gate.size(0) <= 1 || gate.stride(0) == up.stride(0));
    TORCH_CHECK(floats && up.scalar_type() == gate.scalar_type() && rows_alike,
                "silu_and_mul: gate and up must be float32 or bfloat16 [rows, width] of one dtype with contiguous "
                "rows equally apart, got ", gate.scalar_type(), " ", gate.sizes(), " strides ", gate.strides(), " and ",
                up.scalar_type(), " ", up.sizes(), " strides ", up.strides());
    at::Tensor out = at::empty(gate.sizes(), gate.options());
    qrun_silu_and_mul(gate.scalar_type() == at::kFloat ? QRUN_F32 : QRUN_BF16, gate.data_ptr(), up.data_ptr(),
                      gate.size(0) > 1 ? gate.stride(0) : gate.size(1), out.data_ptr(), gate.size(0), gate.size(1),
                      at::get_num_threads());
    return out;
}

// Each row's first index of its largest value (kernels/cpu_argmax.py).
at::Tensor first_max(const at::Tensor& rows) {
    TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kFloat && rows.stride(1) == 1 && rows.size(1) > 0 &&
                    rows.size(1) < (int64_t(1) << 31),
                "first_max: rows must be float32 [rows, width] with contiguous rows and 0 < width < 2^31, got ",
                rows.scalar_type(), " ", rows.sizes());
    at::Tensor out = at::empty({rows.size(0)}, rows.options().dtype(at::kLong));
    qrun_first_max(rows.data_ptr<float>(), rows.stride(0), rows.size(0), rows.size(1), out.data_ptr<int64_t>(),
                   at::get_num_threads(), 0);
    return out;
}

// A token drawn from each row of logits under its sampling parameters (kernels/cpu_draw.py).
at::Tensor draw(const at::Tensor& logits, const at::Tensor& temperature, const at::Tensor& top_k,
                const at::Tensor& top_p, const at::Tensor& min_p, const at::Tensor& uniforms) {
    TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 &&
                    logits.size(1) > 0 && logits.size(1) < (int64_t(1) << 31),
                "draw: logits must be float32 [rows, vocab] with contiguous rows and 0 < vocab < 2^31, got ",
                logits.scalar_type(), " ", logits.sizes());
    const int64_t rows = logits.size(0);
    const auto per_row = [&](const at::Tensor& t, at::ScalarType dtype, const char* name) {
        TORCH_CHECK(t.dim() == 1 && t.size(0) == rows && t.scalar_type() == dtype && t.is_contiguous(), "draw: ",
                    name, " must be ", dtype, " [", rows, "], got ", t.scalar_type(), " ", t.sizes());
    };
    per_row(temperature, at::kFloat, "temperature");
    per_row(top_k, at::kLong, "top_k");
    per_row(top_p, at::kFloat, "top_p");
    per_row(min_p, at::kFloat, "min_p");
    per_row(uniforms, at::kDouble, "uniforms");
    at::Tensor out = at::empty({rows}, logits.options().dtype(at::kLong));
    qrun_draw(logits.data_ptr<float>(), logits.stride(0), rows, logits.size(1), temperature.data_ptr<float>(),
              top_k.data_ptr<int64_t>(), top_p.data_ptr<float>(), min_p.data_ptr<float>(), uniforms.data_ptr<double>(),
              out.data_ptr<int64_t>(), at::get_num_threads());
    return out;
}

// -inf at each token its row of the structured outputs' bitmask does not allow (kernels/cpu_token_bitmask.py).
void mask_logits(const at::Tensor& logits, const at::Tensor& bitmask) {
    TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
                "mask_logits: logits must be float32 [rows, vocab] with contiguous rows, got ", logits.scalar_type(),
                " ", logits.sizes());
    TORCH_CHECK(bitmask.dim() == 2 && bitmask.size(0) == logits.size(0) && bitmask.scalar_type() == at::kInt &&
                    bitmask.is_contiguous(),
                "mask_logits: bitmask must be contiguous int32 [", logits.size(0), ", words], got ",
                bitmask.scalar_type(), " ", bitmask.sizes());
    qrun_mask_logits(logits.data_ptr<float>(), logits.stride(0), logits.size(0), logits.size(1),
                     bitmask.data_ptr<int32_t>(), bitmask.size(1), at::get_num_threads());
}

// Each row's log-softmax at its token, and its top_n largest values with their tokens (kernels/cpu_logprobs.py).
std::tuple<at::Tensor, at::Tensor, at::Tensor> top_logprobs(const at::Tensor& logits, const at::Tensor& tokens,
                                                            int64_t top_n) {
    TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1 &&
                    logits.size(1) > 0 && logits.size(1) < (int64_t(1) << 31),
                "top_logprobs: logits must be float32 [rows, vocab] with contiguous rows and 0 < vocab < 2^31, got ",
                logits.scalar_type(), " ", logits.sizes());
    const int64_t rows = logits.size(0), vocab = logits.size(1);
    TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == rows && tokens.scalar_type() == at::kLong &&
                    tokens.is_contiguous(),
                "top_logprobs: tokens must be int64 [", rows, "], got ", tokens.scalar_type(), " ", tokens.sizes());
    TORCH_CHECK(top_n >= 0 && top_n <= vocab, "top_logprobs: top_n must be in [0, ", vocab, "], got ", top_n);
    const int64_t* token = tokens.data_ptr<int64_t>();
    for (int64_t r = 0; r < rows; r++)
        TORCH_CHECK(token[r] >= 0 && token[r] < vocab, "top_logprobs: token ", token[r], " of row ", r,
                    " is outside the ", vocab, " logits");
    at::Tensor chosen = at::empty({rows}, logits.options()), values = at::empty({rows, top_n}, logits.options()),
               ids = at::empty({rows, top_n}, logits.options().dtype(at::kLong));
    qrun_top_logprobs(logits.data_ptr<float>(), logits.stride(0), rows, vocab, token, top_n, chosen.data_ptr<float>(),
                      values.data_ptr<float>(), ids.data_ptr<int64_t>(), at::get_num_threads());
    return {chosen, values, ids};
}

// x's float32 sum, each thread reading its share in `streams` runs side by side (kernels/cpu_read.cpp).
at::Tensor read_sum(const at::Tensor& x, int64_t streams) {
    TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous(), "read_sum: x must be contiguous float32, got ",
                x.scalar_type());
    TORCH_CHECK(streams == 1 || streams == 2 || streams == 4 || streams == 8, "read_sum: streams must be 1, 2, 4 or 8, "
                "got ", streams);
    at::Tensor sum = at::empty({}, x.options().dtype(at::kDouble));
    *sum.data_ptr<double>() = qrun_read_sum(x.data_ptr<float>(), x.numel(), int(streams), at::get_num_threads());
    return sum;
}

// rounds x 12 multiply-adds of 16-float vectors on each of torch's threads (kernels/cpu_read.cpp); their sum.
double multiply_adds(int64_t rounds) {
    TORCH_CHECK(rounds >= 0, "multiply_adds: rounds must be >= 0, got ", rounds);
    return qrun_multiply_adds(rounds, at::get_num_threads());
}

// Which of `threads` held threads ran each of `count` claimed items, the holder slowed by holder_spin_ns an item
// (kernels/cpu_team.cpp); for the tests.
std::vector<int64_t> team_claims(int64_t count, int64_t threads, int64_t holder_spin_ns) {
    TORCH_CHECK(count >= 0 && count < (int64_t(1) << 31) && threads >= 1 && holder_spin_ns >= 0,
                "team_claims: count must be in [0, 2^31), threads >= 1 and holder_spin_ns >= 0, got ", count, ", ",
                threads, " and ", holder_spin_ns);
    std::vector<int64_t> ran(count);
    qrun_team_claims(count, int(threads), holder_spin_ns, ran.data());
    return ran;
}

// Which of `threads` held threads ran a warm posted between two jobs, and whether the job ended it
// (kernels/cpu_team.cpp); for the tests.
std::tuple<std::vector<int64_t>, std::vector<int64_t>> team_warm(int64_t threads) {
    TORCH_CHECK(threads >= 1 && threads <= 64, "team_warm: threads must be in [1, 64], got ", threads);
    std::vector<int64_t> warmed(threads), stopped(threads);
    qrun_team_warm(int(threads), warmed.data(), stopped.data());
    return {warmed, stopped};
}

at::Tensor first_max_shape(const at::Tensor& rows) {
    return at::empty_symint({rows.sym_size(0)}, rows.options().dtype(at::kLong));
}

at::Tensor draw_shape(const at::Tensor& logits, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                      const at::Tensor&, const at::Tensor&) {
    return at::empty_symint({logits.sym_size(0)}, logits.options().dtype(at::kLong));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> top_logprobs_shape(const at::Tensor& logits, const at::Tensor&,
                                                                  int64_t top_n) {
    return {at::empty_symint({logits.sym_size(0)}, logits.options()),
            at::empty_symint({logits.sym_size(0), top_n}, logits.options()),
            at::empty_symint({logits.sym_size(0), top_n}, logits.options().dtype(at::kLong))};
}

at::Tensor silu_and_mul_shape(const at::Tensor& gate, const at::Tensor&) {
    return at::empty_symint(gate.sym_sizes(), gate.options());
}

}  // namespace

namespace qrun_ops {

void add_rms_norm_into(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight, double eps,
                       at::Tensor& out, at::Tensor& sum) {
    const bool floats = x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16;
    TORCH_CHECK(floats && x.is_contiguous() && x.dim() >= 1, "rms_norm: x must be contiguous float32 or bfloat16, got ",
                x.scalar_type(), " ", x.sizes());
    const int64_t hidden = x.size(-1);
    TORCH_CHECK(weight.scalar_type() == x.scalar_type() && weight.is_contiguous() && weight.numel() == hidden,
                "rms_norm: weight must be ", x.scalar_type(), " [", hidden, "], got ", weight.scalar_type(), " ",
                weight.sizes());
    TORCH_CHECK(!residual.defined() || (residual.scalar_type() == x.scalar_type() && residual.is_contiguous() &&
                                        residual.sizes() == x.sizes()),
                "rms_norm: residual must be contiguous ", x.scalar_type(), " ", x.sizes());
    const auto written = [&](const at::Tensor& t) {
        return t.scalar_type() == x.scalar_type() && t.is_contiguous() && t.sizes() == x.sizes();
    };
    TORCH_CHECK(written(out) && (!residual.defined() || written(sum)), "rms_norm: out (and sum with a residual) "
                "must be contiguous ", x.scalar_type(), " ", x.sizes());
    const int status = qrun_rms_norm(x.scalar_type() == at::kFloat ? 0 : 1, x.data_ptr(),
                                     residual.defined() ? residual.data_ptr() : nullptr, weight.data_ptr(),
                                     out.data_ptr(), residual.defined() ? sum.data_ptr() : nullptr,
                                     hidden ? x.numel() / hidden : 0, hidden, float(eps), at::get_num_threads());
    TORCH_CHECK(status == 0, "rms_norm: no kernel for ", x.scalar_type());
}

void rotate_into(const at::Tensor& x, const at::Tensor& signs, const Optional& odd_factor, bool inverse,
                 at::Tensor& out) {
    const char* name = inverse ? "unrotate" : "rotate";
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                name, ": x must be float32 or bfloat16 [rows, k] with contiguous rows, got ", x.scalar_type(), " ",
                x.sizes());
    TORCH_CHECK(signs.scalar_type() == at::kFloat && signs.is_contiguous() && signs.numel() == x.size(1),
                name, ": signs must be float32 [", x.size(1), "]");
    TORCH_CHECK(!odd_factor || (odd_factor->scalar_type() == at::kFloat && odd_factor->is_contiguous() &&
                                odd_factor->dim() == 2 && odd_factor->size(0) == odd_factor->size(1)),
                name, ": odd_factor must be a square contiguous float32 matrix");
    const int64_t odd = odd_factor ? odd_factor->size(0) : 1;
    TORCH_CHECK(out.is_contiguous() && out.scalar_type() == x.scalar_type() && out.sizes() == x.sizes(), name,
                ": out must be contiguous ", x.scalar_type(), " ", x.sizes());
    const int status = qrun_rotate(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0),
                                   x.scalar_type() == at::kFloat ? 0 : 1, signs.data_ptr<float>(),
                                   odd_factor ? odd_factor->data_ptr<float>() : nullptr, odd, x.size(0), x.size(1),
                                   inverse, at::get_num_threads());
    TORCH_CHECK(status == 0, name, ": ", x.size(1), " inputs are not ", odd, " times a power of two");
}

void gather_columns_into(const at::Tensor& x, const at::Tensor& index, at::Tensor& out) {
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.element_size() == 2 || x.element_size() == 4),
                "gather_columns: x must be [rows, k] of 2- or 4-byte values with contiguous rows, got ",
                x.scalar_type(), " ", x.sizes(), " strides ", x.strides());
    TORCH_CHECK(index.dim() == 1 && index.scalar_type() == at::kLong && index.is_contiguous(),
                "gather_columns: index must be a contiguous int64 vector");
    const int64_t* columns = index.data_ptr<int64_t>();
    const auto [lowest, highest] = std::minmax_element(columns, columns + index.numel());
    TORCH_CHECK(index.numel() == 0 || (*lowest >= 0 && *highest < x.size(1)), "gather_columns: index values from ",
                *lowest, " to ", *highest, " are not columns of a [", x.size(0), ", ", x.size(1), "] x");
    TORCH_CHECK(out.is_contiguous() && out.scalar_type() == x.scalar_type() && out.dim() == 2 &&
                    out.size(0) == x.size(0) && out.size(1) == index.numel(),
                "gather_columns: out must be contiguous ", x.scalar_type(), " [", x.size(0), ", ", index.numel(), "]");
    if (x.element_size() == 2)
        gather_rows(static_cast<const uint16_t*>(x.data_ptr()), x.stride(0), columns, index.numel(),
                    static_cast<uint16_t*>(out.data_ptr()), x.size(0));
    else
        gather_rows(static_cast<const uint32_t*>(x.data_ptr()), x.stride(0), columns, index.numel(),
                    static_cast<uint32_t*>(out.data_ptr()), x.size(0));
}

void half_gemv_into(const at::Tensor& x, const at::Tensor& weight, const Optional& bias, int64_t read_streams,
                    at::Tensor& y) {
    TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
                "half_gemv: x must be float32 or bfloat16 [rows, k] with contiguous rows, got ", x.scalar_type(), " ",
                x.sizes());
    TORCH_CHECK(weight.scalar_type() == at::kHalf && weight.is_contiguous() && weight.dim() == 2 &&
                    weight.size(1) == x.size(1),
                "half_gemv: weight must be a contiguous float16 [n, ", x.size(1), "] matrix");
    TORCH_CHECK(!bias || (bias->scalar_type() == at::kHalf && bias->is_contiguous() && bias->numel() == weight.size(0)),
                "half_gemv: bias must be float16 [", weight.size(0), "]");
    TORCH_CHECK(y.dim() == 2 && y.stride(1) == 1 && y.scalar_type() == x.scalar_type() && y.size(0) == x.size(0) &&
                    y.size(1) == weight.size(0),
                "half_gemv: y must be ", x.scalar_type(), " [", x.size(0), ", ", weight.size(0),
                "] with contiguous rows");
    TORCH_CHECK(read_streams == 1 || read_streams == 2 || read_streams == 4,
                "half_gemv: read_streams must be 1, 2 or 4, got ", read_streams);
    const int status = qrun_half_gemv(x.data_ptr(), x.scalar_type() == at::kFloat ? 0 : 1, x.stride(0),
                                      static_cast<const uint16_t*>(weight.data_ptr()),
                                      bias ? static_cast<const uint16_t*>(bias->data_ptr()) : nullptr, y.data_ptr(),
                                      y.stride(0), x.size(0), weight.size(0), x.size(1), int(read_streams),
                                      at::get_num_threads());
    TORCH_CHECK(status == 0, "half_gemv: ", x.size(0), " rows; it multiplies 1 to 4");
}

bool quant_matmul_on_vnni(int64_t rows, at::ScalarType dtype, int64_t tile_rows, int64_t dequantize_rows) {
    return dtype != at::kBFloat16 ||
           ((dequantize_rows <= 0 || rows < dequantize_rows) && (tile_rows <= 0 || rows < tile_rows));
}

QuantPlanes quant_planes(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                        const at::Tensor& centers, int64_t group, int64_t out_features, const Optional& high_codes,
                        const Optional& high_scales, const Optional& high_zeros, const Optional& high_centers,
                        int64_t k_high, const char* op) {
    // a plane over `inputs` inputs, its codes' width what their size leaves (cpu_quant_planes.h)
    const auto plane = [&](const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                           const at::Tensor& centers, int64_t inputs) {
        const int64_t weights = out_features * inputs;
        const int bits = weights > 0 && codes.numel() * 8 % weights == 0 ? int(codes.numel() * 8 / weights) : 0;
        TORCH_CHECK(codes.is_contiguous() && scales.is_contiguous() && zeros.is_contiguous() &&
                        centers.is_contiguous() && codes.scalar_type() == at::kByte && bits >= 1 && bits <= 4 &&
                        centers.numel() * 32 == inputs && group > 0 && scales.numel() * group == weights &&
                        zeros.numel() == scales.numel(),
                    op, ": packed weights do not match [", out_features, ", ", inputs, "] in groups of ", group,
                    " (", codes.numel(), " bytes of codes, ", scales.numel(), " scales; kernels/cpu_quant_matmul.py's "
                    "pack makes them)");
        return qrun_plane{static_cast<const uint8_t*>(codes.data_ptr()),
                          static_cast<const uint16_t*>(scales.data_ptr()),
                          static_cast<const uint16_t*>(zeros.data_ptr()),
                          static_cast<const int8_t*>(centers.data_ptr()), inputs, bits};
    };
    QuantPlanes planes{plane(codes, scales, zeros, centers, centers.numel() * 32), {}, out_features, group};
    if (high_codes) planes.high = plane(*high_codes, *high_scales, *high_zeros, *high_centers, k_high);
    TORCH_CHECK(qrun_planes_fit(planes.low, planes.high_or_null(), out_features, group), op, ": packed weights do not "
                "fit the layout: [", out_features, ", ", planes.low.k, "] in groups of ", group, ", high plane over ",
                planes.high.k, " inputs");
    return planes;
}

QuantPlanes vnni_planes(const at::Tensor& codes, const at::Tensor& scales, const at::Tensor& zeros,
                       const at::Tensor& centers, int64_t group, int64_t out_features, const Optional& high_codes,
                       const Optional& high_scales, const Optional& high_zeros, const Optional& high_centers,
                       int64_t k_high, int64_t input_digits, int64_t read_streams) {
    TORCH_CHECK(read_streams == 1 || read_streams == 2 || read_streams == 4, "quant_matmul: read_streams must be 1, 2 "
                "or 4 (kernels/cpu_quant_matmul.py's READ_STREAMS), got ", read_streams);
    QuantPlanes planes = quant_planes(codes, scales, zeros, centers, group, out_features, high_codes, high_scales,
                                     high_zeros, high_centers, k_high, "quant_matmul");
    planes.input_digits = input_digits;
    planes.read_streams = read_streams;
    if (!high_codes) return planes;
    const bool upper_digits = qrun_quant_matmul_upper_digits(planes.low.scales, planes.high.scales, out_features,
                                                             planes.low.k, k_high, group) == 1;
    TORCH_CHECK(upper_digits, "quant_matmul: the high plane's scales must be 16x the low plane's over its inputs (it "
                "holds the upper 4 bits of 5-8-bit codes, as qrun/quant.py's cpu_parts packs them)");
    return planes;
}

void quant_matmul_vnni(const QuantPlanes& planes, const at::Tensor& x, at::Tensor& y, bool gated) {
    const bool bfloat16 = x.scalar_type() == at::kBFloat16, widened = bfloat16 && y.scalar_type() == at::kFloat;
    const int64_t columns = gated ? planes.n / 2 : planes.n;
    TORCH_CHECK((bfloat16 || x.scalar_type() == at::kFloat) && x.dim() == 2 && x.is_contiguous() && y.dim() == 2 &&
                    y.is_contiguous() && (y.scalar_type() == x.scalar_type() || (widened && !gated)) &&
                    y.size(0) == x.size(0) && y.size(1) == columns,
                "quant_matmul: x must be contiguous float32 or bfloat16 [rows, k] and y of its dtype (or float32 "
                "for bfloat16 x, not gated) [rows, ", columns, "], got ", x.scalar_type(), " ", x.sizes(), " and ",
                y.scalar_type(), " ", y.sizes());
    TORCH_CHECK(x.size(1) == planes.low.k, "quant_matmul: x ", x.sizes(), " does not match the packed [", planes.n,
                ", ", planes.low.k, "] weight");
    const int status = qrun_quant_matmul(x.data_ptr(), bfloat16, x.stride(0), &planes.low, planes.high_or_null(),
                                         y.data_ptr(), widened ? 2 : bfloat16, gated, y.stride(0), x.size(0), planes.n,
                                         planes.group, planes.input_digits, planes.read_streams,
                                         at::get_num_threads());
    TORCH_CHECK(status == 0, "qrun_quant_matmul cannot multiply [", x.size(0), ", ", planes.low.k, "] by a [",
                planes.n, ", ", planes.low.k, "] weight in groups of ", planes.group, gated ? ", gated" : "",
                " (status ", status, ")");
}

void warm_quant_matmul(const QuantPlanes& planes, int64_t rows, bool gated) {
    qrun_quant_matmul_warm(&planes.low, planes.high_or_null(), gated, rows, planes.n, planes.group,
                           planes.read_streams);
}

void to_bfloat16_into(const at::Tensor& values, at::Tensor& out) {
    TORCH_CHECK(values.scalar_type() == at::kFloat && values.is_contiguous() && out.scalar_type() == at::kBFloat16 &&
                    out.is_contiguous() && out.numel() == values.numel(),
                "to_bfloat16: contiguous float32 values into as many contiguous bfloat16 ones, got ",
                values.scalar_type(), " ", values.sizes(), " and ", out.scalar_type(), " ", out.sizes());
    const float* in = values.data_ptr<float>();
    uint16_t* bits = static_cast<uint16_t*>(out.data_ptr());
    const int64_t count = values.numel();
    qrun_parallel_for(count, at::get_num_threads(), count >= (1 << 15),
                      [&](int64_t i) { bits[i] = qrun_bfloat16_bits(in[i]); });
}

void paged_attention_into(const at::Tensor& queries, int64_t heads, int64_t dim, const at::Tensor& k_cache,
                          const at::Tensor& v_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                          const at::Tensor& query_start_loc, double scale, const Optional& k_scales,
                          const Optional& v_scales, bool prefill_chunks, at::Tensor& out) {
    const auto shaped = [&](const at::Tensor& t) {
        return t.scalar_type() == at::kFloat && t.is_contiguous() && t.dim() == 2 && t.size(1) == heads * dim;
    };
    TORCH_CHECK(shaped(queries) && shaped(out) && out.size(0) == queries.size(0),
                "paged_attention: queries and out must be contiguous float32 [tokens, ", heads, " * ", dim, "]");
    const auto indices = [](const at::Tensor& t) { return t.scalar_type() == at::kInt && t.is_contiguous(); };
    TORCH_CHECK(indices(block_tables) && indices(seq_lens) && indices(query_start_loc),
                "paged_attention: block_tables, seq_lens and query_start_loc must be contiguous int32");
    const int64_t block_size = k_cache.size(1);
    const int64_t group = k_scales.has_value() ? dim / k_scales->size(-2) : dim;
    int64_t block_shift = 0;
    while ((int64_t(1) << block_shift) < block_size) block_shift++;
    const int status = qrun_paged_attention(
        kv_kind(k_cache, k_scales.has_value()), queries.data_ptr<float>(), out.data_ptr<float>(), k_cache.data_ptr(),
        v_cache.data_ptr(), pointer(k_scales), pointer(v_scales), block_tables.data_ptr<int32_t>(),
        block_tables.size(1), seq_lens.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
        block_tables.size(0), heads, k_cache.size(2), dim, block_shift, group, float(scale), int(prefill_chunks),
        at::get_num_threads());
    TORCH_CHECK(status == 0, "qrun_paged_attention rejected a ", k_cache.scalar_type(), " cache of head_dim ", dim,
                " (status ", status, ")");
}

}  // namespace qrun_ops

TORCH_LIBRARY_FRAGMENT(qrun, m) {
    m.def("paged_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor seq_lens, "
          "Tensor query_start_loc, float scale, Tensor? k_scales, Tensor? v_scales) -> Tensor");
    m.def("dequantize_int4pack(Tensor packed, Tensor scale_zero, int group, Tensor(a!) out, bool accumulate) -> ()");
    m.def("quant_matmul(Tensor x, Tensor codes, Tensor scales, Tensor zeros, Tensor centers, int group, "
          "SymInt out_features, Tensor? high_codes, Tensor? high_scales, Tensor? high_zeros, Tensor? high_centers, "
          "int k_high, int input_digits, int tile_rows, int tile_dequantize_rows, int dequantize_rows, "
          "int read_streams) -> Tensor");
    m.def("quant_matmul_available() -> bool", &quant_matmul_available);
    m.def("quant_matmul_tiles_available() -> bool", &quant_matmul_tiles_available);
    m.def("dequantize_planes(Tensor codes, Tensor scales, Tensor zeros, Tensor centers, int group, "
          "int out_features, Tensor? high_codes, Tensor? high_scales, Tensor? high_zeros, Tensor? high_centers, "
          "int k_high) -> Tensor");
    m.def("rotate(Tensor x, Tensor signs, Tensor? odd_factor) -> Tensor");
    m.def("unrotate(Tensor x, Tensor signs, Tensor? odd_factor) -> Tensor");
    m.def("reflect(Tensor x, Tensor u) -> Tensor");
    m.def("apply_rotary(Tensor q, Tensor k, Tensor positions, Tensor cos_sin) -> (Tensor, Tensor)");
    m.def("gather_columns(Tensor x, Tensor index) -> Tensor");
    m.def("silu_and_mul(Tensor gate, Tensor up) -> Tensor");
    m.def("first_max(Tensor rows) -> Tensor");
    m.def("draw(Tensor logits, Tensor temperature, Tensor top_k, Tensor top_p, Tensor min_p, Tensor uniforms) "
          "-> Tensor");
    m.def("mask_logits(Tensor(a!) logits, Tensor bitmask) -> ()");
    m.def("top_logprobs(Tensor logits, Tensor tokens, int top_n) -> (Tensor, Tensor, Tensor)");
    m.def("read_sum(Tensor x, int streams) -> Tensor");
    m.def("multiply_adds(int rounds) -> float", &multiply_adds);  // no tensors to dispatch on: every backend's
    m.def("team_claims(int count, int threads, int holder_spin_ns) -> int[]", &team_claims);
    m.def("team_warm(int threads) -> (int[], int[])", &team_warm);
    m.def("half_gemv(Tensor x, Tensor weight, Tensor? bias, int read_streams=4) -> Tensor");
    m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
    m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> (Tensor, Tensor)");
    m.def("store_kv_quantized(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping, "
          "Tensor(c!) k_scales, Tensor(d!) v_scales) -> ()");
}

TORCH_LIBRARY_IMPL(qrun, CPU, m) {
    m.impl("paged_attention", &paged_attention);
    m.impl("dequantize_int4pack", &dequantize_int4pack);
    m.impl("quant_matmul", &quant_matmul);
    m.impl("dequantize_planes", &dequantize_planes);
    m.impl("rotate", &rotate);
    m.impl("unrotate", &unrotate);
    m.impl("reflect", &reflect);
    m.impl("apply_rotary", &apply_rotary);
    m.impl("gather_columns", &gather_columns);
    m.impl("silu_and_mul", &silu_and_mul);
    m.impl("first_max", &first_max);
    m.impl("draw", &draw);
    m.impl("mask_logits", &mask_logits);
    m.impl("top_logprobs", &top_logprobs);
    m.impl("read_sum", &read_sum);
    m.impl("half_gemv", &half_gemv);
    m.impl("rms_norm", &rms_norm);
    m.impl("add_rms_norm", &add_rms_norm);
    m.impl("store_kv_quantized", &store_kv_quantized);
}

TORCH_LIBRARY_IMPL(qrun, Meta, m) {
    m.impl("paged_attention", &paged_attention_shape);
    m.impl("dequantize_int4pack", &dequantize_int4pack_shape);
    m.impl("quant_matmul", &quant_matmul_shape);
    m.impl("rotate", &rotate_shape);
    m.impl("unrotate", &rotate_shape);
    m.impl("reflect", &reflect_shape);
    m.impl("apply_rotary", &apply_rotary_shape);
    m.impl("gather_columns", &gather_columns_shape);
    m.impl("silu_and_mul", &silu_and_mul_shape);
    m.impl("first_max", &first_max_shape);
    m.impl("draw", &draw_shape);
    m.impl("top_logprobs", &top_logprobs_shape);
    m.impl("half_gemv", &half_gemv_shape);
    m.impl("rms_norm", &rms_norm_shape);
    m.impl("add_rms_norm", &add_rms_norm_shape);
    m.impl("store_kv_quantized", &store_kv_quantized_shape);
}
