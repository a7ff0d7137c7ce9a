#include "forge/nn/attention.h"

#include <cmath>

#include "forge/kernels/ops.h"
#include "forge/nn/context_parallel.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::nn {
namespace {

// Columns [first, first + width) of a [rows, stride] matrix (fp32 or bf16), packed into a dense fp32
// [rows, width] tensor, and back (overwriting them, rounded to x's dtype).
Tensor pack_columns(const Tensor& x, int64_t stride, int64_t first, int64_t width, Device device) {
  const int64_t rows = x.numel() / stride;
  Tensor out = Tensor::empty({rows, width}, DType::f32, device);
  ops::StridedCopyParams c;
  c.shape[1] = rows, c.shape[2] = width;
  c.src = x.elements() + first, c.src_stride[1] = stride;
  c.dst = out.f32(), c.dst_stride[1] = width;
  ops::strided_copy(c, device);
  return out;
}
void unpack_columns(const Tensor& dense, Tensor& x, int64_t stride, int64_t first, Device device) {
  const int64_t width = dense.dim(1);
  ops::StridedCopyParams c;
  c.shape[1] = dense.dim(0), c.shape[2] = width;
  c.src = dense.f32(), c.src_stride[1] = width;
  c.dst = x.elements() + first, c.dst_stride[1] = stride;
  ops::strided_copy(c, device);
}

}  // namespace

Attention::Attention(ParameterStore* store, AttentionParams params, AttentionShape shape,
                     const RopeTable* rope, ComputeOptions options)
    : qkv_(store, {params.q, params.k, params.v}, shape.hidden, options),
      o_(store, {params.o}, shape.heads * shape.head_dim, options),
      shape_(shape),
      rope_(rope),
      options_(options),
      window_(params.window),
      scale_(params.scale > 0.0f ? params.scale : 1.0f / std::sqrt(static_cast<float>(shape.head_dim))),
      softcap_(params.softcap),
      act_dtype_(options.part_dtype()) {
  FORGE_CHECK(qkv_.out_features() == shape.qkv_dim(), "q|k|v weights give {} rows, expected {}",
              qkv_.out_features(), shape.qkv_dim());
  if (params.bias >= 0) {
    qkv_bias_ = Bias(store, {params.bias, params.bias + 1, params.bias + 2});
    FORGE_CHECK(qkv_bias_.size() == shape.qkv_dim(), "q|k|v biases give {} values, expected {}",
                qkv_bias_.size(), shape.qkv_dim());
  }
  FORGE_CHECK((params.q_norm >= 0) == (params.k_norm >= 0), "QK-norm needs both the q and the k norm");
  if (params.q_norm >= 0) {
    q_norm_ = RmsNorm(store, params.q_norm, params.norm_eps, params.norm_weight_offset);
    k_norm_ = RmsNorm(store, params.k_norm, params.norm_eps, params.norm_weight_offset);
    qk_norm_ = true;
    FORGE_CHECK(store->info(params.q_norm).shape == Shape{shape.head_dim} &&
                    store->info(params.k_norm).shape == Shape{shape.head_dim},
                "QK-norm weights must hold head_dim = {} values", shape.head_dim);
  }
  FORGE_CHECK(params.window >= 0, "negative attention window {}", params.window);
}

// Each head's head_dim values form one row of the norm: the packed [rows, heads * head_dim] columns are
// [rows * heads, head_dim] to it.
void Attention::qk_norm_forward(Tensor& qkv, RmsNorm::Saved& q_saved, RmsNorm::Saved& k_saved) const {
  const int64_t stride = shape_.qkv_dim(), qd = shape_.heads * shape_.head_dim,
                kd = shape_.kv_heads * shape_.head_dim;
  const Device device = options_.device;
  unpack_columns(q_norm_.forward(pack_columns(qkv, stride, 0, qd, device), q_saved), qkv, stride, 0, device);
  unpack_columns(k_norm_.forward(pack_columns(qkv, stride, qd, kd, device), k_saved), qkv, stride, qd,
                 device);
}

void Attention::qk_norm_backward_input(Tensor& dqkv, Saved& saved) const {
  const int64_t stride = shape_.qkv_dim(), qd = shape_.heads * shape_.head_dim,
                kd = shape_.kv_heads * shape_.head_dim;
  const Device device = options_.device;
  unpack_columns(q_norm_.backward_input(pack_columns(dqkv, stride, 0, qd, device), saved.q_norm), dqkv,
                 stride, 0, device);
  unpack_columns(k_norm_.backward_input(pack_columns(dqkv, stride, qd, kd, device), saved.k_norm), dqkv,
                 stride, qd, device);
}

ops::AttentionParams Attention::core_params(ConstElements qkv, int64_t batch, int64_t seq) const {
  const int64_t qd = shape_.heads * shape_.head_dim, kd = shape_.kv_heads * shape_.head_dim;
  ops::AttentionParams p;
  p.batch = batch, p.seq = seq, p.heads = shape_.heads, p.kv_heads = shape_.kv_heads,
  p.head_dim = shape_.head_dim;
  p.q = qkv, p.k = p.q + qd, p.v = p.q + qd + kd;
  p.q_stride = p.k_stride = p.v_stride = shape_.qkv_dim();
  p.out_stride = qd;
  p.scale = scale_;
  p.causal = true;
  p.window = window_;
  p.softcap = softcap_;
  return p;
}

void Attention::apply_rope(Elements qkv, int64_t batch, int64_t seq, bool inverse,
                           int64_t first_position) const {
  FORGE_CHECK(first_position + seq <= rope_->positions,
              "positions up to {} exceed the RoPE table ({} positions)", first_position + seq,
              rope_->positions);
  ops::RopeParams p;
  p.batch = batch, p.seq = seq, p.head_dim = shape_.head_dim, p.token_stride = shape_.qkv_dim();
  p.cos = rope_->cos.f32(), p.sin = rope_->sin.f32(), p.inverse = inverse;
  p.position_offset = first_position;
  p.x = qkv, p.heads = shape_.heads;
  ops::rope(p, options_.device);
  p.x = qkv + shape_.heads * shape_.head_dim, p.heads = shape_.kv_heads;
  ops::rope(p, options_.device);
}

void Attention::rope_for_training(Elements qkv, int64_t batch, int64_t seq,
                                  const std::vector<int64_t>* documents, bool inverse) const {
  if (documents) {
    FORGE_CHECK(!options_.cp, "packed documents under context parallelism");
    int64_t row = 0;
    for (const int64_t length : *documents) {
      apply_rope(qkv + row * shape_.qkv_dim(), 1, length, inverse);
      row += length;
    }
    return;
  }
  if (!options_.cp) return apply_rope(qkv, batch, seq, inverse);
  const int64_t half = seq / 2, stride = shape_.qkv_dim();
  for (int64_t b = 0; b < batch; ++b)
    for (int h = 0; h < 2; ++h)
      apply_rope(qkv + (b * seq + h * half) * stride, 1, half, inverse, options_.cp->first_position(h, seq));
}

void Attention::core_forward(Tensor& qkv, int64_t batch, int64_t seq, const std::vector<int64_t>* documents,
                             Tensor& out, Tensor& lse) const {
  const int64_t rows = batch * seq, qd = shape_.heads * shape_.head_dim;
  out = Tensor::empty({rows, qd}, act_dtype_, options_.device);
  lse = Tensor::empty({batch, shape_.heads, seq}, DType::f32, options_.device);
  if (documents) {  // lse holds [heads, length] per document, in order
    int64_t row = 0;
    for (const int64_t length : *documents) {
      ops::AttentionParams p = core_params(qkv.elements() + row * shape_.qkv_dim(), 1, length);
      p.out = out.elements() + row * qd, p.lse = lse.f32() + row * shape_.heads;
      ops::attention_forward(p, options_.device);
      row += length;
    }
    return;
  }
  ops::AttentionParams p = core_params(qkv.elements(), batch, seq);
  p.out = out.elements(), p.lse = lse.f32();
  if (options_.cp)
    options_.cp->attention_forward(p);
  else
    ops::attention_forward(p, options_.device);
}

Tensor Attention::forward(const Tensor& h, int64_t batch, int64_t seq, Saved& saved, bool keep_core) const {
  saved.h = qkv_.input(gather_in(options_.tp, h));
  saved.qkv = qkv_.forward(saved.h, act_dtype_);
  if (qkv_bias_.defined()) qkv_bias_.forward(saved.qkv);
  if (qk_norm_) qk_norm_forward(saved.qkv, saved.q_norm, saved.k_norm);
  rope_for_training(saved.qkv.elements(), batch, seq, saved.documents, false);
  Tensor out, lse;
  core_forward(saved.qkv, batch, seq, saved.documents, out, lse);
  GemmOperand out_op = o_.input(out);
  Tensor y = o_.forward(out_op, act_dtype_);
  if (keep_core || !options_.recomputes(RecomputeModule::core_attn)) {
    saved.out = out, saved.lse = lse, saved.out_op = std::move(out_op);
  }
  return reduce_out(options_.tp, y);
}

void Attention::drop_input(LayerPart::Saved& saved) const { static_cast<Saved&>(saved).h = GemmOperand{}; }

void Attention::restore_input(const Tensor& h, LayerPart::Saved& base) const {
  Saved& saved = static_cast<Saved&>(base);
  saved.h = qkv_.input(gather_in(options_.tp, h));
  qkv_.keep_for_backward(saved.h);
}

Tensor Attention::backward_input(const Tensor& dy, int64_t batch, int64_t seq, Saved& saved) const {
  if (!saved.out.defined()) {  // selective recompute of the attention core
    core_forward(saved.qkv, batch, seq, saved.documents, saved.out, saved.lse);
    saved.out_op = o_.input(saved.out);
    o_.keep_for_backward(saved.out_op);
  }
  saved.dy = o_.grad_output(gather_in(options_.tp, dy));
  Tensor dout = o_.backward_input(saved.dy, act_dtype_);

  const int64_t rows = batch * seq, qd = shape_.heads * shape_.head_dim,
                kd = shape_.kv_heads * shape_.head_dim;
  Tensor dqkv = Tensor::empty({rows, shape_.qkv_dim()}, act_dtype_, options_.device);
  auto params = [&](int64_t row, int64_t b, int64_t s) {
    const int64_t stride = shape_.qkv_dim();
    ops::AttentionParams p = core_params(saved.qkv.elements() + row * stride, b, s);
    p.out = saved.out.elements() + row * qd, p.lse = saved.lse.f32() + row * shape_.heads;
    p.dout = dout.elements() + row * qd, p.dout_stride = qd;
    p.dq = dqkv.elements() + row * stride, p.dk = p.dq + qd, p.dv = p.dq + qd + kd;
    p.dq_stride = p.dk_stride = p.dv_stride = stride;
    return p;
  };
  if (saved.documents) {
    int64_t row = 0;
    for (const int64_t length : *saved.documents) {
      ops::attention_backward(params(row, 1, length), options_.device);
      row += length;
    }
  } else if (options_.cp) {
    options_.cp->attention_backward(params(0, batch, seq));
  } else {
    ops::attention_backward(params(0, batch, seq), options_.device);
  }
  // The core is no longer needed; the o-projection's weight gradient keeps out_op.
  saved.out = Tensor(), saved.lse = Tensor(), saved.qkv = Tensor();

  rope_for_training(dqkv.elements(), batch, seq, saved.documents, true);
  if (qk_norm_) qk_norm_backward_input(dqkv, saved);
  if (qkv_bias_.defined()) saved.dbias = qkv_bias_.backward_input(dqkv);
  saved.dqkv = qkv_.grad_output(dqkv);
  return reduce_out(options_.tp, qkv_.backward_input(saved.dqkv, act_dtype_));
}

void Attention::backward_weight(Saved& saved) const {
  o_.backward_weight(saved.dy, saved.out_op);
  qkv_.backward_weight(saved.dqkv, saved.h);
  if (qkv_bias_.defined()) qkv_bias_.backward_weight(saved.dbias);
  if (qk_norm_) q_norm_.backward_weight(saved.q_norm), k_norm_.backward_weight(saved.k_norm);
  saved = Saved{};
}

Tensor Attention::forward_cached(const Tensor& h, int64_t batch, int64_t tokens, const KvLayer& cache) const {
  FORGE_CHECK(options_.tp == nullptr && options_.cp == nullptr,
              "cached inference runs on one process (tensor and context parallelism are for training)");
  FORGE_CHECK(cache.keys && cache.kv_heads == shape_.kv_heads && cache.head_dim == shape_.head_dim,
              "KV cache of {} kv heads x {} dims does not fit attention with {} x {}", cache.kv_heads,
              cache.head_dim, shape_.kv_heads, shape_.head_dim);
  FORGE_CHECK(batch == cache.batch && tokens > 0 && h.numel() == batch * tokens * shape_.hidden,
              "cached attention: {} tokens x batch {} (cache batch {}) do not match an input of {} elements",
              tokens, batch, cache.batch, h.numel());
  if (cache.length + tokens > cache.capacity)
    fail("KV cache full: {} cached + {} new tokens exceed its capacity of {} positions", cache.length, tokens,
         cache.capacity);
  const int64_t qd = shape_.heads * shape_.head_dim, kd = shape_.kv_heads * shape_.head_dim;
  const int64_t qkv_dim = shape_.qkv_dim();
  GemmOperand h_op = qkv_.input(h);
  Tensor qkv = qkv_.forward(h_op);
  if (qkv_bias_.defined()) qkv_bias_.forward(qkv);
  if (qk_norm_) {
    RmsNorm::Saved q_saved, k_saved;  // inference: dropped at once
    qk_norm_forward(qkv, q_saved, k_saved);
  }
  apply_rope(qkv.elements(), batch, tokens, false, cache.length);
  const int64_t dim = shape_.head_dim;
  ops::KvAppendParams append;
  append.batch = batch, append.tokens = tokens, append.kv_heads = shape_.kv_heads, append.head_dim = dim;
  append.qkv = qkv.f32(), append.qkv_stride = qkv_dim, append.k_offset = qd, append.v_offset = qd + kd;
  append.keys = cache.keys, append.values = cache.values;
  append.batch_stride = cache.batch_stride(), append.head_stride = cache.head_stride();
  append.position = cache.length;
  ops::kv_append(append, options_.device);

  Tensor out = Tensor::empty({batch * tokens, qd}, DType::f32, options_.device);
  ops::AttentionParams p = core_params(qkv.elements(), batch, tokens);
  p.k = cache.keys, p.v = cache.values, p.k_stride = p.v_stride = dim;
  p.k_head_stride = p.v_head_stride = cache.head_stride();
  p.k_batch_stride = p.v_batch_stride = cache.batch_stride();
  p.kv_seq = cache.length + tokens, p.q_offset = cache.length;
  p.out = out.f32(), p.lse = nullptr;
  ops::attention_forward(p, options_.device);
  GemmOperand out_op = o_.input(out);
  return o_.forward(out_op);
}

}  // namespace forge::nn
