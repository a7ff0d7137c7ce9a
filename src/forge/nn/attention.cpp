#include "forge/nn/attention.h"

#include <cmath>

#include "forge/kernels/ops.h"
#include "forge/nn/context_parallel.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::nn {

Attention::Attention(ParameterStore* store, AttentionParams params, AttentionShape shape,
                     const RopeTable* rope, ComputeOptions options)
    : qkv_(store, {params.q, params.k, params.v}, shape.hidden, options),
      o_(store, {params.o}, shape.heads * shape.head_dim, options),
      shape_(shape),
      rope_(rope),
      options_(options) {
  FORGE_CHECK(qkv_.out_features() == shape.qkv_dim(), "q|k|v weights give {} rows, expected {}",
              qkv_.out_features(), shape.qkv_dim());
  if (params.bias >= 0) {
    qkv_bias_ = Bias(store, {params.bias, params.bias + 1, params.bias + 2});
    FORGE_CHECK(qkv_bias_.size() == shape.qkv_dim(), "q|k|v biases give {} values, expected {}",
                qkv_bias_.size(), shape.qkv_dim());
  }
}

void Attention::apply_rope(float* qkv, int64_t batch, int64_t seq, bool inverse,
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

void Attention::rope_for_training(float* qkv, int64_t batch, int64_t seq, bool inverse) const {
  if (!options_.cp) return apply_rope(qkv, batch, seq, inverse);
  const int64_t half = seq / 2, stride = shape_.qkv_dim();
  for (int64_t b = 0; b < batch; ++b)
    for (int h = 0; h < 2; ++h)
      apply_rope(qkv + (b * seq + h * half) * stride, 1, half, inverse, options_.cp->first_position(h, seq));
}

void Attention::core_forward(Tensor& qkv, int64_t batch, int64_t seq, Tensor& out, Tensor& lse) const {
  const int64_t rows = batch * seq, qd = shape_.heads * shape_.head_dim,
                kd = shape_.kv_heads * shape_.head_dim;
  out = Tensor::empty({rows, qd}, DType::f32, options_.device);
  lse = Tensor::empty({batch, shape_.heads, seq}, DType::f32, options_.device);
  ops::AttentionParams p;
  p.batch = batch, p.seq = seq, p.heads = shape_.heads, p.kv_heads = shape_.kv_heads,
  p.head_dim = shape_.head_dim;
  p.q = qkv.f32(), p.k = p.q + qd, p.v = p.q + qd + kd;
  p.q_stride = p.k_stride = p.v_stride = shape_.qkv_dim();
  p.out = out.f32(), p.out_stride = qd, p.lse = lse.f32();
  p.scale = 1.0f / std::sqrt(static_cast<float>(shape_.head_dim));
  p.causal = true;
  if (options_.cp)
    options_.cp->attention_forward(p);
  else
    ops::attention_forward(p, options_.device);
}

Tensor Attention::forward(const Tensor& h, int64_t batch, int64_t seq, Saved& saved, bool keep_core) const {
  saved.h = qkv_.input(gather_in(options_.tp, h));
  saved.qkv = qkv_.forward(saved.h);
  if (qkv_bias_.defined()) qkv_bias_.forward(saved.qkv);
  rope_for_training(saved.qkv.f32(), batch, seq, false);
  Tensor out, lse;
  core_forward(saved.qkv, batch, seq, out, lse);
  GemmOperand out_op = o_.input(out);
  Tensor y = o_.forward(out_op);
  if (keep_core) {
    saved.out = out, saved.lse = lse, saved.out_op = std::move(out_op);
  }
  return reduce_out(options_.tp, y);
}

Tensor Attention::backward_input(const Tensor& dy, int64_t batch, int64_t seq, Saved& saved) const {
  if (!saved.out.defined()) {  // selective recompute of the attention core
    core_forward(saved.qkv, batch, seq, saved.out, saved.lse);
    saved.out_op = o_.input(saved.out);
    o_.keep_for_backward(saved.out_op);
  }
  saved.dy = o_.grad_output(gather_in(options_.tp, dy));
  Tensor dout = o_.backward_input(saved.dy);

  const int64_t rows = batch * seq, qd = shape_.heads * shape_.head_dim,
                kd = shape_.kv_heads * shape_.head_dim;
  Tensor dqkv = Tensor::empty({rows, shape_.qkv_dim()}, DType::f32, options_.device);
  ops::AttentionParams p;
  p.batch = batch, p.seq = seq, p.heads = shape_.heads, p.kv_heads = shape_.kv_heads,
  p.head_dim = shape_.head_dim;
  p.q = saved.qkv.f32(), p.k = p.q + qd, p.v = p.q + qd + kd;
  p.q_stride = p.k_stride = p.v_stride = shape_.qkv_dim();
  p.out = saved.out.f32(), p.out_stride = qd, p.lse = saved.lse.f32();
  p.scale = 1.0f / std::sqrt(static_cast<float>(shape_.head_dim));
  p.causal = true;
  p.dout = dout.f32(), p.dout_stride = qd;
  p.dq = dqkv.f32(), p.dk = p.dq + qd, p.dv = p.dq + qd + kd;
  p.dq_stride = p.dk_stride = p.dv_stride = shape_.qkv_dim();
  if (options_.cp)
    options_.cp->attention_backward(p);
  else
    ops::attention_backward(p, options_.device);
  // The core is no longer needed; the o-projection's weight gradient keeps out_op.
  saved.out = Tensor(), saved.lse = Tensor(), saved.qkv = Tensor();

  rope_for_training(dqkv.f32(), batch, seq, true);
  if (qkv_bias_.defined()) saved.dbias = qkv_bias_.backward_input(dqkv);
  saved.dqkv = qkv_.grad_output(dqkv);
  return reduce_out(options_.tp, qkv_.backward_input(saved.dqkv));
}

void Attention::backward_weight(Saved& saved) const {
  o_.backward_weight(saved.dy, saved.out_op);
  qkv_.backward_weight(saved.dqkv, saved.h);
  if (qkv_bias_.defined()) qkv_bias_.backward_weight(saved.dbias);
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
  apply_rope(qkv.f32(), batch, tokens, false, cache.length);
  const int64_t dim = shape_.head_dim;
  ops::KvAppendParams append;
  append.batch = batch, append.tokens = tokens, append.kv_heads = shape_.kv_heads, append.head_dim = dim;
  append.qkv = qkv.f32(), append.qkv_stride = qkv_dim, append.k_offset = qd, append.v_offset = qd + kd;
  append.keys = cache.keys, append.values = cache.values;
  append.batch_stride = cache.batch_stride(), append.head_stride = cache.head_stride();
  append.position = cache.length;
  ops::kv_append(append, options_.device);

  Tensor out = Tensor::empty({batch * tokens, qd}, DType::f32, options_.device);
  ops::AttentionParams p;
  p.batch = batch, p.seq = tokens, p.heads = shape_.heads, p.kv_heads = shape_.kv_heads,
  p.head_dim = shape_.head_dim;
  p.q = qkv.f32(), p.q_stride = qkv_dim;
  p.k = cache.keys, p.v = cache.values, p.k_stride = p.v_stride = dim;
  p.k_head_stride = p.v_head_stride = cache.head_stride();
  p.k_batch_stride = p.v_batch_stride = cache.batch_stride();
  p.kv_seq = cache.length + tokens, p.q_offset = cache.length;
  p.out = out.f32(), p.out_stride = qd, p.lse = nullptr;
  p.scale = 1.0f / std::sqrt(static_cast<float>(shape_.head_dim));
  p.causal = true;
  ops::attention_forward(p, options_.device);
  GemmOperand out_op = o_.input(out);
  return o_.forward(out_op);
}

}  // namespace forge::nn
