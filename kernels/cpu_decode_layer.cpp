// One decoder layer's decode step (every sequence computes one token) in one call: torch.classes.qrun.DecodeLayer.
// Built at load from a qrun.model.DecoderLayer by qrun/cpu_decode.py, which documents why and what it covers.
// The step is the eager layer's, op for op, rounding where eager rounds, so its results are eager's bit for bit:
// rotary and the cache write are a loop here; dense matmuls are torch's ops called from C++; the norms, the 4-bit
// matmul, the rotation, the attention and the SiLU-gated activation are the library's kernels, as in the eager layer.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <type_traits>
#include <vector>

#include "cpu_kernels.h"

// Products and sums rounded where torch's ops round them (fused multiply-adds only where written): a bfloat16
// model's greedy tokens must stay those of eager.
#pragma GCC optimize("fp-contract=off")

namespace {

// How a linear multiplies (qrun/cpu_decode.py builds each).
enum LinearKind : int64_t {
    QUANT = 0,        // the VNNI 4-bit planes of cpu_quant_matmul: weights = low (codes, scales, zeros, centers)
                      // [+ high the same]; bias float32, added in the model's dtype
    DENSE = 1,        // at::linear(x, weights[0], bias)
    HALF_GEMV = 2,    // cpu_linear.CpuDenseLinear: weights = (float16 W, W or oneDNN-packed W[, float16 bias]);
    HALF_GEMV_PACKED = 3,  // ... the second weight prepacked for oneDNN
};

constexpr int64_t GEMV_ROWS = 2;  // cpu_linear.GEMV_ROWS

// The library's torch op `name` (cpu_ops.cpp), looked up once by each caller.
template <typename Signature>
c10::TypedOperatorHandle<Signature> library_op(const char* name) {
    return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

using Optional = std::optional<at::Tensor>;

// A layer's view of the paged cache (qrun/kv_cache.py's LayerKV); scales only for a quantized one.
struct Cache {
    at::Tensor k, v;
    Optional k_scales, v_scales;
};

struct Linear {
    int64_t kind = -1;
    std::vector<at::Tensor> weights;
    std::optional<at::Tensor> bias, perm, signs, odd_factor;
    int64_t out_features = 0, group = 0, k_high = 0, input_digits = 1;
    // QUANT: the op's kernel choice by rows and its streams at one or two (cpu_quant_matmul.py)
    int64_t tile_rows = 0, tile_dequantize_rows = 0, dequantize_rows = 0, read_streams = 0;

    at::Tensor rotate(const at::Tensor& x) const {  // kernels/cpu_rotation.cpp
        static const auto op = library_op<at::Tensor(const at::Tensor&, const at::Tensor&, const Optional&)>(
            "qrun::rotate");
        return op.call(x, *signs, odd_factor);
    }

    // kernels/cpu_quant_matmul.py's quant_matmul op (the VNNI kernel, the AMX one, or oneDNN on the dequantized
    // weight, by the rows), then the bias in x's dtype, as CpuQuantMatmul.forward adds it
    at::Tensor quant_matmul(const at::Tensor& x) const {
        static const auto op = library_op<at::Tensor(
            const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
            c10::SymInt, const Optional&, const Optional&, const Optional&, const Optional&, int64_t, int64_t,
            int64_t, int64_t, int64_t, int64_t)>("qrun::quant_matmul");
        const auto high = [&](size_t i) { return weights.size() > 4 ? Optional(weights[4 + i]) : std::nullopt; };
        const at::Tensor y = op.call(x, weights[0], weights[1], weights[2], weights[3], group,
                                     c10::SymInt(out_features), high(0), high(1), high(2), high(3), k_high,
                                     input_digits, tile_rows, tile_dequantize_rows, dequantize_rows, read_streams);
        return bias ? at::add(y, bias->to(x.scalar_type())) : y;
    }

    at::Tensor onednn(const at::Tensor& x) const {
        static const c10::OperatorHandle op =
            c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
        std::vector<c10::IValue> stack{x, weights[1], bias ? c10::IValue(*bias) : c10::IValue(),
                                       std::string("none"), c10::List<std::optional<at::Scalar>>(),
                                       std::string("")};
        op.callBoxed(&stack);
        return stack[0].toTensor();
    }

    at::Tensor operator()(const at::Tensor& x, bool half_gemv) const {
        at::Tensor in = signs ? rotate(x) : x;
        if (perm) {  // kernels/cpu_quant_matmul.py's gather_columns
            static const auto gather = library_op<at::Tensor(const at::Tensor&, const at::Tensor&)>(
                "qrun::gather_columns");
            in = gather.call(in.contiguous(), *perm);
        }
        switch (kind) {
            case QUANT:
                return quant_matmul(in.contiguous());
            case DENSE:
                return at::linear(in, weights[0], bias);
            default:
                if (half_gemv && in.size(0) <= GEMV_ROWS) {  // kernels/cpu_half_gemv.cpp
                    static const auto op = library_op<at::Tensor(const at::Tensor&, const at::Tensor&,
                                                                 const Optional&)>("qrun::half_gemv");
                    return op.call(in.contiguous(), weights[0], weights.size() > 2 ? Optional(weights[2]) : std::nullopt);
                }
                return kind == HALF_GEMV_PACKED ? onednn(in) : at::linear(in, weights[1], bias);
        }
    }
};

// Rotary position embedding (Hugging Face's half-split layout) of one head, rounded to T.
template <typename T>
inline void rotary(const T* x, const float* cos, const float* sin, int64_t dim, T* out) {
    const int64_t half = dim / 2;
    for (int64_t d = 0; d < half; d++) {
        float first, second;
        qrun_rotary_pair(float(x[d]), float(x[d + half]), cos[d], sin[d], first, second);
        out[d] = T(first);  // c10::BFloat16 and c10::Half round to nearest even
        out[d + half] = T(second);
    }
}

class DecodeLayer : public torch::CustomClassHolder {
  public:
    DecodeLayer(at::Tensor input_norm, at::Tensor post_attention_norm, double eps, int64_t num_heads,
                int64_t num_kv_heads, int64_t head_dim, double scale, at::Tensor k_cache, at::Tensor v_cache,
                Optional k_scales, Optional v_scales)
        : input_norm_(std::move(input_norm)), post_attention_norm_(std::move(post_attention_norm)), eps_(eps),
          num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale),
          cache_{std::move(k_cache), std::move(v_cache), std::move(k_scales), std::move(v_scales)} {}

    // slot: 0 q/k/v (fused), 1 o, 2 gate/up (fused), 3 down.
    void set_linear(int64_t slot, int64_t kind, std::vector<at::Tensor> weights, std::optional<at::Tensor> bias,
                    std::optional<at::Tensor> perm, std::optional<at::Tensor> signs, std::optional<at::Tensor> odd_factor,
                    int64_t out_features, int64_t group, int64_t k_high, int64_t input_digits, int64_t tile_rows,
                    int64_t tile_dequantize_rows, int64_t dequantize_rows, int64_t read_streams) {
        TORCH_CHECK(slot >= 0 && slot < 4 && kind >= QUANT && kind <= HALF_GEMV_PACKED,
                    "DecodeLayer.set_linear: slot ", slot, " kind ", kind);
        linears_[slot] = Linear{kind, std::move(weights), std::move(bias), std::move(perm), std::move(signs),
                                std::move(odd_factor), out_features, group, k_high, input_digits, tile_rows,
                                tile_dequantize_rows, dequantize_rows, read_streams};
    }

    std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& residual,
                                               const at::Tensor& positions, const at::Tensor& cos_sin,
                                               const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                               bool half_gemv) const {
        std::tuple<at::Tensor, at::Tensor> result;
        AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "decode_layer", [&] {
            result = step<scalar_t>(x, residual, positions, cos_sin, slot_mapping, block_tables, seq_lens,
                                    query_start_loc, half_gemv);
        });
        return result;
    }

    // A quantized cache's transforms (qrun/kv_cache.py's LayerKV): queries times their balance, keys centred on
    // their layer's mean and times theirs (all three or none), both reflected by `key_reflection` (float32 [kv heads,
    // head_dim]; none: not), then q, k and v rotated (the attention's output rotated back) by
    // kernels/cpu_rotation.cpp with `signs` and `odd_factor`.
    void set_cache_transforms(std::optional<at::Tensor> signs, std::optional<at::Tensor> odd_factor,
                              std::optional<at::Tensor> key_mean, std::optional<at::Tensor> key_balance,
                              std::optional<at::Tensor> query_balance, std::optional<at::Tensor> key_reflection) {
        const auto shaped = [&](const std::optional<at::Tensor>& t, int64_t heads) {
            return t && t->is_contiguous() && t->numel() == heads * head_dim_;
        };
        TORCH_CHECK((!key_mean && !key_balance && !query_balance) ||
                        (shaped(key_mean, num_kv_heads_) && shaped(key_balance, num_kv_heads_) &&
                         shaped(query_balance, num_heads_)),
                    "DecodeLayer.set_cache_transforms: key_mean and key_balance must be contiguous [kv heads, "
                    "head_dim], query_balance [heads, head_dim], all three or none");
        TORCH_CHECK(!key_reflection || (shaped(key_reflection, num_kv_heads_) &&
                                        key_reflection->scalar_type() == at::kFloat),
                    "DecodeLayer.set_cache_transforms: key_reflection must be contiguous float32 [kv heads, "
                    "head_dim]");
        rotation_signs_ = std::move(signs);
        rotation_odd_factor_ = std::move(odd_factor);
        key_mean_ = std::move(key_mean);
        key_balance_ = std::move(key_balance);
        query_balance_ = std::move(query_balance);
        key_reflection_ = std::move(key_reflection);
    }

  private:
    template <typename T>
    std::tuple<at::Tensor, at::Tensor> step(const at::Tensor& x_in, const at::Tensor& residual_in,
                                            const at::Tensor& positions, const at::Tensor& cos_sin,
                                            const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                            const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                            bool half_gemv) const {
        const at::Tensor x = x_in.contiguous();
        const int64_t rows = x.size(0), dim = head_dim_;
        auto [normed, residual] = add_rms_norm(x, residual_in.contiguous(), input_norm_);

        const at::Tensor qkv = linears_[0](normed, half_gemv).contiguous();
        const at::Tensor attended = cache_.k_scales ? quantized_attention<T>(qkv, positions, cos_sin, slot_mapping,
                                                                             block_tables, seq_lens, query_start_loc)
                                                    : float_attention<T>(qkv, positions, cos_sin, slot_mapping,
                                                                         block_tables, seq_lens, query_start_loc);
        const at::Tensor projected = linears_[1](attended.view({rows, num_heads_ * dim}), half_gemv).contiguous();
        std::tie(normed, residual) = add_rms_norm(projected, residual, post_attention_norm_);

        const at::Tensor gate_up = linears_[2](normed, half_gemv).contiguous();
        const int64_t inner = gate_up.size(1) / 2;  // kernels/cpu_activation.cpp
        const at::Tensor gated = at::empty({rows, inner}, gate_up.options());
        qrun_silu_and_mul(std::is_same_v<T, float> ? QRUN_F32 : QRUN_BF16, gate_up.data_ptr(),
                          static_cast<const T*>(gate_up.data_ptr()) + inner, gate_up.size(1), gated.data_ptr(), rows,
                          inner, at::get_num_threads());
        return {linears_[3](gated, half_gemv), residual};
    }

    at::Tensor attention(const at::Tensor& queries, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                         const at::Tensor& query_start_loc) const {  // kernels/cpu_attention.cpp
        static const auto op = library_op<at::Tensor(
            const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
            const at::Tensor&, double, const Optional&, const Optional&)>("qrun::decode_attention");
        return op.call(queries, cache_.k, cache_.v, block_tables, seq_lens, query_start_loc, scale_, cache_.k_scales,
                       cache_.v_scales);
    }

    // A float cache: rotary and the cache write in one loop, the attention over it; its output in T.
    template <typename T>
    at::Tensor float_attention(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin,
                               const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc) const {
        at::Tensor queries = at::empty({qkv.size(0), num_heads_, head_dim_}, qkv.options().dtype(at::kFloat));
        write_keys_values<T>(qkv, positions, cos_sin, slot_mapping, cache_.k, cache_.v, queries);
        return attention(queries, block_tables, seq_lens, query_start_loc).to(qkv.scalar_type());
    }

    // A quantized cache: the eager layer's ops in its order (qrun/model.py's Attention.heads), so the same bytes
    // reach the cache: rotary rounded to T, the balances and the key mean (each result rounded to T, as torch's
    // ops round), the rotation, the quantizing store (kernels/cpu_kv_store.cpp), the attention over the quantized
    // cache, its output rotated back.
    template <typename T>
    at::Tensor quantized_attention(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin,
                                   const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                   const at::Tensor& seq_lens, const at::Tensor& query_start_loc) const {
        static const auto store = library_op<void(const at::Tensor&, const at::Tensor&, at::Tensor&, at::Tensor&,
                                                  const at::Tensor&, at::Tensor&, at::Tensor&)>(
            "qrun::store_kv_quantized");
        const int64_t rows = qkv.size(0), dim = head_dim_;
        const at::Tensor queries = at::empty({rows, num_heads_, dim}, qkv.options());
        const at::Tensor keys = at::empty({rows, num_kv_heads_, dim}, qkv.options());
        const at::Tensor values = qkv.narrow(1, (num_heads_ + num_kv_heads_) * dim, num_kv_heads_ * dim)
                                      .contiguous().view({rows, num_kv_heads_, dim});
        const bool calibrated = key_mean_.has_value();
        rotated_heads<T>(
            qkv, positions, cos_sin,
            [&](int64_t r, int64_t h, const T* q) {
                T* out = queries.data_ptr<T>() + (r * num_heads_ + h) * dim;
                const T* balance = calibrated ? query_balance_->data_ptr<T>() + h * dim : nullptr;
                for (int64_t d = 0; d < dim; d++) out[d] = calibrated ? T(float(q[d]) * float(balance[d])) : q[d];
            },
            [&](int64_t r, int64_t h, const T* k) {
                T* out = keys.data_ptr<T>() + (r * num_kv_heads_ + h) * dim;
                if (!calibrated) return void(std::copy(k, k + dim, out));
                const T* mean = key_mean_->data_ptr<T>() + h * dim;
                const T* balance = key_balance_->data_ptr<T>() + h * dim;
                for (int64_t d = 0; d < dim; d++)
                    out[d] = T(float(T(float(k[d]) - float(mean[d]))) * float(balance[d]));
            });
        if (key_reflection_)  // in place, by the kernel the eager layers' reflect runs
            for (const at::Tensor& heads : {queries, keys})
                qrun_reflect(heads.data_ptr(), heads.data_ptr(), std::is_same_v<T, float> ? 0 : 1,
                             key_reflection_->data_ptr<float>(), rows, heads.size(1), num_kv_heads_, dim,
                             at::get_num_threads());
        for (const at::Tensor& heads : {queries, keys, values}) rotate_heads<T>(heads, false);
        at::Tensor k_cache = cache_.k, v_cache = cache_.v, k_scales = *cache_.k_scales, v_scales = *cache_.v_scales;
        store.call(keys, values, k_cache, v_cache, slot_mapping, k_scales, v_scales);
        const at::Tensor attended = attention(queries, block_tables, seq_lens, query_start_loc)
                                        .to(qkv.scalar_type());
        rotate_heads<T>(attended, true);
        return attended;
    }

    // Every head_dim_ row of the contiguous `heads` rotated in place (inverse: rotated back), as the kernel table's
    // rotate / unrotate ops do it; nothing without a rotation.
    template <typename T>
    void rotate_heads(const at::Tensor& heads, bool inverse) const {
        if (!rotation_signs_) return;
        const int64_t odd = rotation_odd_factor_ ? rotation_odd_factor_->size(0) : 1;
        const int status = qrun_rotate(heads.data_ptr(), head_dim_, heads.data_ptr(), head_dim_,
                                       std::is_same_v<T, float> ? 0 : 1, rotation_signs_->data_ptr<float>(),
                                       rotation_odd_factor_ ? rotation_odd_factor_->data_ptr<float>() : nullptr, odd,
                                       heads.numel() / head_dim_, head_dim_, inverse, at::get_num_threads());
        TORCH_CHECK(status == 0, "DecodeLayer: no rotation of ", head_dim_, " values");
    }

    // kernels/cpu_norm.cpp, as the eager layers' RMSNorm on the CPU: (normed, x + residual)
    std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& residual,
                                                    const at::Tensor& weight) const {
        static const auto op = library_op<std::tuple<at::Tensor, at::Tensor>(
            const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>("qrun::add_rms_norm");
        return op.call(x, residual, weight, eps_);
    }

    // Rotary (rounded to T) of every row's query and key heads, each handed to query(row, head, rotated) or
    // key(row, kv head, rotated).
    template <typename T, typename Query, typename Key>
    void rotated_heads(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin, Query query,
                       Key key) const {
        const int64_t dim = head_dim_, width = qkv.size(1);
        const int64_t* pos = positions.data_ptr<int64_t>();
        std::vector<T> rotated(dim);
        for (int64_t r = 0; r < qkv.size(0); r++) {
            const T* row = qkv.data_ptr<T>() + r * width;
            const float* cos = cos_sin.data_ptr<float>() + pos[r] * dim;
            for (int64_t h = 0; h < num_heads_ + num_kv_heads_; h++) {
                rotary(row + h * dim, cos, cos + dim / 2, dim, rotated.data());
                if (h < num_heads_)
                    query(r, h, rotated.data());
                else
                    key(r, h - num_heads_, rotated.data());
            }
        }
    }

    // Rotary on q and k; k and v into their cache slots (in the cache's dtype), q (rounded to T) into `queries`.
    template <typename T>
    void write_keys_values(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin,
                           const at::Tensor& slot_mapping, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           at::Tensor& queries) const {
        const int64_t dim = head_dim_, width = qkv.size(1);
        const int64_t* slots = slot_mapping.data_ptr<int64_t>();
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "decode_layer_cache", [&] {
            scalar_t* k_out = k_cache.data_ptr<scalar_t>();
            scalar_t* v_out = v_cache.data_ptr<scalar_t>();
            rotated_heads<T>(
                qkv, positions, cos_sin,
                [&](int64_t r, int64_t h, const T* q) {
                    float* out = queries.data_ptr<float>() + (r * num_heads_ + h) * dim;
                    for (int64_t d = 0; d < dim; d++) out[d] = float(q[d]);
                },
                [&](int64_t r, int64_t h, const T* k) {
                    const int64_t at = (slots[r] * num_kv_heads_ + h) * dim;
                    const T* v = qkv.data_ptr<T>() + r * width + (num_heads_ + num_kv_heads_ + h) * dim;
                    for (int64_t d = 0; d < dim; d++) {
                        k_out[at + d] = scalar_t(float(k[d]));
                        v_out[at + d] = scalar_t(float(v[d]));
                    }
                });
        });
    }

    std::optional<at::Tensor> rotation_signs_, rotation_odd_factor_, key_mean_, key_balance_, query_balance_,
        key_reflection_;
    at::Tensor input_norm_, post_attention_norm_;
    double eps_;
    int64_t num_heads_, num_kv_heads_, head_dim_;
    double scale_;
    Cache cache_;
    Linear linears_[4];
};

// Every decoder layer's decode step, in order, in one call: a call from Python costs ~25 us, 30 of them ~10% of a
// 4.0-bpw SmolLM2 step at batch 1.
class DecodeStack : public torch::CustomClassHolder {
  public:
    explicit DecodeStack(at::Tensor cos_sin) : cos_sin_(std::move(cos_sin)) {}

    void add_layer(c10::intrusive_ptr<DecodeLayer> layer) { layers_.push_back(std::move(layer)); }

    // (x, residual) after the last layer; the cos/sin table is the model's (qrun/model.py's Transformer.cos_sin).
    std::tuple<at::Tensor, at::Tensor> forward(at::Tensor x, at::Tensor residual, const at::Tensor& positions,
                                               const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                                               const at::Tensor& seq_lens, const at::Tensor& query_start_loc,
                                               bool half_gemv) const {
        for (const auto& layer : layers_)
            std::tie(x, residual) = layer->forward(x, residual, positions, cos_sin_, slot_mapping, block_tables,
                                                   seq_lens, query_start_loc, half_gemv);
        return {x, residual};
    }

  private:
    at::Tensor cos_sin_;
    std::vector<c10::intrusive_ptr<DecodeLayer>> layers_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(qrun, m) {
    m.class_<DecodeLayer>("DecodeLayer")
        .def(torch::init<at::Tensor, at::Tensor, double, int64_t, int64_t, int64_t, double, at::Tensor, at::Tensor,
                         Optional, Optional>())
        .def("set_linear", &DecodeLayer::set_linear)
        .def("set_cache_transforms", &DecodeLayer::set_cache_transforms);
    m.class_<DecodeStack>("DecodeStack")
        .def(torch::init<at::Tensor>())
        .def("add_layer", &DecodeStack::add_layer)
        .def("forward", &DecodeStack::forward);
}
