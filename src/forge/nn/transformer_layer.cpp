#include "forge/nn/transformer_layer.h"

#include <cmath>

#include "forge/kernels/ops.h"

namespace forge::nn {

TransformerLayer::TransformerLayer(ParameterStore* store, int index, LayerShape shape, float init_std,
                                   int num_layers)
    : store_(store), shape_(shape) {
  const std::string p = "model.layers." + std::to_string(index) + ".";
  const auto& a = shape.attention;
  // Output projections feed the residual stream: scale their init by 1/sqrt(2 * layers) (GPT-2/Megatron).
  const float out_std = init_std / std::sqrt(2.0f * static_cast<float>(num_layers));
  norm1_id_ = store->add(p + "input_layernorm.weight", {a.hidden}, false, Init::ones);
  q_id_ = store->add(p + "self_attn.q_proj.weight", {a.heads * a.head_dim, a.hidden}, true, Init::normal, init_std);
  store->add(p + "self_attn.k_proj.weight", {a.kv_heads * a.head_dim, a.hidden}, true, Init::normal, init_std);
  store->add(p + "self_attn.v_proj.weight", {a.kv_heads * a.head_dim, a.hidden}, true, Init::normal, init_std);
  o_id_ = store->add(p + "self_attn.o_proj.weight", {a.hidden, a.heads * a.head_dim}, true, Init::normal, out_std);
  norm2_id_ = store->add(p + "post_attention_layernorm.weight", {a.hidden}, false, Init::ones);
  gate_id_ = store->add(p + "mlp.gate_proj.weight", {shape.ffn, a.hidden}, true, Init::normal, init_std);
  store->add(p + "mlp.up_proj.weight", {shape.ffn, a.hidden}, true, Init::normal, init_std);
  down_id_ = store->add(p + "mlp.down_proj.weight", {a.hidden, shape.ffn}, true, Init::normal, out_std);
}

void TransformerLayer::bind(const RopeTable* rope, ComputeOptions options) {
  options_ = options;
  norm1_ = RmsNorm(store_, norm1_id_, shape_.norm_eps);
  norm2_ = RmsNorm(store_, norm2_id_, shape_.norm_eps);
  attention_ = Attention(store_, q_id_, o_id_, shape_.attention, rope, options);
  mlp_ = Mlp(store_, gate_id_, down_id_, shape_.attention.hidden, shape_.ffn, options);
}

Tensor TransformerLayer::run_forward(const Tensor& x, int64_t batch, int64_t seq, Saved& saved,
                                     bool keep_cores) const {
  saved.x = x;
  Tensor h1 = norm1_.forward(x, saved.norm1);
  Tensor x2 = attention_.forward(h1, batch, seq, saved.attention, keep_cores);
  ops::add_inplace(x2.f32(), x.f32(), x.numel());
  Tensor h2 = norm2_.forward(x2, saved.norm2);
  Tensor y = mlp_.forward(h2, saved.mlp, keep_cores);
  ops::add_inplace(y.f32(), x2.f32(), x2.numel());
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
  ops::add_inplace(dx2.f32(), dy.f32(), dy.numel());
  // x2 = x + attn(norm1(x)):  dx = dx2 + norm1'(attn'(dx2))
  Tensor dh1 = attention_.backward_input(dx2, batch, seq, saved.attention);
  Tensor dx = norm1_.backward_input(dh1, saved.norm1);
  ops::add_inplace(dx.f32(), dx2.f32(), dx2.numel());
  saved.x = Tensor();
  return dx;
}

Tensor TransformerLayer::forward_cached(const Tensor& x, int64_t batch, int64_t tokens,
                                        const KvLayer& cache) const {
  RmsNorm::Saved norm1, norm2;
  Mlp::Saved mlp;
  Tensor x2 = attention_.forward_cached(norm1_.forward(x, norm1), batch, tokens, cache);
  ops::add_inplace(x2.f32(), x.f32(), x.numel());
  Tensor y = mlp_.forward(norm2_.forward(x2, norm2), mlp, false);
  ops::add_inplace(y.f32(), x2.f32(), x2.numel());
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
