// A model's step in one call (decode rows, and prefill chunks beside them): torch.classes.qrun.StepLayer runs one
// decoder layer, StepModel the embedding, every layer in order, the final norm and the head of the rows that
// sample. Built at load from a qrun.model.Transformer by qrun/cpu_model.py, which documents why and what it covers.
// The step is the eager model's, op for op, rounding where eager rounds, so its results are eager's bit for bit:
// rotary and the cache write are a loop here; dense matmuls are torch's ops called from C++; the norms, the 4-bit
// matmul, the rotation, the attention and the SiLU-gated activation are the library's kernels, as in the eager layer,
// called directly (cpu_ops.h) with outputs in the StepModel's Workspace.

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/add.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/linear.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <cstdint>
#include <limits>
#include <numeric>
#include <optional>
#include <tuple>
#include <type_traits>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "cpu_kernels.h"
#include "cpu_ops.h"

// Products and sums rounded where torch's ops round them (fused multiply-adds only where written): a bfloat16
// model's greedy tokens must stay those of eager.
#pragma GCC optimize("fp-contract=off")

namespace {

// How a linear multiplies (qrun/cpu_model.py builds each).
enum LinearKind : int64_t {
    QUANT = 0,        // the VNNI 4-bit planes of cpu_quant_matmul: weights = low (codes, scales, zeros, centers)
                      // [+ high the same]; bias float32, added in the model's dtype
    DENSE = 1,        // at::linear(x, weights[0], bias)
    HALF_GEMV = 2,    // cpu_linear.CpuDenseLinear: weights = (float16 W, W or oneDNN-packed W[, float16 bias]);
    HALF_GEMV_PACKED = 3,  // ... the second weight prepacked for oneDNN
    DEQUANTIZED = 4,  // CpuQuantMatmul's fallback where the planes do not fit (a vocabulary not a multiple of 16):
                      // weights = (bfloat16 W), multiplied in bfloat16; bias float32, added in the model's dtype
};

constexpr int64_t MAX_HEAD_DIM = 256;  // cpu_attention.HEAD_DIMS' largest

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

// The step's inputs every layer reads, converted once for the StepModel: positions and slots int64, the rest int32;
// whether some sequence has more than one query (a prefill chunk).
struct StepMeta {
    at::Tensor positions, slot_mapping, block_tables, seq_lens, query_start_loc;
    bool prefill_chunks;
};

// The tensors a step writes, kept by the model between steps and shared by its layers, which run in turn. At
// one row a fresh tensor for each op's output cost ~1-2 us (~20 a layer), as much as the norms' and the activation's
// arithmetic many times over. A buffer is reallocated only when its rows or dtype change; `width` tells apart the
// uses of one slot by linears of other shapes (a rotated input of 576 values or of 1536).
class Workspace {
  public:
    enum Slot { EMBEDDED, NORMED, RESIDUAL, QKV, QUERIES, ATTENTION, ATTENDED, PROJECTED, GATE_UP, GATED, HIDDEN,
                ROTATED, GATHERED, LOGITS };

    // Whether `tensor` shares memory with one of the buffers.
    bool holds(const at::Tensor& tensor) const {
        return std::any_of(buffers_.begin(), buffers_.end(),
                           [&](const Buffer& buffer) { return tensor.is_alias_of(buffer.tensor); });
    }

    at::Tensor get(Slot slot, int64_t rows, int64_t width, at::ScalarType dtype) {
        for (Buffer& buffer : buffers_)
            if (buffer.slot == slot && buffer.width == width) {
                if (buffer.tensor.size(0) != rows || buffer.tensor.scalar_type() != dtype)
                    buffer.tensor = at::empty({rows, width}, at::TensorOptions().dtype(dtype));
                return buffer.tensor;
            }
        buffers_.push_back({slot, width, at::empty({rows, width}, at::TensorOptions().dtype(dtype))});
        return buffers_.back().tensor;
    }

  private:
    struct Buffer {
        Slot slot;
        int64_t width;
        at::Tensor tensor;
    };
    std::vector<Buffer> buffers_;
};

using Slot = Workspace::Slot;

// x itself when its rows are contiguous already (a check, not a dispatch)
at::Tensor contiguous(const at::Tensor& x) { return x.is_contiguous() ? x : x.contiguous(); }

struct Linear {
    int64_t kind = -1;
    std::vector<at::Tensor> weights;
    std::optional<at::Tensor> bias, perm, signs, odd_factor;
    int64_t out_features = 0, group = 0, k_high = 0, input_digits = 1;
    // QUANT: the op's kernel choice by rows (cpu_quant_matmul.py); QUANT and HALF_GEMV*: the streams each thread
    // reads at one or two rows (read_streams.py); HALF_GEMV*: the most rows the float16 GEMV takes (cpu_linear.py)
    int64_t tile_rows = 0, tile_dequantize_rows = 0, dequantize_rows = 0, read_streams = 0, gemv_rows = 0;
    qrun_ops::QuantPlanes vnni;  // QUANT: the weights as the VNNI kernel reads them, checked once

    // kernels/cpu_quant_matmul.py's quant_matmul op (the VNNI kernel, the AMX one, or oneDNN on the dequantized
    // weight, by the rows), then the bias in x's dtype, as CpuQuantMatmul.forward adds it
    at::Tensor quant_matmul(const at::Tensor& x) const {
        static const auto op = library_op<at::Tensor(
            const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t,
            c10::SymInt, const Optional&, const Optional&, const Optional&, const Optional&, int64_t, int64_t,
            int64_t, int64_t, int64_t, int64_t)>("qrun::quant_matmul");
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

    // What operator() gives: the product in x's dtype; WIDENED (where widens() allows it) a new float32 tensor of the
    // bfloat16 product's values, written by the VNNI kernel as it stores them; GATED (where gates() allows it) silu of
    // the product's first half of the columns times its second, as the VNNI kernel stores them.
    enum Product { AS_INPUT, WIDENED, GATED };

    // The product of x [rows, in] (contiguous): where a kernel of the library multiplies (the VNNI kernel, the
    // float16 GEMV), into the workspace's slot `out`; else a new tensor. The input rotation and act order's gather
    // go to the workspace too.
    at::Tensor operator()(const at::Tensor& x, bool half_gemv, Workspace& workspace, Slot out,
                          Product product = AS_INPUT) const {
        const int64_t rows = x.size(0);
        const at::ScalarType dtype = x.scalar_type();
        TORCH_CHECK(product == AS_INPUT ||
                        (product == WIDENED ? widens(rows, dtype, half_gemv) : gates(rows, dtype, half_gemv)),
                    "StepLayer: a widened or gated product needs the VNNI kernel and no bias (widens() and gates() say "
                    "where)");
        at::Tensor in = x;
        if (signs) {  // kernels/cpu_rotation.cpp
            at::Tensor rotated = workspace.get(Workspace::ROTATED, rows, in.size(1), in.scalar_type());
            qrun_ops::rotate_into(in, *signs, odd_factor, false, rotated);
            in = rotated;
        }
        if (perm) {  // kernels/cpu_quant_matmul.py's gather_columns
            at::Tensor gathered = workspace.get(Workspace::GATHERED, rows, perm->numel(), in.scalar_type());
            qrun_ops::gather_columns_into(in, *perm, gathered);
            in = gathered;
        }
        switch (kind) {
            case QUANT: {
                if (!on_library_kernel(rows, in.scalar_type(), half_gemv)) return quant_matmul(in);
                at::Tensor y = product == WIDENED
                                   ? at::empty({rows, out_features}, in.options().dtype(at::kFloat))
                                   : workspace.get(out, rows, out_features / (product == GATED ? 2 : 1),
                                                   in.scalar_type());
                qrun_ops::quant_matmul_vnni(vnni, in, y, product == GATED);
                return bias ? y.add_(bias->to(y.scalar_type())) : y;  // as CpuQuantMatmul.forward adds it
            }
            case DENSE:
                return at::linear(in, weights[0], bias);
            case DEQUANTIZED: {  // as CpuQuantMatmul.forward
                const at::Tensor y = at::linear(in.to(at::kBFloat16), weights[0]).to(x.scalar_type());
                return bias ? at::add(y, bias->to(y.scalar_type())) : y;
            }
            default:
                if (half_gemv && rows <= gemv_rows) {  // kernels/cpu_half_gemv.cpp
                    at::Tensor y = workspace.get(out, rows, out_features, in.scalar_type());
                    qrun_ops::half_gemv_into(in, weights[0], weights.size() > 2 ? Optional(weights[2]) : std::nullopt,
                                             read_streams, y);
                    return y;
                }
                return kind == HALF_GEMV_PACKED ? onednn(in) : at::linear(in, weights[1], bias);
        }
    }

    // Where `rows` rows of `dtype` multiply on the VNNI kernel with a team held, the weights it reads first fetched
    // into the other threads' caches while the holder runs the serial work before it (QrunTeam::warm): called where
    // that work begins. gated: as operator() will be asked.
    void warm(int64_t rows, at::ScalarType dtype, bool half_gemv, bool gated = false) const {
        if (kind == QUANT && on_library_kernel(rows, dtype, half_gemv)) qrun_ops::warm_quant_matmul(vnni, rows, gated);
    }

    Optional high(size_t i) const { return weights.size() > 4 ? Optional(weights[4 + i]) : std::nullopt; }

    // The most rows that may take the float16 GEMV: none but a dense linear's.
    int64_t max_gemv_rows() const { return kind == HALF_GEMV || kind == HALF_GEMV_PACKED ? gemv_rows : 0; }

    // Whether `rows` rows of `dtype` may ask operator() for their product widened to float32: bfloat16 rows.
    bool widens(int64_t rows, at::ScalarType dtype, bool half_gemv) const {
        return dtype == at::kBFloat16 && stores_last(rows, dtype, half_gemv);
    }

    // Whether `rows` rows of `dtype` may ask operator() for their product GATED: float32 or bfloat16 rows, a multiple
    // of 32 columns (whole channel tiles in each half).
    bool gates(int64_t rows, at::ScalarType dtype, bool half_gemv) const {
        return (dtype == at::kBFloat16 || dtype == at::kFloat) && out_features % 32 == 0 &&
               stores_last(rows, dtype, half_gemv);
    }

    // Whether the VNNI kernel multiplies `rows` rows of `dtype` with nothing added to its stores after (no bias): where
    // it may store the product in another form than x's (widens(), gates()).
    bool stores_last(int64_t rows, at::ScalarType dtype, bool half_gemv) const {
        return kind == QUANT && !bias && on_library_kernel(rows, dtype, half_gemv);
    }

    // Whether `rows` rows of `dtype` multiply on a kernel of the library (the VNNI kernel, the float16 GEMV), which
    // splits its work over a held team (QrunTeam), rather than on torch's ops (AMX tiles and oneDNN among them)
    bool on_library_kernel(int64_t rows, at::ScalarType dtype, bool half_gemv) const {
        if (kind == QUANT) return qrun_ops::quant_matmul_on_vnni(rows, dtype, tile_rows, dequantize_rows);
        return half_gemv && rows <= max_gemv_rows();
    }
};

// A linear from StepLayer.set_linear's (or StepModel.set_head's) arguments, its VNNI planes checked once.
Linear make_linear(int64_t kind, std::vector<at::Tensor> weights, Optional bias, Optional perm, Optional signs,
                   Optional odd_factor, int64_t out_features, int64_t group, int64_t k_high, int64_t input_digits,
                   int64_t tile_rows, int64_t tile_dequantize_rows, int64_t dequantize_rows, int64_t read_streams,
                   int64_t gemv_rows) {
    TORCH_CHECK(kind >= QUANT && kind <= DEQUANTIZED, "StepLayer: no linear of kind ", kind);
    Linear linear{kind, std::move(weights), std::move(bias), std::move(perm), std::move(signs),
                  std::move(odd_factor), out_features, group, k_high, input_digits, tile_rows,
                  tile_dequantize_rows, dequantize_rows, read_streams, gemv_rows};
    if (kind == QUANT)
        linear.vnni = qrun_ops::vnni_planes(linear.weights[0], linear.weights[1], linear.weights[2],
                                            linear.weights[3], group, out_features, linear.high(0), linear.high(1),
                                            linear.high(2), linear.high(3), k_high, input_digits, read_streams);
    return linear;
}

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

class StepLayer : public torch::CustomClassHolder {
  public:
    StepLayer(at::Tensor input_norm, at::Tensor post_attention_norm, double eps, int64_t num_heads,
              int64_t num_kv_heads, int64_t head_dim, double scale, at::Tensor k_cache, at::Tensor v_cache,
              Optional k_scales, Optional v_scales)
        : input_norm_(std::move(input_norm)), post_attention_norm_(std::move(post_attention_norm)), eps_(eps),
          num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale),
          cache_{std::move(k_cache), std::move(v_cache), std::move(k_scales), std::move(v_scales)} {}

    // slot: 0 q/k/v (fused), 1 o, 2 gate/up (fused), 3 down.
    void set_linear(int64_t slot, int64_t kind, std::vector<at::Tensor> weights, std::optional<at::Tensor> bias,
                    std::optional<at::Tensor> perm, std::optional<at::Tensor> signs, std::optional<at::Tensor> odd_factor,
                    int64_t out_features, int64_t group, int64_t k_high, int64_t input_digits, int64_t tile_rows,
                    int64_t tile_dequantize_rows, int64_t dequantize_rows, int64_t read_streams, int64_t gemv_rows) {
        TORCH_CHECK(slot >= 0 && slot < 4, "StepLayer.set_linear: no slot ", slot);
        linears_[slot] = make_linear(kind, std::move(weights), std::move(bias), std::move(perm), std::move(signs),
                                     std::move(odd_factor), out_features, group, k_high, input_digits, tile_rows,
                                     tile_dequantize_rows, dequantize_rows, read_streams, gemv_rows);
    }

    int64_t max_gemv_rows() const {
        int64_t most = 0;
        for (const Linear& linear : linears_) most = std::max(most, linear.max_gemv_rows());
        return most;
    }

    bool on_library_kernels(int64_t rows, at::ScalarType dtype, bool half_gemv) const {
        return std::all_of(std::begin(linears_), std::end(linears_), [&](const Linear& linear) {
            return linear.on_library_kernel(rows, dtype, half_gemv);
        });
    }

    // (x, residual) after the layer; both may be the workspace's, which the next layer's step overwrites.
    std::tuple<at::Tensor, at::Tensor> forward(const at::Tensor& x, const at::Tensor& residual,
                                               const at::Tensor& cos_sin, const StepMeta& meta, bool half_gemv,
                                               Workspace& workspace) const {
        std::tuple<at::Tensor, at::Tensor> result;
        AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "step_layer", [&] {
            result = step<scalar_t>(x, residual, cos_sin, meta, half_gemv, workspace);
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
                    "StepLayer.set_cache_transforms: key_mean and key_balance must be contiguous [kv heads, "
                    "head_dim], query_balance [heads, head_dim], all three or none");
        TORCH_CHECK(!key_reflection || (shaped(key_reflection, num_kv_heads_) &&
                                        key_reflection->scalar_type() == at::kFloat),
                    "StepLayer.set_cache_transforms: key_reflection must be contiguous float32 [kv heads, "
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
                                            const at::Tensor& cos_sin, const StepMeta& meta, bool half_gemv,
                                            Workspace& workspace) const {
        const at::Tensor x = contiguous(x_in);
        const int64_t rows = x.size(0), hidden = x.size(1);
        linears_[0].warm(rows, x.scalar_type(), half_gemv);
        at::Tensor normed = workspace.get(Workspace::NORMED, rows, hidden, x.scalar_type());
        at::Tensor residual = workspace.get(Workspace::RESIDUAL, rows, hidden, x.scalar_type());  // may be residual_in
        qrun_ops::add_rms_norm_into(x, contiguous(residual_in), input_norm_, eps_, normed, residual);

        const at::Tensor qkv = contiguous(linears_[0](normed, half_gemv, workspace, Workspace::QKV));
        const at::Tensor attended = cache_.k_scales ? quantized_attention<T>(qkv, cos_sin, meta, workspace)
                                                    : float_attention<T>(qkv, cos_sin, meta, workspace);
        linears_[1].warm(rows, attended.scalar_type(), half_gemv);
        const at::Tensor projected = contiguous(linears_[1](attended, half_gemv, workspace, Workspace::PROJECTED));
        linears_[2].warm(rows, x.scalar_type(), half_gemv, linears_[2].gates(rows, x.scalar_type(), half_gemv));
        qrun_ops::add_rms_norm_into(projected, residual, post_attention_norm_, eps_, normed, residual);

        return {linears_[3](gated<T>(normed, half_gemv, workspace), half_gemv, workspace, Workspace::HIDDEN),
                residual};
    }

    // silu(gate) * up of the fused gate/up product of `normed`: stored so by the VNNI kernel where it multiplies,
    // else by kernels/cpu_activation.cpp after the product. The pass of its own ran on the calling thread alone at a
    // few rows (1.2-1.7 us of a ~80 us layer at one row, on a 2-core Xeon); C++ steps of a 4.0-bpw SmolLM2 with the
    // kernel storing it, alternating with that pass in one process (one-off probes, 10-16 rounds): one row of 200
    // tokens 1.008x and 1.009x, of 1,000 0.98x, 1.026x and 1.009x; two rows of 300 0.94x, 1.027x and 1.028x; 8 rows of
    // 300 1.011x.
    template <typename T>
    at::Tensor gated(const at::Tensor& normed, bool half_gemv, Workspace& workspace) const {
        const Linear& gate_up = linears_[2];
        const int64_t rows = normed.size(0);
        if (gate_up.gates(rows, normed.scalar_type(), half_gemv)) {
            const at::Tensor out = gate_up(normed, half_gemv, workspace, Workspace::GATED, Linear::GATED);
            linears_[3].warm(rows, out.scalar_type(), half_gemv);
            return out;
        }
        const at::Tensor product = contiguous(gate_up(normed, half_gemv, workspace, Workspace::GATE_UP));
        linears_[3].warm(rows, normed.scalar_type(), half_gemv);
        const int64_t inner = product.size(1) / 2;  // kernels/cpu_activation.cpp
        const at::Tensor out = workspace.get(Workspace::GATED, rows, inner, normed.scalar_type());
        qrun_silu_and_mul(std::is_same_v<T, float> ? QRUN_F32 : QRUN_BF16, product.data_ptr(),
                          static_cast<const T*>(product.data_ptr()) + inner, product.size(1), out.data_ptr(), rows,
                          inner, at::get_num_threads());
        return out;
    }

    // float32 [rows, heads * head_dim] queries' attention over the cache (kernels/cpu_attention.cpp), float32.
    at::Tensor attention(const at::Tensor& queries, const StepMeta& meta, Workspace& workspace) const {
        at::Tensor out = workspace.get(Workspace::ATTENTION, queries.size(0), num_heads_ * head_dim_, at::kFloat);
        qrun_ops::paged_attention_into(queries, num_heads_, head_dim_, cache_.k, cache_.v, meta.block_tables,
                                       meta.seq_lens, meta.query_start_loc, scale_, cache_.k_scales, cache_.v_scales,
                                       meta.prefill_chunks, out);
        return out;
    }

    // The attention's float32 output in T, as the eager layer's `.to` rounds it.
    template <typename T>
    at::Tensor in_model_dtype(const at::Tensor& attended, Workspace& workspace) const {
        if constexpr (std::is_same_v<T, float>) return attended;
        if constexpr (!std::is_same_v<T, c10::BFloat16>) return attended.to(c10::CppTypeToScalarType<T>::value);
        at::Tensor out = workspace.get(Workspace::ATTENDED, attended.size(0), attended.size(1), at::kBFloat16);
        qrun_ops::to_bfloat16_into(attended, out);
        return out;
    }

    // A float cache: rotary and the cache write in one loop, the attention over it; its output in T.
    template <typename T>
    at::Tensor float_attention(const at::Tensor& qkv, const at::Tensor& cos_sin, const StepMeta& meta,
                               Workspace& workspace) const {
        at::Tensor queries = workspace.get(Workspace::QUERIES, qkv.size(0), num_heads_ * head_dim_, at::kFloat);
        write_keys_values<T>(qkv, meta.positions, cos_sin, meta.slot_mapping, cache_.k, cache_.v, queries);
        return in_model_dtype<T>(attention(queries, meta, workspace), workspace);
    }

    // A quantized cache: the eager layer's ops in its order (qrun/model.py's Attention.heads), so the same bytes
    // reach the cache: rotary rounded to T, the balances and the key mean (each result rounded to T, as torch's
    // ops round), the rotation, the quantizing store (kernels/cpu_kv_store.cpp), the attention over the quantized
    // cache, its output rotated back.
    template <typename T>
    at::Tensor quantized_attention(const at::Tensor& qkv, const at::Tensor& cos_sin, const StepMeta& meta,
                                   Workspace& workspace) const {
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
            qkv, meta.positions, cos_sin,
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
        store.call(keys, values, k_cache, v_cache, meta.slot_mapping, k_scales, v_scales);
        const at::Tensor attended = attention(queries.view({rows, -1}).to(at::kFloat), meta, workspace)
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
        TORCH_CHECK(status == 0, "StepLayer: no rotation of ", head_dim_, " values");
    }

    // Rotary (rounded to T) of every row's query and key heads, each handed to query(row, head, rotated) or
    // key(row, kv head, rotated).
    template <typename T, typename Query, typename Key>
    void rotated_heads(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin, Query query,
                       Key key) const {
        const int64_t dim = head_dim_, width = qkv.size(1);
        const int64_t* pos = positions.data_ptr<int64_t>();
        const T* rows = qkv.data_ptr<T>();
        const float* table = cos_sin.data_ptr<float>();
        // each row's heads apart from the others' (its own cache slots): split where a prefill chunk brings many
        qrun_parallel_for(qkv.size(0), at::get_num_threads(), qkv.numel() >= (1 << 16), [&](int64_t r) {
            T rotated[MAX_HEAD_DIM];
            const T* row = rows + r * width;
            const float* cos = table + pos[r] * dim;
            for (int64_t h = 0; h < num_heads_ + num_kv_heads_; h++) {
                rotary(row + h * dim, cos, cos + dim / 2, dim, rotated);
                if (h < num_heads_)
                    query(r, h, rotated);
                else
                    key(r, h - num_heads_, rotated);
            }
        });
    }

    // Rotary on q and k; k and v into their cache slots (in the cache's dtype), q (rounded to T) into `queries`.
    template <typename T>
    void write_keys_values(const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos_sin,
                           const at::Tensor& slot_mapping, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           at::Tensor& queries) const {
        const int64_t dim = head_dim_, width = qkv.size(1);
        const int64_t* slots = slot_mapping.data_ptr<int64_t>();
        const T* rows = qkv.data_ptr<T>();
        float* query_rows = queries.data_ptr<float>();
        AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, k_cache.scalar_type(), "step_layer_cache", [&] {
            scalar_t* k_out = k_cache.data_ptr<scalar_t>();
            scalar_t* v_out = v_cache.data_ptr<scalar_t>();
            rotated_heads<T>(
                qkv, positions, cos_sin,
                [&](int64_t r, int64_t h, const T* q) {
                    float* out = query_rows + (r * num_heads_ + h) * dim;
                    for (int64_t d = 0; d < dim; d++) out[d] = float(q[d]);
                },
                [&](int64_t r, int64_t h, const T* k) {
                    const int64_t at = (slots[r] * num_kv_heads_ + h) * dim;
                    const T* v = rows + r * width + (num_heads_ + num_kv_heads_ + h) * dim;
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

// A sequence's penalties as qrun/sampler.py's apply_penalties applies them, kept up to date over a run of decode
// steps: the repetition penalty over its prompt's and output's tokens (as transformers applies it), presence and
// frequency penalties over its output's (as OpenAI defines them), in float32 as torch computes them.
class Penalties {
  public:
    Penalties(double repetition, double presence, double frequency, const std::vector<int64_t>& token_ids,
              int64_t prompt_len, int64_t vocab)
        : repetition_(repetition), presence_(presence), frequency_(frequency) {
        if (!any()) return;
        for (size_t i = 0; i < token_ids.size(); i++) {
            TORCH_CHECK(token_ids[i] >= 0 && token_ids[i] < vocab, "StepModel.decode: token id ", token_ids[i],
                        " is outside the ", vocab, " logits");
            add(token_ids[i], int64_t(i) >= prompt_len);
        }
    }

    bool any() const { return repetition_ != 1.0 || presence_ != 0.0 || frequency_ != 0.0; }

    void apply(float* logits) const {
        const float repetition = float(repetition_);
        for (const int64_t token : seen_)
            logits[token] = logits[token] > 0 ? logits[token] / repetition : logits[token] * repetition;
        for (const auto& [token, count] : counts_)
            logits[token] -= float(frequency_) * float(count) + float(presence_);
    }

    // `token` joins the sequence (-1: none; output: past its prompt).
    void add(int64_t token, bool output = true) {
        if (token < 0) return;
        if (repetition_ != 1.0 && seen_set_.insert(token).second) seen_.push_back(token);
        if (output && (presence_ != 0.0 || frequency_ != 0.0)) counts_[token]++;
    }

  private:
    double repetition_, presence_, frequency_;
    std::vector<int64_t> seen_;  // distinct, in the order they came
    std::unordered_set<int64_t> seen_set_;
    std::unordered_map<int64_t, int64_t> counts_;  // output tokens
};

// The model's step in one call: the embedding, every decoder layer in order, the final norm and the head. A
// call from Python costs ~25 us, and each torch op around the layers as much again (the embedding, the norm and the
// head's module chain: ~0.15 ms of a ~4.5 ms 4.0-bpw SmolLM2 step at batch 1). It keeps the layers' workspace, so one
// StepModel runs one step at a time (an engine's).
class StepModel : public torch::CustomClassHolder {
  public:
    // cos_sin: the model's table (qrun/model.py's Transformer.cos_sin); embedding [vocab, hidden] and final_norm in
    // the layers' dtype.
    StepModel(at::Tensor cos_sin, at::Tensor embedding, at::Tensor final_norm, double eps)
        : cos_sin_(std::move(cos_sin)), embedding_(std::move(embedding)), final_norm_(std::move(final_norm)),
          eps_(eps) {
        TORCH_CHECK(embedding_.dim() == 2 && embedding_.is_contiguous() &&
                        final_norm_.scalar_type() == embedding_.scalar_type(),
                    "StepModel: the embedding must be a contiguous [vocab, hidden] tensor of the final norm's dtype");
    }

    void add_layer(c10::intrusive_ptr<StepLayer> layer) {
        max_gemv_rows_ = std::max(max_gemv_rows_, layer->max_gemv_rows());
        layers_.push_back(std::move(layer));
    }

    // The head: StepLayer.set_linear's arguments after the slot.
    void set_head(int64_t kind, std::vector<at::Tensor> weights, Optional bias, Optional perm, Optional signs,
                  Optional odd_factor, int64_t out_features, int64_t group, int64_t k_high, int64_t input_digits,
                  int64_t tile_rows, int64_t tile_dequantize_rows, int64_t dequantize_rows, int64_t read_streams,
                  int64_t gemv_rows) {
        head_ = make_linear(kind, std::move(weights), std::move(bias), std::move(perm), std::move(signs),
                            std::move(odd_factor), out_features, group, k_high, input_digits, tile_rows,
                            tile_dequantize_rows, dequantize_rows, read_streams, gemv_rows);
        max_gemv_rows_ = std::max(max_gemv_rows_, head_.max_gemv_rows());
    }

    // float32 logits [sampled rows, vocab] (a new tensor) of the rows `sample_rows` names, in its order, for token
    // ids [rows] at their positions (decode rows and prefill chunks: query_start_loc), as the eager model's forward
    // and compute_logits of those rows give them, and each sampled row's first maximum (its greedy token, as
    // qrun_first_max finds it), or -1 where a logit is NaN or infinite: the engine's check of the logits and greedy
    // sampling then need no pass of their own, each a torch op of ~0.1-0.2 ms at batch 1 once the step has left the caches cold. The step's
    // layout comes as qrun/model.py's StepLayout holds it, lists (block_tables flat, rows of table_width): tensors
    // made from them in Python cost ~0.1 ms a step at batch 1, for the same reason. half_gemv: dense linears may take
    // their float16 GEMV (up to each one's gemv_rows rows); where one's value passes float16's range, it reaches its
    // row's logits (the final norm of an infinity is NaN), and the step runs again on the bfloat16 weights, as
    // qrun/model_runner.py reruns the torch model's.
    std::tuple<at::Tensor, std::vector<int64_t>> forward(
        const std::vector<int64_t>& ids, const std::vector<int64_t>& positions,
        const std::vector<int64_t>& slot_mapping, const std::vector<int64_t>& block_tables, int64_t table_width,
        const std::vector<int64_t>& seq_lens, const std::vector<int64_t>& query_start_loc,
        const std::vector<int64_t>& sample_rows, bool half_gemv) {
        TORCH_CHECK(head_.kind >= 0, "StepModel: set_head first");
        const size_t rows = ids.size(), seqs = seq_lens.size();
        TORCH_CHECK(rows > 0 && positions.size() == rows && slot_mapping.size() == rows &&
                        query_start_loc.size() == seqs + 1 && table_width > 0 &&
                        block_tables.size() == seqs * size_t(table_width),
                    "StepModel.forward: ids, positions and slot_mapping need one value a row, query_start_loc "
                    "one more than seq_lens, block_tables table_width a sequence");
        bool prefill_chunks = false;
        for (size_t i = 0; i < seqs; i++) prefill_chunks |= query_start_loc[i + 1] - query_start_loc[i] > 1;
        for (const int64_t row : sample_rows)
            TORCH_CHECK(row >= 0 && row < int64_t(rows), "StepModel.forward: sample row ", row, " is not one of the ",
                        rows, " rows");
        const StepMeta meta{tensor_of(positions, {int64_t(rows)}, at::kLong),
                            tensor_of(slot_mapping, {int64_t(rows)}, at::kLong),
                            tensor_of(block_tables, {int64_t(seqs), table_width}, at::kInt),
                            tensor_of(seq_lens, {int64_t(seqs)}, at::kInt),
                            tensor_of(query_start_loc, {int64_t(seqs) + 1}, at::kInt), prefill_chunks};
        auto [logits, first] = sampled_step(ids, meta, half_gemv, sample_rows);
        return {workspace_.holds(logits) ? logits.clone() : logits, first};  // the next step overwrites the workspace
    }

    // Decoding of `steps` tokens for each of `ids`' rows (one sequence each, every row sampling), each step's tokens
    // the next step's ids: what `steps` calls of forward and the engine's sampler give (forward with its float16 GEMV
    // where the model has one), without the engine's bookkeeping between them (~0.2 ms a token at one row of a
    // 4.0-bpw SmolLM2 on a 2-core Xeon, most of it cache misses after the step's weights streamed past). positions:
    // the first step's, one more each step after (a row's context: its position + 1); slot_mapping: each row's slots
    // of its steps in turn (rows x steps, as qrun/model.py's StepLayout.of lists them). A row's logits take its
    // penalties (`Penalties`: token_ids its tokens so far, the first prompt_lens of them its prompt's; empty where it
    // has none); its token is then their first maximum where its temperature is 0, else drawn as kernels/cpu_draw.cpp
    // draws (its top_k, top_p, min_p, and its uniform of the step: uniforms float64 [steps, rows]; [0, rows] where no
    // row draws). A row with logprobs (its count of alternatives; -1: none) reports its token's and its likeliest
    // tokens' log-softmax of its penalised logits, as kernels/cpu_logprobs.cpp finds them. The tokens, step by step
    // (steps x rows), and the logprobs: chosen float32 [steps, rows], the likeliest tokens' values float32 and tokens
    // int64 [steps, rows, the most logprobs asked] (NaN and -1 where a row asked for none), of the steps run; a step in
    // which a row's logits are not finite (before penalties, as the engine checks them: that row's token -1) or a
    // row's token is one of its stop_token_ids (its sequence ends there: the steps after would be dropped) is the last.
    std::tuple<std::vector<int64_t>, at::Tensor, at::Tensor, at::Tensor> decode(
        const std::vector<int64_t>& ids, const std::vector<int64_t>& positions,
        const std::vector<int64_t>& slot_mapping, const std::vector<int64_t>& block_tables, int64_t table_width,
        int64_t steps,
        const std::vector<double>& temperature, const std::vector<int64_t>& top_k, const std::vector<double>& top_p,
        const std::vector<double>& min_p, const at::Tensor& uniforms, const std::vector<double>& repetition_penalty,
        const std::vector<double>& presence_penalty, const std::vector<double>& frequency_penalty,
        const std::vector<std::vector<int64_t>>& token_ids, const std::vector<int64_t>& prompt_lens,
        const std::vector<int64_t>& logprobs, const std::vector<std::vector<int64_t>>& stop_token_ids) {
        const int64_t rows = ids.size();
        TORCH_CHECK(rows > 0 && steps > 0 && int64_t(positions.size()) == rows &&
                        int64_t(slot_mapping.size()) == rows * steps && table_width > 0 &&
                        int64_t(block_tables.size()) == rows * table_width && int64_t(temperature.size()) == rows &&
                        int64_t(top_k.size()) == rows && int64_t(top_p.size()) == rows &&
                        int64_t(min_p.size()) == rows && int64_t(repetition_penalty.size()) == rows &&
                        int64_t(presence_penalty.size()) == rows && int64_t(frequency_penalty.size()) == rows &&
                        int64_t(token_ids.size()) == rows && int64_t(prompt_lens.size()) == rows &&
                        int64_t(logprobs.size()) == rows && int64_t(stop_token_ids.size()) == rows,
                    "StepModel.decode: ids, positions, the sampling arguments, token_ids, prompt_lens, logprobs and "
                    "stop_token_ids need one value a row, slot_mapping steps a row, block_tables table_width a row");
        const bool draws = std::any_of(temperature.begin(), temperature.end(), [](double t) { return t > 0; });
        TORCH_CHECK(uniforms.scalar_type() == at::kDouble && uniforms.is_contiguous() && uniforms.dim() == 2 &&
                        uniforms.size(0) == (draws ? steps : 0) && uniforms.size(1) == rows,
                    "StepModel.decode: uniforms must be contiguous float64 [steps, rows] ([0, rows] where no row "
                    "draws), got ", uniforms.scalar_type(), " ", uniforms.sizes());
        // the draw's arguments (a greedy row, at temperature 0, is not drawn)
        std::vector<float> draw_temperature(temperature.begin(), temperature.end()),
            draw_top_p(top_p.begin(), top_p.end()), draw_min_p(min_p.begin(), min_p.end());
        std::vector<Penalties> penalties;
        penalties.reserve(rows);
        for (int64_t r = 0; r < rows; r++)
            penalties.emplace_back(repetition_penalty[r], presence_penalty[r], frequency_penalty[r], token_ids[r],
                                   prompt_lens[r], head_.out_features);
        const int64_t top_n = std::max<int64_t>(0, *std::max_element(logprobs.begin(), logprobs.end()));
        const bool reports = std::any_of(logprobs.begin(), logprobs.end(), [](int64_t n) { return n >= 0; });
        const float nan = std::numeric_limits<float>::quiet_NaN();
        const at::Tensor chosen = at::full({steps, rows}, nan, at::kFloat),
                         top_values = at::full({steps, rows, top_n}, nan, at::kFloat),
                         top_ids = at::full({steps, rows, top_n}, -1, at::kLong);
        std::vector<int64_t> sample_rows(rows), query_start_loc(rows + 1), drawn(rows), reported(rows);
        std::iota(sample_rows.begin(), sample_rows.end(), 0);
        std::iota(query_start_loc.begin(), query_start_loc.end(), 0);
        const at::Tensor tables = tensor_of(block_tables, {rows, table_width}, at::kInt);
        const at::Tensor starts = tensor_of(query_start_loc, {rows + 1}, at::kInt);
        std::vector<int64_t> tokens, step_ids = ids, step_positions = positions, slots(rows), lengths(rows);
        tokens.reserve(steps * rows);
        for (int64_t s = 0; s < steps; s++) {
            for (int64_t r = 0; r < rows; r++) {
                slots[r] = slot_mapping[r * steps + s];
                lengths[r] = step_positions[r] + 1;
            }
            const StepMeta meta{tensor_of(step_positions, {rows}, at::kLong), tensor_of(slots, {rows}, at::kLong),
                                tables, tensor_of(lengths, {rows}, at::kInt), starts, false};
            at::Tensor logits;
            std::tie(logits, step_ids) = sampled_step(step_ids, meta, true, sample_rows);
            for (int64_t r = 0; r < rows; r++)  // a greedy row's token: its penalised logits' first maximum
                if (penalties[r].any() && step_ids[r] >= 0) {
                    float* row = logits.data_ptr<float>() + r * logits.size(1);
                    penalties[r].apply(row);
                    qrun_first_max(row, logits.size(1), 1, logits.size(1), &step_ids[r], 1, 0);
                }
            // drawn beside a row whose logits are not finite too, as the engine samples the others of such a step
            if (draws) {
                qrun_draw(logits.data_ptr<float>(), logits.size(1), rows, logits.size(1), draw_temperature.data(),
                          top_k.data(), draw_top_p.data(), draw_min_p.data(), uniforms.data_ptr<double>() + s * rows,
                          drawn.data(), at::get_num_threads());
                for (int64_t r = 0; r < rows; r++)
                    if (temperature[r] > 0 && step_ids[r] >= 0 && drawn[r] >= 0) step_ids[r] = drawn[r];
            }
            if (reports) {
                for (int64_t r = 0; r < rows; r++) reported[r] = logprobs[r] >= 0 ? step_ids[r] : -1;
                qrun_top_logprobs(logits.data_ptr<float>(), logits.size(1), rows, logits.size(1), reported.data(),
                                  top_n, chosen[s].data_ptr<float>(), top_values[s].data_ptr<float>(),
                                  top_ids[s].data_ptr<int64_t>(), at::get_num_threads());
            }
            tokens.insert(tokens.end(), step_ids.begin(), step_ids.end());
            bool last = false;
            for (int64_t r = 0; r < rows; r++)
                last |= step_ids[r] == -1 || std::find(stop_token_ids[r].begin(), stop_token_ids[r].end(),
                                                       step_ids[r]) != stop_token_ids[r].end();
            if (last) break;
            for (int64_t r = 0; r < rows; r++) penalties[r].add(step_ids[r]);
            for (int64_t& position : step_positions) position++;
        }
        const int64_t steps_run = int64_t(tokens.size()) / rows;
        return {tokens, chosen.narrow(0, 0, steps_run), top_values.narrow(0, 0, steps_run),
                top_ids.narrow(0, 0, steps_run)};
    }

  private:
    // The step's logits of sample_rows and their first maxima (forward says which; the logits may be the workspace's,
    // which the next step overwrites); run again on the bfloat16 weights where a float16 GEMV's value passed float16's
    // range.
    std::tuple<at::Tensor, std::vector<int64_t>> sampled_step(const std::vector<int64_t>& ids, const StepMeta& meta,
                                                              bool half_gemv, const std::vector<int64_t>& sample_rows) {
        auto [logits, first] = step(ids, meta, half_gemv, sample_rows);
        const bool took_half_gemv = half_gemv && int64_t(ids.size()) <= max_gemv_rows_;
        if (!took_half_gemv || std::find(first.begin(), first.end(), -1) == first.end()) return {logits, first};
        return step(ids, meta, false, sample_rows);
    }

    // `values` as a new tensor of `shape` and dtype (int64 or int32).
    static at::Tensor tensor_of(const std::vector<int64_t>& values, at::IntArrayRef shape, at::ScalarType dtype) {
        at::Tensor out = at::empty(shape, at::TensorOptions().dtype(dtype));
        if (dtype == at::kLong)
            std::copy(values.begin(), values.end(), out.data_ptr<int64_t>());
        else
            std::transform(values.begin(), values.end(), out.data_ptr<int32_t>(),
                           [](int64_t v) { return static_cast<int32_t>(v); });
        return out;
    }

    // Where every linear multiplies on the library's kernels, the step holds its threads as one team (QrunTeam) from
    // the embedding to the head: the kernels hand their shares to it instead of entering ~150 OpenMP regions (~1-1.5 us
    // each across a 2-core EPYC's two core complexes). torch's ops in between run on the calling thread, as in any
    // region; so the logits' widening to float32 waits until the team is released, where the head's kernel does not
    // widen them as it stores them (a bfloat16 4-bit head: torch's widening of SmolLM2's 49,152 logits took ~23 us of
    // a 2.5 ms step on a 2-core Xeon; C++ steps at one row of 200 tokens 1.009x with the kernel widening them,
    // alternating in one process: one-off probes). Float32 logits' first maxima are found on the team too, each thread
    // reading the logits it stored (qrun_first_max). The head's float32 logits stay in the workspace, where decode
    // reads them: a copy of them after the step, on the calling thread, read the half the other thread stored from
    // that core's cache (a median 0.12 ms of a 7.3 ms single-stream step on a 2-core Zen 3 EPYC: a one-off probe).
    std::tuple<at::Tensor, std::vector<int64_t>> step(const std::vector<int64_t>& ids, const StepMeta& meta,
                                                      bool half_gemv, const std::vector<int64_t>& sample_rows) {
        const int64_t rows = ids.size(), sampled = sample_rows.size();
        const at::ScalarType dtype = embedding_.scalar_type();
        bool every_row = sampled == rows;
        for (int64_t i = 0; i < sampled && every_row; i++) every_row = sample_rows[i] == i;
        const bool held = head_.on_library_kernel(sampled, dtype, half_gemv) &&
                          std::all_of(layers_.begin(), layers_.end(), [&](const auto& layer) {
                              return layer->on_library_kernels(rows, dtype, half_gemv);
                          });
        const bool widened = sampled && head_.widens(sampled, dtype, half_gemv);
        at::Tensor logits;
        std::vector<int64_t> first;
        const auto layers_and_head = [&] {
            at::Tensor x = embed(ids);
            // zeros, as the eager model's first residual: the first layer adds it
            at::Tensor residual = workspace_.get(Workspace::RESIDUAL, x.size(0), x.size(1), x.scalar_type()).zero_();
            for (const auto& layer : layers_)
                std::tie(x, residual) = layer->forward(x, residual, cos_sin_, meta, half_gemv, workspace_);
            head_.warm(sampled, x.scalar_type(), half_gemv);
            at::Tensor normed = workspace_.get(Workspace::NORMED, x.size(0), x.size(1), x.scalar_type());
            qrun_ops::add_rms_norm_into(contiguous(x), residual, final_norm_, eps_, normed, residual);
            if (!every_row)  // the head multiplies only the rows that sample, as the engine's compute_logits
                normed = normed.index_select(0, tensor_of(sample_rows, {sampled}, at::kLong));
            logits = sampled ? head_(normed, half_gemv, workspace_, Workspace::LOGITS,
                                     widened ? Linear::WIDENED : Linear::AS_INPUT)
                             : at::empty({0, head_.out_features}, normed.options());
            if (logits.scalar_type() == at::kFloat) first = first_maxima(logits);
        };
        if (held)
            QrunTeam::hold(at::get_num_threads(), layers_and_head);
        else
            layers_and_head();
        if (logits.scalar_type() == at::kFloat) return {logits, first};
        logits = logits.to(at::kFloat);
        return {logits, first_maxima(logits)};
    }

    // Each row's first maximum of float32 logits [rows, vocab] (contiguous), -1 where a value is not finite (its
    // exponent bits all set).
    static std::vector<int64_t> first_maxima(const at::Tensor& logits) {
        std::vector<int64_t> first(logits.size(0));
        qrun_first_max(logits.data_ptr<float>(), logits.size(1), logits.size(0), logits.size(1), first.data(),
                       at::get_num_threads(), 1);
        return first;
    }

    // The embedding's rows of ids, into the workspace.
    at::Tensor embed(const std::vector<int64_t>& ids) {
        const int64_t rows = ids.size(), vocab = embedding_.size(0);
        at::Tensor x = workspace_.get(Workspace::EMBEDDED, rows, embedding_.size(1), embedding_.scalar_type());
        const int64_t row_bytes = embedding_.size(1) * embedding_.element_size();
        for (int64_t r = 0; r < rows; r++) {
            TORCH_CHECK(ids[r] >= 0 && ids[r] < vocab, "StepModel: token id ", ids[r], " is outside the ", vocab,
                        " embeddings");
            std::memcpy(static_cast<char*>(x.data_ptr()) + r * row_bytes,
                        static_cast<const char*>(embedding_.data_ptr()) + ids[r] * row_bytes, row_bytes);
        }
        return x;
    }

    at::Tensor cos_sin_, embedding_, final_norm_;
    double eps_;
    std::vector<c10::intrusive_ptr<StepLayer>> layers_;
    Linear head_;
    int64_t max_gemv_rows_ = 0;  // the most rows a linear, the head or a layer's, takes on the float16 GEMV
    Workspace workspace_;
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(qrun, m) {
    m.class_<StepLayer>("StepLayer")
        .def(torch::init<at::Tensor, at::Tensor, double, int64_t, int64_t, int64_t, double, at::Tensor, at::Tensor,
                         Optional, Optional>())
        .def("set_linear", &StepLayer::set_linear)
        .def("set_cache_transforms", &StepLayer::set_cache_transforms);
    m.class_<StepModel>("StepModel")
        .def(torch::init<at::Tensor, at::Tensor, at::Tensor, double>())
        .def("add_layer", &StepModel::add_layer)
        .def("set_head", &StepModel::set_head)
        .def("forward", &StepModel::forward)
        .def("decode", &StepModel::decode);
}
