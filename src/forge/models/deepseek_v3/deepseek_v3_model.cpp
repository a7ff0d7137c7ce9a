#include "forge/models/deepseek_v3/deepseek_v3_model.h"

#include <algorithm>
#include <cmath>

#include "forge/core/device.h"
#include "forge/core/memory.h"
#include "forge/kernels/emulated_device.h"
#include "forge/kernels/ops.h"
#include "forge/nn/context_parallel.h"
#include "forge/nn/fp8_context.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::models {
namespace {
// A host array of token ids on `device`: the array itself on the CPU, else a copy kept alive by `holder`.
const int32_t* ids_on(Device device, const int32_t* ids, int64_t n, Tensor& holder) {
  if (device == Device::cpu || ids == nullptr) return ids;
  Tensor host = Tensor::empty({n}, DType::i32);
  std::copy_n(ids, n, host.i32());
  holder = host.to(device);
  return holder.i32();
}

// Slice [start, start + local) of the global tensor along dim 0 (rows) or 1 (columns).
ShardSpec split(Shape global, int dim, int64_t start, bool primary = true) {
  return ShardSpec{dim, start, std::move(global), primary};
}

// Columns [offset, offset + cols) of each of `rows` rows of dst (row stride dst_stride) from src's rows
// (stride src_stride, from column src_offset), through the op table's row copy.
void copy_columns(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows,
                  int64_t cols, Device device) {
  ops::KvAppendParams p;
  p.batch = rows, p.tokens = 1, p.kv_heads = 1, p.head_dim = cols;
  p.qkv = src, p.qkv_stride = src_stride, p.k_offset = 0, p.v_offset = 0;
  p.keys = dst, p.values = dst, p.batch_stride = dst_stride, p.head_stride = 0, p.position = 0;
  ops::kv_append(p, device);
}
}  // namespace

// One MTP depth's state of one micro-batch.
struct MtpSaved {
  int64_t length = 0;  // positions per sequence: seq - k
  Tensor ids_holder, targets_holder;
  std::vector<int32_t> ids, targets;  // host: t_{i+k} and targets[:, k:]
  const int32_t* device_ids = nullptr;
  nn::RmsNorm::Saved enorm, hnorm, head_norm;
  nn::GemmOperand joined;  // [enorm(emb), hnorm(h)] as eh_proj reads it
  nn::GemmOperand dy;      // eh_proj's output gradient, for W
  nn::DecoderLayer::Saved layer;
  Tensor dhead;  // the head's gradient at shared_head.norm's output
  Tensor demb;   // the gradient at the embedding's output, for W
  Tensor dnext;  // the gradient of h_k from depth k + 1 ([rows, hidden] of this depth; empty: none)
  float grad_scale = 0;
};

struct DeepseekV3Model::Activations final : StageActivations {
  int64_t batch = 0, seq = 0;
  Tensor ids_holder;
  const int32_t* device_ids = nullptr;
  std::vector<nn::DecoderLayer::Saved> layers;
  nn::RmsNorm::Saved norm;
  Tensor dhead, dembed;
  std::vector<MtpSaved> mtp;
  bool input_done = false, weight_done = false;
};

DeepseekV3Model::DeepseekV3Model(const DeepseekV3Config& config, nn::ComputeOptions options, float init_std,
                                 bool with_grads, StageSpec stage, ParameterStore* into,
                                 DeepseekV3Options model_options)
    : config_(config),
      options_(options),
      stage_(stage),
      model_options_(model_options),
      params_(into ? *into : own_params_) {
  const std::string source = config.origin.name.empty() ? "model config" : config.origin.name;
  config_.validate(source);
  const int64_t layers = config.num_hidden_layers;
  if (stage_.end_layer < 0) stage_.end_layer = layers;
  if (stage_.first_layer < 0 || stage_.first_layer > stage_.end_layer || stage_.end_layer > layers)
    fail("{}: stage layers [{}, {}) are outside the model's {} layers", source, stage_.first_layer,
         stage_.end_layer, layers);
  if (config.topk_method != DeepseekV3Config::TopkMethod::noaux_tc)
    fail("{}: topk_method 'greedy' is not supported yet (only noaux_tc)", source);
  const bool on_host = options.device == Device::cpu;
  // A dry run (kernels/emulated_device.h, the simulator's traces) initialises nothing on the host.
  if (!EmulatedDevice::check_only())
    config_.check_fits_in_memory(on_host && with_grads, on_host && options.gemm_dtype == DType::bf16,
                                 host_memory_bytes(), source);
  const int tp_size = options.tp_size(), rank = options.tp_rank();
  if (config.n_routed_experts % options.ep_size() != 0)
    fail("{}: n_routed_experts = {} does not split over parallel.ep = {}", source, config.n_routed_experts,
         options.ep_size());
  if (config.num_attention_heads % tp_size != 0 || config.intermediate_size % tp_size != 0 ||
      config.moe_intermediate_size % tp_size != 0)
    fail("{}: {} heads, ffn {} and expert ffn {} do not split over tp = {}", source,
         config.num_attention_heads, config.intermediate_size, config.moe_intermediate_size, tp_size);
  const int64_t depth = stage_.post_process && model_options.with_mtp ? config.num_nextn_predict_layers : 0;
  if (depth > 0 && tp() && tp()->sequence_parallel())
    mtp_tp_ = std::make_unique<nn::WithoutSequenceParallel>(tp());
  const int64_t h = config.hidden_size, v = config.vocab_size;
  const int64_t unit = std::max<int64_t>(1, options.vocab_divisible_by) * tp_size;
  padded_vocab_ = tp_size > 1 ? (v + unit - 1) / unit * unit : v;
  local_vocab_ = padded_vocab_ / tp_size, vocab_start_ = rank * local_vocab_;
  const ShardSpec vocab_shard{0, vocab_start_, {v, h}, true};
  const ShardSpec replicated{-1, 0, {}, rank == 0};

  // The embedding: the first stage's, and the MTP modules' input (a last stage without the first holds its
  // own copy under the same name, the same values since initialisation depends on the name).
  const bool needs_embedding = stage_.pre_process || depth > 0;
  const bool tied = config.tie_word_embeddings;
  const int existing_embedding = params_.find("model.embed_tokens.weight");
  int embedding_uses = 0;
  if (needs_embedding || (tied && stage_.post_process)) {
    embed_id_ = existing_embedding >= 0 ? existing_embedding
                                        : params_.add("model.embed_tokens.weight", {local_vocab_, h}, true,
                                                      Init::normal, init_std, vocab_shard);
    embedding_uses = (stage_.pre_process ? 1 : 0) + static_cast<int>(depth);
  }
  for (int64_t i = stage_.first_layer; i < stage_.end_layer; ++i)
    layer_ids_.push_back(register_layer(i, init_std));
  if (stage_.post_process) {
    norm_id_ = params_.add("model.norm.weight", {h}, false, Init::ones, 0.02f, replicated);
    const int head_uses = 1 + static_cast<int>(depth);
    if (tied) {
      head_id_ = embed_id_;
      embedding_uses += head_uses;
    } else {
      head_id_ = params_.add("lm_head.weight", {local_vocab_, h}, true, Init::normal, init_std, vocab_shard);
      params_.set_grad_uses(head_id_, head_uses);
    }
    for (int64_t k = 0; k < depth; ++k) {
      const std::string p = "model.layers." + std::to_string(layers + k) + ".";
      MtpIds ids;
      ids.enorm = params_.add(p + "enorm.weight", {h}, false, Init::ones, 0.02f, replicated);
      ids.hnorm = params_.add(p + "hnorm.weight", {h}, false, Init::ones, 0.02f, replicated);
      ids.eh_proj = params_.add(p + "eh_proj.weight", {h, 2 * h}, true, Init::normal, init_std,
                                ShardSpec{-1, 0, {}, rank == 0});
      ids.layer = register_layer(layers + k, init_std);
      ids.head_norm = params_.add(p + "shared_head.norm.weight", {h}, false, Init::ones, 0.02f, replicated);
      mtp_ids_.push_back(ids);
    }
  }
  if (embed_id_ >= 0) {
    if (existing_embedding >= 0) embedding_uses += params_.info(embed_id_).grad_uses;
    params_.set_grad_uses(embed_id_, std::max(1, embedding_uses));
  }
  if (!into) params_.allocate(options.gemm_dtype == DType::bf16, with_grads, options.device);

  // RoPE of the qk_rope_head_dim channels: cos/sin of t * inv_freq, times YaRN's attention factor.
  const std::vector<double> inv_freq = config.rope_inv_freq();
  const double factor = config.rope_attention_factor();
  rope_.positions = config.max_position_embeddings;
  rope_.half_dim = config.qk_rope_head_dim / 2;
  rope_.cos = Tensor::empty({rope_.positions, rope_.half_dim}, DType::f32);
  rope_.sin = Tensor::empty({rope_.positions, rope_.half_dim}, DType::f32);
  for (int64_t t = 0; t < rope_.positions; ++t)
    for (int64_t i = 0; i < rope_.half_dim; ++i) {
      const double angle = static_cast<double>(t) * inv_freq[static_cast<size_t>(i)];
      rope_.cos.f32()[t * rope_.half_dim + i] = static_cast<float>(std::cos(angle) * factor);
      rope_.sin.f32()[t * rope_.half_dim + i] = static_cast<float>(std::sin(angle) * factor);
    }
  rope_.cos = rope_.cos.to(options.device), rope_.sin = rope_.sin.to(options.device);

  if (embed_id_ >= 0) embedding_ = nn::Embedding(&params_, embed_id_, tp());
  for (size_t l = 0; l < layer_ids_.size(); ++l)
    layers_.push_back(make_layer(stage_.first_layer + static_cast<int64_t>(l), layer_ids_[l]));
  const float eps = static_cast<float>(config.rms_norm_eps);
  if (stage_.post_process) {
    final_norm_ = nn::RmsNorm(&params_, norm_id_, eps);
    head_ = nn::LossHead(&params_, head_id_, v, vocab_start_, options);
    if (!mtp_ids_.empty()) {
      nn::ComputeOptions mtp_options = options;
      if (mtp_tp_) mtp_options.tp = mtp_tp_.get();
      mtp_embedding_ =
          nn::Embedding(&params_, embed_id_, mtp_options.tp_size() > 1 ? mtp_options.tp : nullptr);
      mtp_head_ = nn::LossHead(&params_, head_id_, v, vocab_start_, mtp_options);
    }
    for (size_t k = 0; k < mtp_ids_.size(); ++k) {
      const MtpIds& ids = mtp_ids_[k];
      auto m = std::make_unique<MtpModule>();
      m->enorm = nn::RmsNorm(&params_, ids.enorm, eps);
      m->hnorm = nn::RmsNorm(&params_, ids.hnorm, eps);
      m->head_norm = nn::RmsNorm(&params_, ids.head_norm, eps);
      nn::ComputeOptions local = layer_options(layers + static_cast<int64_t>(k));
      local.tp = nullptr;  // eh_proj is replicated: every rank computes it whole
      m->eh_proj = nn::Linear(&params_, {ids.eh_proj}, 2 * h, local);
      m->layer = make_layer(layers + static_cast<int64_t>(k), ids.layer);
      mtp_.push_back(std::move(m));
    }
  }
  if (options.fp8 && !into) options.fp8->seal();
  mtp_stats_.resize(mtp_.size());
  step_mtp_.resize(mtp_.size());
  if (with_grads) register_tensor_parallel_sums();
}

// FP8: every decoder layer's Linears (MLA's projections, the experts, the shared experts, dense MLPs) except
// the first and last fp8.bf16_*_layers, which keep the GEMM dtype; the MTP modules (indices past the last
// layer) count as last layers. The router, the norms, attention itself and the heads never run in FP8.
nn::ComputeOptions DeepseekV3Model::layer_options(int64_t index) const {
  nn::ComputeOptions o = options_;
  if (o.fp8) {
    const nn::Fp8Options& f = o.fp8->options();
    if (index < f.bf16_first_layers || index >= config_.num_hidden_layers - f.bf16_last_layers)
      o.fp8 = nullptr;
  }
  if (index >= config_.num_hidden_layers && mtp_tp_) o.tp = mtp_tp_.get();
  return o;
}

// Layer `index`'s parameters under "model.layers.{index}.*" (index >= num_hidden_layers: an MTP module's
// layer), this rank's shards. The routed experts go gate_0, up_0, gate_1, up_1, ..., then down_0, down_1, ...
// (nn::Moe's stacked operands); the names are Hugging Face's, so the order does not matter to loading.
DeepseekV3Model::LayerIds DeepseekV3Model::register_layer(int64_t index, float init_std) {
  const DeepseekV3Config& c = config_;
  const std::string p = "model.layers." + std::to_string(index) + ".";
  const int tp = options_.tp_size(), r = options_.tp_rank();
  const int64_t h = c.hidden_size, heads = c.num_attention_heads / tp, qk = c.qk_head_dim();
  const ShardSpec replicated{-1, 0, {}, r == 0};
  const float out_std = init_std / std::sqrt(2.0f * static_cast<float>(c.num_layers_with_mtp()));
  LayerIds ids;
  ids.norm1 = params_.add(p + "input_layernorm.weight", {h}, false, Init::ones, 0.02f, replicated);
  const std::string a = p + "self_attn.";
  const int64_t q_rows = c.num_attention_heads * qk;
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
  const int64_t kv_a = c.kv_lora_rank + c.qk_rope_head_dim, kv_head = c.qk_nope_head_dim + c.v_head_dim;
  ids.mla.kv_a =
      params_.add(a + "kv_a_proj_with_mqa.weight", {kv_a, h}, true, Init::normal, init_std, replicated);
  ids.mla.kv_a_norm =
      params_.add(a + "kv_a_layernorm.weight", {c.kv_lora_rank}, false, Init::ones, 0.02f, replicated);
  ids.mla.kv_b =
      params_.add(a + "kv_b_proj.weight", {heads * kv_head, c.kv_lora_rank}, true, Init::normal, init_std,
                  split({c.num_attention_heads * kv_head, c.kv_lora_rank}, 0, r * heads * kv_head));
  ids.mla.o = params_.add(a + "o_proj.weight", {h, heads * c.v_head_dim}, true, Init::normal, out_std,
                          split({h, c.num_attention_heads * c.v_head_dim}, 1, r * heads * c.v_head_dim));
  ids.norm2 = params_.add(p + "post_attention_layernorm.weight", {h}, false, Init::ones, 0.02f, replicated);
  auto mlp = [&](const std::string& m, int64_t width, nn::MlpParams& out) {
    const int64_t f = width / tp;
    out.gate = params_.add(m + "gate_proj.weight", {f, h}, true, Init::normal, init_std,
                           split({width, h}, 0, r * f));
    out.up =
        params_.add(m + "up_proj.weight", {f, h}, true, Init::normal, init_std, split({width, h}, 0, r * f));
    out.down =
        params_.add(m + "down_proj.weight", {h, f}, true, Init::normal, out_std, split({h, width}, 1, r * f));
  };
  ids.moe = c.is_moe_layer(index);
  if (!ids.moe) {
    mlp(p + "mlp.", c.intermediate_size, ids.dense);
    return ids;
  }
  const int64_t experts = c.n_routed_experts, width = c.moe_intermediate_size, f = width / tp;
  ids.experts.router =
      params_.add(p + "mlp.gate.weight", {experts, h}, true, Init::normal, init_std, replicated);
  ids.experts.bias =
      params_.add(p + "mlp.gate.e_score_correction_bias", {experts}, false, Init::zeros, 0.0f, replicated);
  // Expert parallelism: this rank's experts only, under their global names, in their own reduction group
  // (over the expert-data-parallel ranks that hold the same experts).
  const int64_t local = experts / options_.ep_size(), first = options_.ep_rank() * local;
  const std::string group = options_.ep_size() > 1 ? "experts" : "dense";
  for (int64_t e = first; e < first + local; ++e) {
    const std::string m = p + "mlp.experts." + std::to_string(e) + ".";
    const int gate = params_.add(m + "gate_proj.weight", {f, h}, true, Init::normal, init_std,
                                 split({width, h}, 0, r * f), group);
    params_.add(m + "up_proj.weight", {f, h}, true, Init::normal, init_std, split({width, h}, 0, r * f),
                group);
    if (e == first) ids.experts.first_gate_up = gate;
  }
  for (int64_t e = first; e < first + local; ++e) {
    const std::string m = p + "mlp.experts." + std::to_string(e) + ".";
    const int down = params_.add(m + "down_proj.weight", {h, f}, true, Init::normal, out_std,
                                 split({h, width}, 1, r * f), group);
    if (e == first) ids.experts.first_down = down;
  }
  if (c.n_shared_experts > 0) mlp(p + "mlp.shared_experts.", width * c.n_shared_experts, ids.experts.shared);
  return ids;
}

nn::DecoderLayer DeepseekV3Model::make_layer(int64_t index, const LayerIds& ids) {
  const DeepseekV3Config& c = config_;
  const int tp = options_.tp_size();
  const nn::ComputeOptions options = layer_options(index);
  nn::MlaShape mla;
  mla.hidden = c.hidden_size, mla.heads = c.num_attention_heads / tp, mla.q_lora_rank = c.q_lora_rank;
  mla.kv_lora_rank = c.kv_lora_rank, mla.qk_nope_head_dim = c.qk_nope_head_dim;
  mla.qk_rope_head_dim = c.qk_rope_head_dim, mla.v_head_dim = c.v_head_dim;
  mla.rope_interleave = c.rope_interleave, mla.softmax_scale = static_cast<float>(c.softmax_scale());
  mla.latent_norm_eps = 1e-6f;  // HF builds the latent norms with RMSNorm's default eps
  auto mixer = std::make_unique<nn::MlaAttention>(&params_, ids.mla, mla, &rope_, options);
  std::unique_ptr<nn::LayerPart> ffn;
  if (!ids.moe) {
    ffn = std::make_unique<nn::Mlp>(&params_, ids.dense, c.hidden_size, c.intermediate_size / tp, options);
  } else {
    nn::MoeShape s;
    s.hidden = c.hidden_size, s.experts = c.n_routed_experts, s.top_k = c.num_experts_per_tok;
    s.groups = c.n_group, s.topk_groups = c.topk_group, s.expert_ffn = c.moe_intermediate_size / tp;
    s.shared_ffn = c.n_shared_experts * c.moe_intermediate_size / tp;
    s.score = c.scoring_func == DeepseekV3Config::ScoringFunc::sigmoid ? ops::MoeScore::sigmoid
                                                                       : ops::MoeScore::softmax;
    s.normalize = c.norm_topk_prob, s.scaling = static_cast<float>(c.routed_scaling_factor);
    s.capacity_factor = options_.moe_capacity_factor;
    s.pad_to_capacity = options_.moe_pad_to_capacity;
    // MTP depth k's layer (under context parallelism it keeps every position, the last k of each sequence
    // padding: mtp_forward).
    s.padded_tail = index >= c.num_hidden_layers ? index - c.num_hidden_layers + 1 : 0;
    moe_stats_.emplace_back();
    auto moe =
        std::make_unique<nn::Moe>(&params_, ids.experts, s, options, &moe_stats_.back(), &balance_scale_);
    moe_layers_.push_back(moe.get());
    moe_layer_ids_.emplace_back(index, ids.experts.bias);
    ffn = std::move(moe);
  }
  return nn::DecoderLayer(&params_, ids.norm1, std::move(mixer), ids.norm2, std::move(ffn),
                          static_cast<float>(c.rms_norm_eps), options);
}

// Gradients each tensor-parallel rank holds only a share of are summed over the group once final: MLA's
// replicated latent projections and norms (each rank saw only its heads), and under sequence parallelism the
// layer norms (each rank normed only its rows).
void DeepseekV3Model::register_tensor_parallel_sums() {
  nn::TensorParallel* group = tp();
  if (!group) return;
  const Device device = options_.device;
  auto sum_over_group = [this, group, device](int id) {
    params_.add_grad_finalizer({id}, [this, group, device, id] {
      group->all_reduce_sum(params_.grad(id).f32(), params_.grad(id).numel(), device);
    });
  };
  for (const nn::DecoderLayer& layer : layers_)
    for (int id : static_cast<const nn::MlaAttention&>(layer.mixer()).replicated_params()) sum_over_group(id);
  for (const auto& m : mtp_)
    for (int id : static_cast<const nn::MlaAttention&>(m->layer.mixer()).replicated_params())
      sum_over_group(id);
  // The MTP modules' norms see every row on every rank (mtp_tp_: no sequence parallelism), so their
  // gradients are whole already.
  if (group->sequence_parallel()) {
    for (const LayerIds& ids : layer_ids_) sum_over_group(ids.norm1), sum_over_group(ids.norm2);
    if (stage_.post_process) sum_over_group(norm_id_);
  }
}

nn::TensorParallel* DeepseekV3Model::tp() const {
  return options_.tp && options_.tp->size() > 1 ? options_.tp : nullptr;
}

void DeepseekV3Model::require_whole(const char* what) const {
  if (!stage_.pre_process || !stage_.post_process || stage_.first_layer != 0 ||
      stage_.end_layer != config_.num_hidden_layers)
    fail("{} needs the whole model; this stage holds layers [{}, {}){}{}", what, stage_.first_layer,
         stage_.end_layer, stage_.pre_process ? " with the embedding" : "",
         stage_.post_process ? " with the head" : "");
}

void DeepseekV3Model::check_inputs(const MicroBatch& mb) const {
  if (mb.batch <= 0 || mb.seq <= 0)
    fail("batch ({}) and sequence length ({}) must be positive", mb.batch, mb.seq);
  if (mb.seq > config_.max_position_embeddings)
    fail("sequence length {} exceeds max_position_embeddings {}", mb.seq, config_.max_position_embeddings);
  const int64_t n = mb.batch * mb.seq;
  const bool needs_ids = stage_.pre_process || !mtp_.empty();
  if (needs_ids) {
    FORGE_CHECK(mb.ids != nullptr, "{} needs token ids", stage_.pre_process ? "the first stage" : "MTP");
    for (int64_t i = 0; i < n; ++i)
      if (mb.ids[i] < 0 || mb.ids[i] >= config_.vocab_size)
        fail("token id {} at position {} is outside the vocabulary [0, {})", mb.ids[i], i,
             config_.vocab_size);
  }
  if (stage_.post_process && mb.targets)
    for (int64_t i = 0; i < n; ++i)
      if (mb.targets[i] >= config_.vocab_size)
        fail("target id {} at position {} is outside the vocabulary [0, {})", mb.targets[i], i,
             config_.vocab_size);
  if (mtp_.size() > 0 && mb.seq <= static_cast<int64_t>(mtp_.size()))
    fail("sequence length {} leaves no positions for MTP depth {}", mb.seq, mtp_.size());
  if (tp() && tp()->sequence_parallel() && n % tp()->size() != 0)
    fail("sequence parallelism splits the {} x {} token rows over tp = {} ranks: they do not divide",
         mb.batch, mb.seq, tp()->size());
}

StageOutput DeepseekV3Model::forward(const MicroBatch& mb, const Tensor& hidden,
                                     std::unique_ptr<StageActivations>* saved) {
  if (saved && !params_.has_grads())
    fail("forward for backward: this model was built for inference, without gradients");
  check_inputs(mb);
  if (stage_.post_process) FORGE_CHECK(mb.targets != nullptr, "the last stage needs targets");
  // Training micro-batches (those that will run backward) feed the FP8 amax history.
  const nn::Fp8Recording fp8_recording(options_.fp8, saved != nullptr);
  auto acts = std::make_unique<Activations>();
  acts->batch = mb.batch, acts->seq = mb.seq;
  const int64_t n = mb.batch * mb.seq;
  Tensor x;
  if (stage_.pre_process) {
    acts->device_ids = ids_on(options_.device, mb.ids, n, acts->ids_holder);
    x = embedding_.forward(acts->device_ids, n);
  } else {
    const int64_t rows = tp() && tp()->sequence_parallel() ? n / tp()->size() : n;
    FORGE_CHECK(hidden.defined() && hidden.numel() == rows * config_.hidden_size,
                "stage input: {} elements, expected [{}, {}] hidden states",
                hidden.defined() ? hidden.numel() : 0, rows, config_.hidden_size);
    x = hidden;
  }
  if (saved) acts->layers.resize(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    nn::DecoderLayer::Saved scratch;
    x = layers_[l].forward(x, mb.batch, mb.seq, saved ? acts->layers[l] : scratch);
  }
  StageOutput out;
  if (!stage_.post_process) {
    out.hidden = x;
  } else {
    nn::RmsNorm::Saved scratch;
    const Tensor normed = final_norm_.forward(x, saved ? acts->norm : scratch);
    Tensor targets_holder;
    const int32_t* device_targets = ids_on(options_.device, mb.targets, n, targets_holder);
    const nn::LossTotals loss =
        head_.forward(normed, mb.targets, device_targets, mb.grad_scale, saved ? &acts->dhead : nullptr);
    out.loss.sum = loss.sum, out.loss.tokens = loss.tokens;
    if (!mtp_.empty()) mtp_forward(mb, x, loss.tokens, saved ? acts.get() : nullptr);
  }
  if (saved) *saved = std::move(acts);
  return out;
}

// Every MTP depth from h_0 = x (the last layer's output before the final norm).
void DeepseekV3Model::mtp_forward(const MicroBatch& mb, const Tensor& h0, int64_t main_tokens,
                                  Activations* acts) {
  const int64_t batch = mb.batch, seq = mb.seq, h = config_.hidden_size;
  const Device device = options_.device;
  const float weight = model_options_.mtp_weight / static_cast<float>(mtp_.size());
  std::vector<MtpSaved> scratch(acts ? 0 : mtp_.size());
  std::vector<MtpSaved>& states = acts ? acts->mtp : scratch;
  if (acts) states.resize(mtp_.size());
  // h_{k-1}: [batch, seq - k + 1, hidden], every row (gathered from the shards under sequence parallelism).
  Tensor prev = mtp_tp_ ? tp()->all_gather_rows(h0) : h0;
  // Under context parallelism every depth keeps all of the rank's positions: the ids and targets shifted by
  // k come across the chunks (ContextParallel::shift_tokens), the last k positions of each sequence with no
  // target (ignored, and causal attention keeps them from every position that has one).
  nn::ContextParallel* cp = options_.cp;
  for (size_t d = 0; d < mtp_.size(); ++d) {
    const MtpModule& m = *mtp_[d];
    MtpSaved& s = states[d];
    const int64_t k = static_cast<int64_t>(d) + 1, length = cp ? seq : seq - k, rows = batch * length;
    s.length = length;
    s.ids.resize(static_cast<size_t>(rows)), s.targets.resize(static_cast<size_t>(rows));
    if (cp) {
      cp->shift_tokens(mb.ids, s.ids.data(), batch, seq, k, 0);
      cp->shift_tokens(mb.targets, s.targets.data(), batch, seq, k, -1);
    } else {
      for (int64_t b = 0; b < batch; ++b)
        for (int64_t i = 0; i < length; ++i) {
          s.ids[static_cast<size_t>(b * length + i)] = mb.ids[b * seq + i + k];
          s.targets[static_cast<size_t>(b * length + i)] = mb.targets[b * seq + i + k];
        }
    }
    s.device_ids = ids_on(device, s.ids.data(), rows, s.ids_holder);
    // h_{k-1} at positions 0 .. length - 1 of each sequence.
    Tensor sliced = cp ? prev : Tensor::empty({rows, h}, DType::f32, device);
    for (int64_t b = 0; b < batch && !cp; ++b)
      sliced.view(b * length * h, {length, h}).copy_from(prev.view(b * (length + 1) * h, {length, h}));
    const Tensor emb = mtp_embedding_.forward(s.device_ids, rows);
    const Tensor en = m.enorm.forward(emb, s.enorm), hn = m.hnorm.forward(sliced, s.hnorm);
    Tensor joined = Tensor::empty({rows, 2 * h}, DType::f32, device);
    copy_columns(joined.f32(), 2 * h, en.f32(), h, rows, h, device);
    copy_columns(joined.f32() + h, 2 * h, hn.f32(), h, rows, h, device);
    s.joined = m.eh_proj.input(joined);
    Tensor x = m.eh_proj.forward(s.joined);
    x = m.layer.forward(x, batch, length, s.layer);
    const Tensor normed = m.head_norm.forward(x, s.head_norm);
    // The depth's loss is a mean over its targets, scaled to the main loss's tokens: over the replica's whole
    // sequences (every cp rank's chunks), not this rank's.
    float counts[2] = {static_cast<float>(main_tokens), 0.0f};
    for (int32_t t : s.targets) counts[1] += t >= 0;
    if (cp) cp->all_reduce_sum(counts, 2);
    s.grad_scale = counts[1] > 0 ? mb.grad_scale * weight * counts[0] / counts[1] : 0.0f;
    const int32_t* device_targets = ids_on(device, s.targets.data(), rows, s.targets_holder);
    const nn::LossTotals loss =
        mtp_head_.forward(normed, s.targets.data(), device_targets, s.grad_scale, acts ? &s.dhead : nullptr,
                          /*count_top1=*/acts != nullptr);
    mtp_stats_[d].loss.sum = loss.sum, mtp_stats_[d].loss.tokens = loss.tokens;
    if (acts) {
      MtpDepthTotals& t = step_mtp_[d];
      t.loss.sum += loss.sum, t.loss.tokens += loss.tokens, t.top1 += loss.top1;
    }
    prev = x;
  }
}

// B of every depth, deepest first; returns d(loss)/d(h_0).
Tensor DeepseekV3Model::mtp_backward_input(Activations& acts) {
  const int64_t batch = acts.batch, h = config_.hidden_size;
  const Device device = options_.device;
  Tensor dprev;  // gradient of h_k from depth k + 1, [batch * length_k, hidden]
  for (size_t d = mtp_.size(); d-- > 0;) {
    const MtpModule& m = *mtp_[d];
    MtpSaved& s = acts.mtp[d];
    const int64_t length = s.length, rows = batch * length;
    Tensor dx = m.head_norm.backward_input(s.dhead, s.head_norm);
    s.dhead = Tensor();
    if (dprev.defined()) ops::add_inplace(dx.f32(), dprev.f32(), dx.numel(), device);
    dx = m.layer.backward_input(dx, batch, length, s.layer);
    s.dy = m.eh_proj.grad_output(dx);
    const Tensor djoined = m.eh_proj.backward_input(s.dy);
    Tensor den = Tensor::empty({rows, h}, DType::f32, device),
           dhn = Tensor::empty({rows, h}, DType::f32, device);
    copy_columns(den.f32(), h, djoined.f32(), 2 * h, rows, h, device);
    copy_columns(dhn.f32(), h, djoined.f32() + h, 2 * h, rows, h, device);
    s.demb = m.enorm.backward_input(den, s.enorm);
    const Tensor dsliced = m.hnorm.backward_input(dhn, s.hnorm);
    // Back to h_{k-1}'s length + 1 positions per sequence; the last one fed no deeper depth. (Under context
    // parallelism every depth has all of the positions.)
    if (options_.cp) {
      dprev = dsliced;
      continue;
    }
    dprev = Tensor::zeros({batch * (length + 1), h}, DType::f32, device);
    for (int64_t b = 0; b < batch; ++b)
      dprev.view(b * (length + 1) * h, {length, h}).copy_from(dsliced.view(b * length * h, {length, h}));
  }
  if (!mtp_tp_) return dprev;
  // Every rank holds the same gradient of every row (the MTP layers' reduce_out is an all-reduce): h_0's
  // shard is this rank's block of rows.
  const int64_t local = dprev.dim(0) / tp()->size();
  return dprev.view(tp()->rank() * local * h, {local, h});
}

void DeepseekV3Model::mtp_backward_weight(Activations& acts) {
  for (size_t d = mtp_.size(); d-- > 0;) {
    const MtpModule& m = *mtp_[d];
    MtpSaved& s = acts.mtp[d];
    m.head_norm.backward_weight(s.head_norm);
    m.layer.backward_weight(s.layer);
    m.eh_proj.backward_weight(s.dy, s.joined);
    s.dy = nn::GemmOperand(), s.joined = nn::GemmOperand();
    m.enorm.backward_weight(s.enorm);
    m.hnorm.backward_weight(s.hnorm);
    mtp_embedding_.backward_weight(s.device_ids, s.demb);
    s.demb = Tensor();
  }
}

Tensor DeepseekV3Model::backward_input(const Tensor& doutput, StageActivations& state) {
  auto& acts = static_cast<Activations&>(state);
  FORGE_CHECK(!acts.input_done, "backward_input ran twice for one micro-batch");
  const nn::Fp8Recording fp8_recording(options_.fp8, true);
  Tensor dx = doutput;
  if (stage_.post_process) {
    const Tensor dmtp = mtp_.empty() ? Tensor() : mtp_backward_input(acts);
    dx = final_norm_.backward_input(acts.dhead, acts.norm), acts.dhead = Tensor();
    if (dmtp.defined()) ops::add_inplace(dx.f32(), dmtp.f32(), dx.numel(), options_.device);
  }
  FORGE_CHECK(dx.defined(), "backward_input of a stage that is not the last needs its output's gradient");
  for (size_t l = layers_.size(); l-- > 0;)
    dx = layers_[l].backward_input(dx, acts.batch, acts.seq, acts.layers[l]);
  acts.input_done = true;
  if (!stage_.pre_process) return dx;
  acts.dembed = dx;
  return Tensor();
}

void DeepseekV3Model::backward_weight(StageActivations& state) {
  auto& acts = static_cast<Activations&>(state);
  FORGE_CHECK(acts.input_done && !acts.weight_done, "backward_weight before backward_input, or twice");
  const nn::Fp8Recording fp8_recording(options_.fp8, true);
  if (stage_.post_process) {
    if (!mtp_.empty()) mtp_backward_weight(acts);
    final_norm_.backward_weight(acts.norm);
  }
  for (size_t l = layers_.size(); l-- > 0;) layers_[l].backward_weight(acts.layers[l]);
  if (stage_.pre_process) embedding_.backward_weight(acts.device_ids, acts.dembed), acts.dembed = Tensor();
  acts.weight_done = true;
}

// The fused order (each part's W right after its B); bitwise the same gradients as B-then-W.
Tensor DeepseekV3Model::backward(const Tensor& doutput, StageActivations& state) {
  auto& acts = static_cast<Activations&>(state);
  FORGE_CHECK(!acts.input_done, "backward ran twice for one micro-batch");
  const nn::Fp8Recording fp8_recording(options_.fp8, true);
  Tensor dx = doutput;
  if (stage_.post_process) {
    const Tensor dmtp = mtp_.empty() ? Tensor() : mtp_backward_input(acts);
    if (!mtp_.empty()) mtp_backward_weight(acts);
    dx = final_norm_.backward_input(acts.dhead, acts.norm), acts.dhead = Tensor();
    final_norm_.backward_weight(acts.norm);
    if (dmtp.defined()) ops::add_inplace(dx.f32(), dmtp.f32(), dx.numel(), options_.device);
  }
  FORGE_CHECK(dx.defined(), "backward of a stage that is not the last needs its output's gradient");
  for (size_t l = layers_.size(); l-- > 0;) {
    dx = layers_[l].backward_input(dx, acts.batch, acts.seq, acts.layers[l]);
    layers_[l].backward_weight(acts.layers[l]);
  }
  acts.input_done = acts.weight_done = true;
  if (!stage_.pre_process) return dx;
  embedding_.backward_weight(acts.device_ids, dx);
  return Tensor();
}

double DeepseekV3Model::balance_loss(double coefficient) const {
  double total = 0;
  for (const nn::MoeStats& s : moe_stats_)
    if (s.sequences > 0) total += coefficient * s.balance_sum / static_cast<double>(s.sequences);
  return total;
}

double DeepseekV3Model::aux_loss(double coefficient) const {
  double total = 0;
  for (const nn::MoeStats& s : moe_stats_)
    if (s.micro_batches > 0) total += coefficient * s.aux_sum / static_cast<double>(s.micro_batches);
  return total;
}

void DeepseekV3Model::apply_bias_updates(float rate, bool zero_mean) {
  for (const nn::Moe* moe : moe_layers_) moe->apply_bias_update(rate, zero_mean);
}

void DeepseekV3Model::begin_train_step(const TrainStepSettings& settings) {
  set_balance_scale(settings.balance_scale);
  set_aux_loss_scale(settings.aux_loss_scale);
  model_options_.mtp_weight = settings.mtp_weight;
  for (nn::MoeStats& s : moe_stats_) s.reset(config_.n_routed_experts);
  std::fill(step_mtp_.begin(), step_mtp_.end(), MtpDepthTotals{});
}

int64_t DeepseekV3Model::expert_layer_count() const {
  const int64_t layers = config_.num_hidden_layers + mtp_depth_count();
  return std::max<int64_t>(0, layers - config_.first_k_dense_replace);
}

std::vector<ExpertLayerView> DeepseekV3Model::expert_layers() {
  std::vector<ExpertLayerView> views;
  for (size_t i = 0; i < moe_layer_ids_.size(); ++i) {
    const auto [layer, bias] = moe_layer_ids_[i];
    views.push_back({layer, layer - config_.first_k_dense_replace, &moe_stats_[i], bias});
  }
  return views;
}

Tensor DeepseekV3Model::logits(const int32_t* ids, int64_t batch, int64_t seq) {
  require_whole("logits");
  check_inputs({ids, nullptr, batch, seq, 0.0f});
  Tensor holder;
  Tensor x = embedding_.forward(ids_on(options_.device, ids, batch * seq, holder), batch * seq);
  for (const nn::DecoderLayer& layer : layers_) {
    nn::DecoderLayer::Saved scratch;
    x = layer.forward(x, batch, seq, scratch);
  }
  nn::RmsNorm::Saved scratch;
  return head_.logits(final_norm_.forward(x, scratch)).to(Device::cpu);
}

// MLA's compressed cache: per layer and token one kv head of kv_lora_rank + qk_rope_head_dim values (the
// normed latent and the rotated rope key).
nn::KvCache DeepseekV3Model::make_cache(int64_t batch, int64_t capacity) const {
  require_whole("a KV cache");
  const int64_t max_positions = config_.max_position_embeddings;
  if (capacity == 0) capacity = max_positions;
  if (capacity < 0 || capacity > max_positions)
    fail("KV cache capacity {} is outside [1, max_position_embeddings = {}]", capacity, max_positions);
  if (batch <= 0) fail("KV cache batch must be positive, got {}", batch);
  return nn::KvCache(config_.num_hidden_layers, batch, capacity, 1,
                     config_.kv_lora_rank + config_.qk_rope_head_dim, options_.device);
}

// Inference over the compressed cache through the main model (the MTP modules are not used).
Tensor DeepseekV3Model::forward_cached(const int32_t* ids, int64_t batch, int64_t new_tokens,
                                       nn::KvCache& cache, bool all_logits) {
  require_whole("cached inference");
  if (tp())
    fail("cached inference runs on one process; this model is split over tp = {} ranks", tp()->size());
  if (batch <= 0 || new_tokens <= 0)
    fail("batch ({}) and new tokens ({}) must be positive", batch, new_tokens);
  const int64_t row = config_.kv_lora_rank + config_.qk_rope_head_dim;
  if (!cache.allocated() || cache.layers() != config_.num_hidden_layers || cache.batch() != batch ||
      cache.kv_heads() != 1 || cache.head_dim() != row)
    fail(
        "KV cache ({} layers, batch {}, {} kv heads x {}) does not fit this model and batch "
        "({} layers, batch {}, 1 compressed head x {}); make it with make_cache",
        cache.layers(), cache.batch(), cache.kv_heads(), cache.head_dim(), config_.num_hidden_layers, batch,
        row);
  const int64_t end = cache.length() + new_tokens;
  if (end > config_.max_position_embeddings)
    fail("context full: {} cached + {} new tokens exceed max_position_embeddings {}", cache.length(),
         new_tokens, config_.max_position_embeddings);
  if (end > cache.capacity())
    fail("KV cache full: {} cached + {} new tokens exceed its capacity of {} positions", cache.length(),
         new_tokens, cache.capacity());
  for (int64_t i = 0; i < batch * new_tokens; ++i)
    if (ids[i] < 0 || ids[i] >= config_.vocab_size)
      fail("token id {} at position {} is outside the vocabulary [0, {})", ids[i], i, config_.vocab_size);

  const int64_t h = config_.hidden_size;
  Tensor ids_holder;
  Tensor x =
      embedding_.forward(ids_on(options_.device, ids, batch * new_tokens, ids_holder), batch * new_tokens);
  for (size_t l = 0; l < layers_.size(); ++l)
    x = layers_[l].forward_cached(x, batch, new_tokens, cache.layer(static_cast<int64_t>(l)));
  cache.advance(new_tokens);
  if (!all_logits && new_tokens > 1) {  // only each sequence's last token goes through the head
    Tensor last = Tensor::empty({batch, h}, DType::f32, options_.device);
    for (int64_t b = 0; b < batch; ++b)
      last.view(b * h, {h}).copy_from(x.view(((b + 1) * new_tokens - 1) * h, {h}));
    x = last;
  }
  nn::RmsNorm::Saved norm_saved;
  return head_.logits(final_norm_.forward(x, norm_saved)).to(Device::cpu);
}

ModelFamily deepseek_v3_family() {
  ModelFamily f;
  f.architecture = "DeepseekV3ForCausalLM";
  f.model_type = "deepseek_v3";
  f.parse_config = [](const nlohmann::json& json, std::string_view source) -> std::unique_ptr<ModelConfig> {
    return std::make_unique<DeepseekV3Config>(DeepseekV3Config::from_json(json, source));
  };
  f.build = [](const ModelConfig& config, const nn::ComputeOptions& options, const StageSpec& stage,
               float init_std, bool with_grads, ParameterStore* into) -> std::unique_ptr<Model> {
    const auto* ds = dynamic_cast<const DeepseekV3Config*>(&config);
    FORGE_CHECK(ds != nullptr, "a {} config given to the DeepseekV3ForCausalLM family",
                config.architecture());
    return std::make_unique<DeepseekV3Model>(*ds, options, init_std, with_grads, stage, into);
  };
  return f;
}

}  // namespace forge::models
