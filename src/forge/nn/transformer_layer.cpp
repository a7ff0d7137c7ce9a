#include "forge/nn/transformer_layer.h"

#include <algorithm>
#include <cmath>

#include "forge/kernels/ops.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::nn {

AttentionShape LayerShape::local_attention() const {
  AttentionShape local = attention;
  local.heads = attention.heads / tp_size;
  local.kv_heads = attention.kv_heads >= tp_size ? attention.kv_heads / tp_size : 1;
  return local;
}

namespace {
// Slice [rank * local, (rank + 1) * local) of the global rows (dim 0) or columns (dim 1).
ShardSpec split(Shape global, int dim, int64_t start, bool primary = true) {
  return ShardSpec{dim, start, std::move(global), primary};
}
}  // namespace

TransformerLayer::TransformerLayer(ParameterStore* store, int index, LayerShape shape, float init_std,
                                   int num_layers)
    : store_(store), shape_(shape) {
  const std::string p = "model.layers." + std::to_string(index) + ".";
  const auto& a = shape.attention;
  const AttentionShape l = shape.local_attention();
  const int tp = shape.tp_size, r = shape.tp_rank;
  FORGE_CHECK(a.heads % tp == 0 && shape.ffn % tp == 0 && (a.kv_heads % tp == 0 || tp % a.kv_heads == 0),
              "layer {}: {} heads, {} kv heads and ffn {} do not split over tp = {}", index, a.heads, a.kv_heads,
              shape.ffn, tp);
  const int64_t d = a.head_dim, qd = a.heads * d, kvd = a.kv_heads * d;
  // Replicated kv heads: rank r's query heads read kv head r * kv / tp; the first of its holders is primary.
  const bool kv_split = a.kv_heads >= tp;
  const int64_t kv_start = kv_split ? r * l.kv_heads * d : (static_cast<int64_t>(r) * a.kv_heads / tp) * d;
  const bool kv_primary = kv_split || r % (tp / a.kv_heads) == 0;
  const ShardSpec norm_shard{-1, 0, {}, r == 0};  // every rank holds the norms; rank 0's copy counts
  // Output projections feed the residual stream: scale their init by 1/sqrt(2 * layers) (GPT-2/Megatron).
  const float out_std = init_std / std::sqrt(2.0f * static_cast<float>(num_layers));
  norm1_id_ = store->add(p + "input_layernorm.weight", {a.hidden}, false, Init::ones, 0.02f, norm_shard);
  q_id_ = store->add(p + "self_attn.q_proj.weight", {l.heads * d, a.hidden}, true, Init::normal, init_std,
                     split({qd, a.hidden}, 0, r * l.heads * d));
  store->add(p + "self_attn.k_proj.weight", {l.kv_heads * d, a.hidden}, true, Init::normal, init_std,
             split({kvd, a.hidden}, 0, kv_start, kv_primary));
  store->add(p + "self_attn.v_proj.weight", {l.kv_heads * d, a.hidden}, true, Init::normal, init_std,
             split({kvd, a.hidden}, 0, kv_start, kv_primary));
  o_id_ = store->add(p + "self_attn.o_proj.weight", {a.hidden, l.heads * d}, true, Init::normal, out_std,
                     split({a.hidden, qd}, 1, r * l.heads * d));
  norm2_id_ = store->add(p + "post_attention_layernorm.weight", {a.hidden}, false, Init::ones, 0.02f, norm_shard);
  const int64_t f = shape.ffn / tp;
  gate_id_ = store->add(p + "mlp.gate_proj.weight", {f, a.hidden}, true, Init::normal, init_std,
                        split({shape.ffn, a.hidden}, 0, r * f));
  store->add(p + "mlp.up_proj.weight", {f, a.hidden}, true, Init::normal, init_std,
             split({shape.ffn, a.hidden}, 0, r * f));
  down_id_ = store->add(p + "mlp.down_proj.weight", {a.hidden, f}, true, Init::normal, out_std,
                        split({a.hidden, shape.ffn}, 1, r * f));
}

void TransformerLayer::bind(const RopeTable* rope, ComputeOptions options) {
  options_ = options;
  FORGE_CHECK(options.tp_size() == shape_.tp_size && options.tp_rank() == shape_.tp_rank,
              "layer bound to tensor-parallel rank {} of {} but registered for rank {} of {}", options.tp_rank(),
              options.tp_size(), shape_.tp_rank, shape_.tp_size);
  norm1_ = RmsNorm(store_, norm1_id_, shape_.norm_eps);
  norm2_ = RmsNorm(store_, norm2_id_, shape_.norm_eps);
  attention_ = Attention(store_, q_id_, o_id_, shape_.local_attention(), rope, options);
  mlp_ = Mlp(store_, gate_id_, down_id_, shape_.attention.hidden, shape_.ffn / shape_.tp_size, options);
}

void TransformerLayer::reduce_replicated_grads() const {
  TensorParallel* tp = options_.tp;
  if (!tp || tp->size() == 1) return;
  const Device device = options_.device;
  if (tp->sequence_parallel()) {  // each rank normed only its shard of the rows
    tp->all_reduce_sum(store_->grad(norm1_id_).f32(), shape_.attention.hidden, device);
    tp->all_reduce_sum(store_->grad(norm2_id_).f32(), shape_.attention.hidden, device);
  }
  const auto& a = shape_.attention;
  if (a.kv_heads >= tp->size()) return;
  // Replicated kv heads: every holder of head g saw only its own query heads. Sum the copies of each head
  // through a buffer of all kv heads in which each rank fills its head's slot.
  const int64_t per_head = a.head_dim * a.hidden;
  const int64_t head = static_cast<int64_t>(tp->rank()) * a.kv_heads / tp->size();
  Tensor buffer = Tensor::zeros({2, a.kv_heads, per_head}, DType::f32, device);
  for (int kv = 0; kv < 2; ++kv) {
    Tensor slot = buffer.view((kv * a.kv_heads + head) * per_head, {per_head});
    slot.copy_from(store_->grad(q_id_ + 1 + kv).reshape({per_head}));
  }
  tp->all_reduce_sum(buffer.f32(), buffer.numel(), device);
  for (int kv = 0; kv < 2; ++kv) {
    Tensor grad = store_->grad(q_id_ + 1 + kv).reshape({per_head});
    grad.copy_from(buffer.view((kv * a.kv_heads + head) * per_head, {per_head}));
  }
}

Tensor TransformerLayer::run_forward(const Tensor& x, int64_t batch, int64_t seq, Saved& saved,
                                     bool keep_cores) const {
  saved.x = x;
  Tensor h1 = norm1_.forward(x, saved.norm1);
  Tensor x2 = attention_.forward(h1, batch, seq, saved.attention, keep_cores);
  ops::add_inplace(x2.f32(), x.f32(), x.numel(), options_.device);
  Tensor h2 = norm2_.forward(x2, saved.norm2);
  Tensor y = mlp_.forward(h2, saved.mlp, keep_cores);
  ops::add_inplace(y.f32(), x2.f32(), x2.numel(), options_.device);
  saved.complete = true;
  return y;
}

Tensor TransformerLayer::forward(const Tensor& x, int64_t batch, int64_t seq, Saved& saved) const {
  if (options_.recompute != Recompute::full)
    return run_forward(x, batch, seq, saved, options_.recompute == Recompute::none);
  // Full recompute: run the layer, keep only its input.
  Saved scratch;
  Tensor y = run_forward(x, batch, seq, scratch, false);
  saved = Saved{};
  saved.x = x;
  return y;
}

Tensor TransformerLayer::backward_input(const Tensor& dy, int64_t batch, int64_t seq, Saved& saved) const {
  if (!saved.complete) {
    Tensor x = saved.x;
    run_forward(x, batch, seq, saved, true);
  }
  // y = x2 + mlp(norm2(x2)):  dx2 = dy + norm2'(mlp'(dy))
  Tensor dh2 = mlp_.backward_input(dy, saved.mlp);
  Tensor dx2 = norm2_.backward_input(dh2, saved.norm2);
  ops::add_inplace(dx2.f32(), dy.f32(), dy.numel(), options_.device);
  // x2 = x + attn(norm1(x)):  dx = dx2 + norm1'(attn'(dx2))
  Tensor dh1 = attention_.backward_input(dx2, batch, seq, saved.attention);
  Tensor dx = norm1_.backward_input(dh1, saved.norm1);
  ops::add_inplace(dx.f32(), dx2.f32(), dx2.numel(), options_.device);
  saved.x = Tensor();
  return dx;
}

Tensor TransformerLayer::forward_cached(const Tensor& x, int64_t batch, int64_t tokens,
                                        const KvLayer& cache) const {
  RmsNorm::Saved norm1, norm2;
  Mlp::Saved mlp;
  Tensor x2 = attention_.forward_cached(norm1_.forward(x, norm1), batch, tokens, cache);
  ops::add_inplace(x2.f32(), x.f32(), x.numel(), options_.device);
  Tensor y = mlp_.forward(norm2_.forward(x2, norm2), mlp, false);
  ops::add_inplace(y.f32(), x2.f32(), x2.numel(), options_.device);
  return y;
}

void TransformerLayer::backward_weight(Saved& saved) const {
  mlp_.backward_weight(saved.mlp);
  norm2_.backward_weight(saved.norm2);
  attention_.backward_weight(saved.attention);
  norm1_.backward_weight(saved.norm1);
  saved = Saved{};
}

}  // namespace forge::nn
