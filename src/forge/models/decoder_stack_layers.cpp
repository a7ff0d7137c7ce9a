// The decoder stack's layers: each layer's parameters registered under their Hugging Face names with this
// rank's shards, the parts built from the layer's spec, and the tensor-parallel sums of what ranks share.
#include <cmath>

#include "forge/models/decoder_stack.h"
#include "forge/nn/fp8_context.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::models {
namespace {
// Slice [start, start + local) of the global tensor along dim 0 (rows) or 1 (columns).
ShardSpec split(Shape global, int dim, int64_t start, bool primary = true) {
  return ShardSpec{dim, start, std::move(global), primary};
}

// Heads and kv heads of one tensor-parallel rank: heads split over tp; kv heads too when tp divides them,
// else each rank keeps the one kv head its query heads read (replicated over tp / kv_heads ranks).
nn::AttentionShape local_attention(const DecoderSpec& s, int tp) {
  nn::AttentionShape a{s.hidden, s.heads / tp, 0, s.head_dim};
  a.kv_heads = s.kv_heads >= tp ? s.kv_heads / tp : 1;
  return a;
}

}  // namespace

// Norm weights start where the scale is one: at one, or at zero when the norms scale by 1 + w (Gemma).
Init DecoderStack::norm_weight_init() const {
  return spec_.norm_weight_offset != 0.0f ? Init::zeros : Init::ones;
}

int DecoderStack::register_norm(const std::string& name) {
  const ShardSpec replicated{-1, 0, {}, options_.tp_rank() == 0};  // every rank holds the norms
  const int weight =
      params_.add(name + ".weight", {spec_.hidden}, false, norm_weight_init(), 0.02f, replicated);
  if (spec_.norm_bias) params_.add(name + ".bias", {spec_.hidden}, false, Init::zeros, 0.0f, replicated);
  return weight;
}

nn::Norm DecoderStack::make_norm(int weight) const {
  return nn::make_norm(&params_, spec_.norm, weight, spec_.norm_bias, static_cast<float>(spec_.norm_eps),
                       spec_.norm_weight_offset);
}

std::vector<int> DecoderStack::norm_parameters(std::initializer_list<int> weights) const {
  std::vector<int> ids;
  for (int weight : weights) {
    if (weight < 0) continue;
    ids.push_back(weight);
    if (spec_.norm_bias) ids.push_back(weight + 1);
  }
  return ids;
}

// Recompute: with recompute_layers > 0, only the stage's first recompute_layers layers (an extension's
// counted after the stage's own) recompute. FP8: every decoder layer's Linears except the first and last
// bf16_*_layers, which stay in the GEMM dtype (the layers nearest the embedding and the loss are the most
// sensitive to precision); an extension's layers (indices past the last) count as last layers. Norms,
// attention itself, routers and the heads never run in FP8.
nn::ComputeOptions DecoderStack::layer_options(int64_t index) const {
  nn::ComputeOptions o = options_;
  if (o.recompute_layers > 0 && index - stage_.first_layer >= o.recompute_layers)
    o.recompute = nn::Recompute::none;
  if (o.fp8) {
    const nn::Fp8Options& f = o.fp8->options();
    if (index < f.bf16_first_layers || index >= spec_.layers - f.bf16_last_layers) o.fp8 = nullptr;
  }
  return o;
}

// Layer `index`'s parameters under their Hugging Face names "model.layers.{index}.*", this rank's shards.
DecoderStack::LayerIds DecoderStack::register_layer(int64_t index, float init_std) {
  FORGE_CHECK(index >= 0 && index < static_cast<int64_t>(spec_.layer_specs.size()),
              "{}: layer {} has no layer spec", source_, index);
  const LayerSpec& layer = spec_.layer_specs[static_cast<size_t>(index)];
  const std::string p = prefix_ + "model.layers." + std::to_string(index) + ".";
  // Output projections feed the residual stream: scale their init by 1/sqrt(2 * depth) (GPT-2/Megatron).
  const float out_std = init_std / std::sqrt(2.0f * static_cast<float>(spec_.init_depth));
  auto norm = [&](const char* name) { return register_norm(p + name); };
  LayerIds ids;
  ids.norm1 = norm("input_layernorm");
  if (layer.attention == AttentionKind::gqa)
    register_gqa(p + "self_attn.", layer, init_std, out_std, ids);
  else
    register_mla(p + "self_attn.", init_std, out_std, ids);
  if (layer.sandwich_norms) {
    ids.post1 = norm("post_attention_layernorm");
    ids.norm2 = norm("pre_feedforward_layernorm");
  } else {
    ids.norm2 = norm("post_attention_layernorm");
  }
  if (layer.feed_forward == FeedForwardKind::moe)
    register_moe(p + spec_.moe_names.block, init_std, out_std, ids);
  else if (layer.feed_forward == FeedForwardKind::gelu_mlp)
    register_gelu_mlp(p + "mlp.", layer.dense_bias, init_std, out_std, ids);
  else
    register_mlp(p + "mlp.", spec_.ffn, init_std, out_std, ids.mlp);
  if (layer.sandwich_norms) ids.post2 = norm("post_feedforward_layernorm");
  return ids;
}

void DecoderStack::register_gqa(const std::string& a, const LayerSpec& layer, float init_std, float out_std,
                                LayerIds& ids) {
  const DecoderSpec& s = spec_;
  const int tp = options_.tp_size(), r = options_.tp_rank();
  const nn::AttentionShape l = local_attention(s, tp);
  const int64_t hidden = s.hidden, d = s.head_dim, qd = s.heads * d, kvd = s.kv_heads * d;
  // Replicated kv heads: rank r's query heads read kv head r * kv / tp; the first of its holders is primary.
  const bool kv_split = s.kv_heads >= tp;
  const int64_t kv_start = kv_split ? r * l.kv_heads * d : (static_cast<int64_t>(r) * s.kv_heads / tp) * d;
  const bool kv_primary = kv_split || r % (tp / s.kv_heads) == 0;
  ids.gqa.q = params_.add(a + "q_proj.weight", {l.heads * d, hidden}, true, Init::normal, init_std,
                          split({qd, hidden}, 0, r * l.heads * d));
  ids.gqa.k = params_.add(a + "k_proj.weight", {l.kv_heads * d, hidden}, true, Init::normal, init_std,
                          split({kvd, hidden}, 0, kv_start, kv_primary));
  ids.gqa.v = params_.add(a + "v_proj.weight", {l.kv_heads * d, hidden}, true, Init::normal, init_std,
                          split({kvd, hidden}, 0, kv_start, kv_primary));
  if (layer.qkv_bias) {
    // No weight decay on biases (as on norms); zero at the start, like the reference initialisations.
    ids.gqa.bias = params_.add(a + "q_proj.bias", {l.heads * d}, false, Init::zeros, 0.0f,
                               split({qd}, 0, r * l.heads * d));
    params_.add(a + "k_proj.bias", {l.kv_heads * d}, false, Init::zeros, 0.0f,
                split({kvd}, 0, kv_start, kv_primary));
    params_.add(a + "v_proj.bias", {l.kv_heads * d}, false, Init::zeros, 0.0f,
                split({kvd}, 0, kv_start, kv_primary));
  }
  ids.gqa.o = params_.add(a + "o_proj.weight", {hidden, l.heads * d}, true, Init::normal, out_std,
                          split({hidden, qd}, 1, r * l.heads * d));
  if (layer.dense_bias)  // whole on every rank: added after the row-parallel sum
    ids.mixer_bias =
        params_.add(a + "o_proj.bias", {hidden}, false, Init::zeros, 0.0f, ShardSpec{-1, 0, {}, r == 0});
  if (layer.qk_norm) {
    // Every rank holds the whole [head_dim] weights and normalises its own heads with them.
    const ShardSpec replicated{-1, 0, {}, r == 0};
    ids.gqa.q_norm = params_.add(a + "q_norm.weight", {d}, false, norm_weight_init(), 0.02f, replicated);
    ids.gqa.k_norm = params_.add(a + "k_norm.weight", {d}, false, norm_weight_init(), 0.02f, replicated);
  }
  ids.gqa.norm_eps = static_cast<float>(s.norm_eps);
  ids.gqa.norm_weight_offset = s.norm_weight_offset;
  ids.gqa.window = layer.window;
  ids.gqa.scale = layer.attention_scale;
  ids.gqa.softcap = layer.attention_softcap;
}

void DecoderStack::register_mla(const std::string& a, float init_std, float out_std, LayerIds& ids) {
  const nn::MlaShape& c = spec_.mla;
  const int tp = options_.tp_size(), r = options_.tp_rank();
  const int64_t h = spec_.hidden, heads = c.heads / tp, qk = c.qk_head_dim();
  const ShardSpec replicated{-1, 0, {}, r == 0};
  const int64_t q_rows = c.heads * qk;
  if (c.q_lora_rank > 0) {
    ids.mla.q_a =
        params_.add(a + "q_a_proj.weight", {c.q_lora_rank, h}, true, Init::normal, init_std, replicated);
    ids.mla.q_a_norm =
        params_.add(a + "q_a_layernorm.weight", {c.q_lora_rank}, false, Init::ones, 0.02f, replicated);
    ids.mla.q_b = params_.add(a + "q_b_proj.weight", {heads * qk, c.q_lora_rank}, true, Init::normal,
                              init_std, split({q_rows, c.q_lora_rank}, 0, r * heads * qk));
  } else {
    ids.mla.q = params_.add(a + "q_proj.weight", {heads * qk, h}, true, Init::normal, init_std,
                            split({q_rows, h}, 0, r * heads * qk));
  }
  const int64_t kv_a = c.kv_a_dim(), kv_head = c.qk_nope_head_dim + c.v_head_dim;
  ids.mla.kv_a =
      params_.add(a + "kv_a_proj_with_mqa.weight", {kv_a, h}, true, Init::normal, init_std, replicated);
  ids.mla.kv_a_norm =
      params_.add(a + "kv_a_layernorm.weight", {c.kv_lora_rank}, false, Init::ones, 0.02f, replicated);
  ids.mla.kv_b = params_.add(a + "kv_b_proj.weight", {heads * kv_head, c.kv_lora_rank}, true, Init::normal,
                             init_std, split({c.heads * kv_head, c.kv_lora_rank}, 0, r * heads * kv_head));
  ids.mla.o = params_.add(a + "o_proj.weight", {h, heads * c.v_head_dim}, true, Init::normal, out_std,
                          split({h, c.heads * c.v_head_dim}, 1, r * heads * c.v_head_dim));
}

void DecoderStack::register_mlp(const std::string& m, int64_t width, float init_std, float out_std,
                                nn::MlpParams& ids) {
  const int tp = options_.tp_size(), r = options_.tp_rank();
  const int64_t h = spec_.hidden, f = width / tp;
  ids.gate =
      params_.add(m + "gate_proj.weight", {f, h}, true, Init::normal, init_std, split({width, h}, 0, r * f));
  ids.up =
      params_.add(m + "up_proj.weight", {f, h}, true, Init::normal, init_std, split({width, h}, 0, r * f));
  ids.down =
      params_.add(m + "down_proj.weight", {h, f}, true, Init::normal, out_std, split({h, width}, 1, r * f));
}

// c_fc column-parallel with its bias, c_proj row-parallel; c_proj's bias whole on every rank.
void DecoderStack::register_gelu_mlp(const std::string& m, bool bias, float init_std, float out_std,
                                     LayerIds& ids) {
  const int tp = options_.tp_size(), r = options_.tp_rank();
  const int64_t h = spec_.hidden, width = spec_.ffn, f = width / tp;
  ids.gelu_mlp.fc =
      params_.add(m + "c_fc.weight", {f, h}, true, Init::normal, init_std, split({width, h}, 0, r * f));
  if (bias)
    ids.gelu_mlp.fc_bias =
        params_.add(m + "c_fc.bias", {f}, false, Init::zeros, 0.0f, split({width}, 0, r * f));
  ids.gelu_mlp.proj =
      params_.add(m + "c_proj.weight", {h, f}, true, Init::normal, out_std, split({h, width}, 1, r * f));
  if (bias)
    ids.ffn_bias =
        params_.add(m + "c_proj.bias", {h}, false, Init::zeros, 0.0f, ShardSpec{-1, 0, {}, r == 0});
}

// The routed experts go gate_0, up_0, gate_1, up_1, ..., then down_0, down_1, ... (nn::Moe's stacked
// operands); the names are Hugging Face's, so the order does not matter to loading. The router's correction
// bias is a parameter that never gets a gradient (weight decay off), moved once per optimizer step.
void DecoderStack::register_moe(const std::string& p, float init_std, float out_std, LayerIds& ids) {
  const nn::MoeShape& c = spec_.moe;
  const int tp = options_.tp_size(), r = options_.tp_rank();
  const int64_t h = spec_.hidden, experts = c.experts, width = c.expert_ffn, f = width / tp;
  const ShardSpec replicated{-1, 0, {}, r == 0};
  const DecoderSpec::MoeNames& names = spec_.moe_names;
  ids.moe.router = params_.add(p + "gate.weight", {experts, h}, true, Init::normal, init_std, replicated);
  if (names.correction_bias)
    ids.moe.bias =
        params_.add(p + "gate.e_score_correction_bias", {experts}, false, Init::zeros, 0.0f, replicated);
  // Expert parallelism: this rank's experts only, under their global names, in their own reduction group
  // (over the expert-data-parallel ranks that hold the same experts).
  const int64_t local = experts / options_.ep_size(), first = options_.ep_rank() * local;
  const std::string group = options_.ep_size() > 1 ? "experts" : "dense";
  for (int64_t e = first; e < first + local; ++e) {
    const std::string m = p + "experts." + std::to_string(e) + ".";
    const int gate = params_.add(m + names.gate + ".weight", {f, h}, true, Init::normal, init_std,
                                 split({width, h}, 0, r * f), group);
    params_.add(m + names.up + ".weight", {f, h}, true, Init::normal, init_std, split({width, h}, 0, r * f),
                group);
    if (e == first) ids.moe.first_gate_up = gate;
  }
  for (int64_t e = first; e < first + local; ++e) {
    const std::string m = p + "experts." + std::to_string(e) + ".";
    const int down = params_.add(m + names.down + ".weight", {h, f}, true, Init::normal, out_std,
                                 split({h, width}, 1, r * f), group);
    if (e == first) ids.moe.first_down = down;
  }
  if (c.shared_ffn > 0) register_mlp(p + "shared_experts.", c.shared_ffn, init_std, out_std, ids.moe.shared);
}

nn::DecoderLayer DecoderStack::make_layer(int64_t index, const LayerIds& ids,
                                          const nn::ComputeOptions& options) {
  const DecoderSpec& s = spec_;
  const LayerSpec& layer = s.layer_specs[static_cast<size_t>(index)];
  const int tp = options_.tp_size();
  std::unique_ptr<nn::LayerPart> mixer, ffn;
  if (layer.attention == AttentionKind::gqa) {
    FORGE_CHECK(!layer.local_rope || local_rope_.positions > 0,
                "{}: layer {} asks for a local RoPE table the "
                "spec does not have",
                source_, index);
    mixer = std::make_unique<nn::Attention>(&params_, ids.gqa, local_attention(s, tp),
                                            layer.local_rope ? &local_rope_ : &rope_, options);
  } else {
    nn::MlaShape mla = s.mla;
    mla.heads = s.mla.heads / tp;
    mixer = std::make_unique<nn::MlaAttention>(&params_, ids.mla, mla, &rope_, options);
  }
  if (layer.feed_forward == FeedForwardKind::gelu_mlp) {
    ffn = std::make_unique<nn::GeluMlp>(&params_, ids.gelu_mlp, s.hidden, s.ffn / tp, options, s.gelu);
  } else if (layer.feed_forward != FeedForwardKind::moe) {
    const auto act = layer.feed_forward == FeedForwardKind::geglu ? ops::GluActivation::gelu_tanh
                                                                  : ops::GluActivation::silu;
    ffn = std::make_unique<nn::Mlp>(&params_, ids.mlp, s.hidden, s.ffn / tp, options, act);
  } else {
    nn::MoeShape moe = s.moe;
    moe.hidden = s.hidden, moe.expert_ffn = s.moe.expert_ffn / tp, moe.shared_ffn = s.moe.shared_ffn / tp;
    moe.capacity_factor = options_.moe_capacity_factor;
    moe.pad_to_capacity = options_.moe_pad_to_capacity;
    // An extension's layer past the model's (MTP depth k: under context parallelism it keeps every position,
    // the last k of each sequence padding).
    moe.padded_tail = index >= s.layers ? index - s.layers + 1 : 0;
    moe_stats_.emplace_back();
    const int64_t slot = static_cast<int64_t>(moe_stats_.size()) - 1;
    auto experts = std::make_unique<nn::Moe>(&params_, ids.moe, moe, options, &moe_stats_.back(), &moe_scale_,
                                             spec_.router_aux_loss_coef > 0 ? slot : -1);
    moe_layers_.push_back(experts.get());
    moe_layer_ids_.emplace_back(index, ids.moe.bias);
    ffn = std::move(experts);
  }
  const nn::LayerNorms norms{
      ids.norm1, ids.post1,  ids.norm2, ids.post2, static_cast<float>(s.norm_eps), s.norm_weight_offset,
      s.norm,    s.norm_bias};
  return nn::DecoderLayer(&params_, norms, std::move(mixer), std::move(ffn), options,
                          nn::BranchBiases{ids.mixer_bias, ids.ffn_bias});
}

int DecoderStack::register_extra_layer(int64_t index, float init_std) {
  extra_ids_.emplace_back(index, register_layer(index, init_std));
  return static_cast<int>(extra_ids_.size()) - 1;
}

nn::DecoderLayer DecoderStack::build_extra_layer(int registration, const nn::ComputeOptions& options) {
  const auto& [index, ids] = extra_ids_.at(static_cast<size_t>(registration));
  return make_layer(index, ids, options);
}

void DecoderStack::sum_over_group(int id) {
  nn::TensorParallel* group = tp();
  const Device device = options_.device;
  params_.add_grad_finalizer({id}, [this, group, device, id] {
    group->all_reduce_sum(params_.grad(id).f32(), params_.grad(id).numel(), device);
  });
}

// Gradients that several tensor-parallel ranks hold copies of, each having seen only part of them, are summed
// over the group as soon as they are final: MLA's replicated latent projections and norms and the QK-norm
// weights (each rank saw only its heads; a kv head replicated over ranks saw part of its gradient on each),
// kv heads replicated over ranks (each holder saw only its own query heads), the norm weights under sequence
// parallelism (each rank normed only its rows; so too the norms' biases and the output projections' biases,
// each rank adding them to its rows only), and what the tail names.
void DecoderStack::register_tensor_parallel_sums() {
  nn::TensorParallel* group = tp();
  if (!group) return;
  const Device device = options_.device;
  for (const nn::DecoderLayer& layer : layers_)
    if (const auto* mla = dynamic_cast<const nn::MlaAttention*>(&layer.mixer()))
      for (int id : mla->replicated_params()) sum_over_group(id);
  for (const LayerIds& ids : layer_ids_)
    if (ids.gqa.q_norm >= 0) sum_over_group(ids.gqa.q_norm), sum_over_group(ids.gqa.k_norm);
  if (tail_)
    for (int id : tail_->tensor_parallel_sums()) sum_over_group(id);
  if (group->sequence_parallel()) {
    for (const LayerIds& ids : layer_ids_) {
      for (int id : norm_parameters({ids.norm1, ids.norm2, ids.post1, ids.post2})) sum_over_group(id);
      for (int id : {ids.mixer_bias, ids.ffn_bias})
        if (id >= 0) sum_over_group(id);
    }
    if (stage_.post_process)
      for (int id : norm_parameters({norm_id_})) sum_over_group(id);
  }
  const int64_t kv_heads = spec_.kv_heads;
  if (kv_heads >= group->size()) return;
  // Sum the copies of each kv head through a buffer of all kv heads in which each rank fills its head's slot
  // (the k and v weights, and their biases when the layer has them).
  const int64_t head = static_cast<int64_t>(group->rank()) * kv_heads / group->size();
  auto sum_kv_copies = [&](int k, int v, int64_t per_head) {
    params_.add_grad_finalizer({k, v}, [this, group, device, k, v, kv_heads, per_head, head] {
      Tensor buffer = Tensor::zeros({2, kv_heads, per_head}, DType::f32, device);
      const int kv_ids[2] = {k, v};
      for (int kv = 0; kv < 2; ++kv)
        buffer.view((kv * kv_heads + head) * per_head, {per_head})
            .copy_from(params_.grad(kv_ids[kv]).reshape({per_head}));
      group->all_reduce_sum(buffer.f32(), buffer.numel(), device);
      for (int kv = 0; kv < 2; ++kv)
        params_.grad(kv_ids[kv])
            .reshape({per_head})
            .copy_from(buffer.view((kv * kv_heads + head) * per_head, {per_head}));
    });
  };
  for (size_t l = 0; l < layer_ids_.size(); ++l) {
    const LayerIds& ids = layer_ids_[l];
    if (ids.gqa.k < 0) continue;
    sum_kv_copies(ids.gqa.k, ids.gqa.v, spec_.head_dim * spec_.hidden);
    if (ids.gqa.bias >= 0) sum_kv_copies(ids.gqa.bias + 1, ids.gqa.bias + 2, spec_.head_dim);
  }
}

}  // namespace forge::models
