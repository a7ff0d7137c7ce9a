#include "forge/models/deepseek_v3/deepseek_v3_model.h"

#include <algorithm>
#include <cmath>

#include "forge/kernels/ops.h"
#include "forge/nn/context_parallel.h"
#include "forge/nn/linear.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::models {
namespace {

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
  float grad_scale = 0;
};

struct MtpActivations final : StageActivations {
  int64_t batch = 0;
  std::vector<MtpSaved> depths;
};
}  // namespace

DecoderSpec deepseek_v3_spec(const DeepseekV3Config& config, bool with_mtp) {
  const std::string source = config.origin.name.empty() ? "model config" : config.origin.name;
  config.validate(source);
  if (config.topk_method != DeepseekV3Config::TopkMethod::noaux_tc)
    fail("{}: topk_method 'greedy' is not supported yet (only noaux_tc)", source);
  const DeepseekV3Config& c = config;
  DecoderSpec s;
  s.hidden = c.hidden_size, s.vocab = c.vocab_size, s.layers = c.num_hidden_layers;
  s.max_positions = c.max_position_embeddings;
  s.norm_eps = c.rms_norm_eps;
  s.tie_word_embeddings = c.tie_word_embeddings;
  s.init_depth = c.num_layers_with_mtp();
  s.ffn = c.intermediate_size;
  nn::MlaShape& mla = s.mla;
  mla.hidden = c.hidden_size, mla.heads = c.num_attention_heads, mla.q_lora_rank = c.q_lora_rank;
  mla.kv_lora_rank = c.kv_lora_rank, mla.qk_nope_head_dim = c.qk_nope_head_dim;
  mla.qk_rope_head_dim = c.qk_rope_head_dim, mla.v_head_dim = c.v_head_dim;
  mla.rope_interleave = c.rope_interleave, mla.softmax_scale = static_cast<float>(c.softmax_scale());
  mla.latent_norm_eps = 1e-6f;  // HF builds the latent norms with RMSNorm's default eps
  nn::MoeShape& moe = s.moe;
  moe.hidden = c.hidden_size, moe.experts = c.n_routed_experts, moe.top_k = c.num_experts_per_tok;
  moe.groups = c.n_group, moe.topk_groups = c.topk_group, moe.expert_ffn = c.moe_intermediate_size;
  moe.shared_ffn = c.n_shared_experts * c.moe_intermediate_size;
  moe.score = c.scoring_func == DeepseekV3Config::ScoringFunc::sigmoid ? ops::MoeScore::sigmoid
                                                                       : ops::MoeScore::softmax;
  moe.normalize = c.norm_topk_prob, moe.scaling = static_cast<float>(c.routed_scaling_factor);
  const int64_t layers = with_mtp ? c.num_layers_with_mtp() : c.num_hidden_layers;
  for (int64_t i = 0; i < layers; ++i) {
    LayerSpec layer;
    layer.attention = AttentionKind::mla;
    layer.feed_forward = c.is_moe_layer(i) ? FeedForwardKind::moe : FeedForwardKind::swiglu;
    s.layer_specs.push_back(layer);
  }
  // RoPE of the qk_rope_head_dim channels: cos/sin of t * inv_freq, times YaRN's attention factor.
  const std::vector<double> inv_freq = c.rope_inv_freq();
  const double factor = c.rope_attention_factor();
  nn::RopeTable& rope = s.rope;
  rope.positions = c.max_position_embeddings;
  rope.half_dim = c.qk_rope_head_dim / 2;
  rope.cos = Tensor::empty({rope.positions, rope.half_dim}, DType::f32);
  rope.sin = Tensor::empty({rope.positions, rope.half_dim}, DType::f32);
  for (int64_t t = 0; t < rope.positions; ++t)
    for (int64_t i = 0; i < rope.half_dim; ++i) {
      const double angle = static_cast<double>(t) * inv_freq[static_cast<size_t>(i)];
      rope.cos.f32()[t * rope.half_dim + i] = static_cast<float>(std::cos(angle) * factor);
      rope.sin.f32()[t * rope.half_dim + i] = static_cast<float>(std::sin(angle) * factor);
    }
  // MLA's compressed cache: per layer and token one kv head of the normed latent and the rotated rope key.
  s.cache_heads = 1, s.cache_dim = c.kv_lora_rank + c.qk_rope_head_dim;
  return s;
}

// The multi-token prediction modules behind the loss head (see the header for the arithmetic).
class MtpTail final : public StackTail {
 public:
  MtpTail(const DeepseekV3Config& config, float weight) : config_(config), weight_(weight) {}

  int depth() const { return static_cast<int>(config_.num_nextn_predict_layers); }
  int embedding_reads() const override { return depth(); }
  int head_reads() const override { return depth(); }
  bool reads_ids() const override { return true; }

  void register_parameters(DecoderStack& stack, float init_std) override {
    ParameterStore& params = stack.params();
    const int64_t h = config_.hidden_size, layers = config_.num_hidden_layers;
    const ShardSpec replicated{-1, 0, {}, stack.options().tp_rank() == 0};
    for (int64_t k = 0; k < depth(); ++k) {
      const std::string p = stack.prefix() + "model.layers." + std::to_string(layers + k) + ".";
      Ids ids;
      ids.enorm = params.add(p + "enorm.weight", {h}, false, Init::ones, 0.02f, replicated);
      ids.hnorm = params.add(p + "hnorm.weight", {h}, false, Init::ones, 0.02f, replicated);
      ids.eh_proj = params.add(p + "eh_proj.weight", {h, 2 * h}, true, Init::normal, init_std, replicated);
      ids.layer = stack.register_extra_layer(layers + k, init_std);
      ids.head_norm = params.add(p + "shared_head.norm.weight", {h}, false, Init::ones, 0.02f, replicated);
      ids_.push_back(ids);
    }
  }

  // Under sequence parallelism the modules' embedding and head, and their layers, run on the tensor-parallel
  // group without sequence parallelism, over every row (each depth shifts the rows by a position, across the
  // shards' boundaries).
  void build(DecoderStack& stack) override {
    stack_ = &stack;
    ParameterStore& params = stack.params();
    const nn::ComputeOptions& options = stack.options();
    const float eps = static_cast<float>(config_.rms_norm_eps);
    const int64_t h = config_.hidden_size, layers = config_.num_hidden_layers;
    if (stack.tp() && stack.tp()->sequence_parallel())
      tp_ = std::make_unique<nn::WithoutSequenceParallel>(stack.tp());
    nn::ComputeOptions head_options = options;
    if (tp_) head_options.tp = tp_.get();
    // fp32 rows: they feed enorm's fp32 input (which keeps the table in fp32 under the distributed
    // optimizer).
    embedding_ =
        nn::Embedding(&params, stack.embedding_id(), head_options.tp_size() > 1 ? head_options.tp : nullptr);
    head_ = nn::LossHead(&params, stack.head_id(), config_.vocab_size, stack.vocab_start(), head_options);
    for (int k = 0; k < depth(); ++k) {
      const Ids& ids = ids_[static_cast<size_t>(k)];
      auto m = std::make_unique<Module>();
      m->enorm = nn::RmsNorm(&params, ids.enorm, eps);
      m->hnorm = nn::RmsNorm(&params, ids.hnorm, eps);
      m->head_norm = nn::RmsNorm(&params, ids.head_norm, eps);
      nn::ComputeOptions layer_options = stack.layer_options(layers + k);
      if (tp_) layer_options.tp = tp_.get();
      nn::ComputeOptions replicated = layer_options;
      replicated.tp = nullptr;  // eh_proj is replicated: every rank computes it whole
      m->eh_proj = nn::Linear(&params, {ids.eh_proj}, 2 * h, replicated);
      m->layer = stack.build_extra_layer(ids.layer, layer_options);
      modules_.push_back(std::move(m));
    }
    stats_.resize(modules_.size());
    step_.resize(modules_.size());
  }

  // MLA's replicated latent projections and norms (each rank saw only its heads). The modules' norms see
  // every row on every rank, so their gradients are whole already.
  std::vector<int> tensor_parallel_sums() const override {
    std::vector<int> ids;
    for (const auto& m : modules_)
      for (int id : static_cast<const nn::MlaAttention&>(m->layer.mixer()).replicated_params())
        ids.push_back(id);
    return ids;
  }

  void begin_train_step(const TrainStepSettings& settings) override {
    weight_ = settings.mtp_weight;
    std::fill(step_.begin(), step_.end(), MtpDepthTotals{});
  }

  void check(const MicroBatch& mb) const override {
    if (mb.seq <= depth()) fail("sequence length {} leaves no positions for MTP depth {}", mb.seq, depth());
  }

  void forward(const MicroBatch& mb, const Tensor& h0, int64_t main_tokens,
               std::unique_ptr<StageActivations>* saved) override;
  Tensor backward_input(StageActivations& saved) override;
  void backward_weight(StageActivations& saved) override;

  const std::vector<MtpDepthStats>& stats() const { return stats_; }
  const std::vector<MtpDepthTotals>& step_totals() const { return step_; }

 private:
  struct Ids {
    int enorm = -1, hnorm = -1, eh_proj = -1, head_norm = -1;
    int layer = -1;  // the stack's registration number
  };
  struct Module {
    nn::RmsNorm enorm, hnorm, head_norm;
    nn::Linear eh_proj;
    nn::DecoderLayer layer;
  };

  DeepseekV3Config config_;
  float weight_;
  DecoderStack* stack_ = nullptr;
  std::vector<Ids> ids_;
  std::vector<std::unique_ptr<Module>> modules_;
  std::unique_ptr<nn::TensorParallel> tp_;  // the stack's group without sequence parallelism (null: none)
  nn::Embedding embedding_;
  nn::LossHead head_;
  std::vector<MtpDepthStats> stats_;
  std::vector<MtpDepthTotals> step_;  // the step's training forwards (begin_train_step clears them)
};

// Every MTP depth from h_0 (the last layer's output before the final norm).
void MtpTail::forward(const MicroBatch& mb, const Tensor& h0, int64_t main_tokens,
                      std::unique_ptr<StageActivations>* saved) {
  const int64_t batch = mb.batch, seq = mb.seq, h = config_.hidden_size;
  const Device device = stack_->options().device;
  const float weight = weight_ / static_cast<float>(modules_.size());
  auto acts = std::make_unique<MtpActivations>();
  acts->batch = batch;
  acts->depths.resize(modules_.size());
  // h_{k-1}: [batch, seq - k + 1, hidden], every row (gathered from the shards under sequence parallelism).
  Tensor prev = tp_ ? stack_->tp()->all_gather_rows(h0) : h0;
  // Under context parallelism every depth keeps all of the rank's positions: the ids and targets shifted by
  // k come across the chunks (ContextParallel::shift_tokens), the last k positions of each sequence with no
  // target (ignored, and causal attention keeps them from every position that has one).
  nn::ContextParallel* cp = stack_->options().cp;
  for (size_t d = 0; d < modules_.size(); ++d) {
    const Module& m = *modules_[d];
    MtpSaved& s = acts->depths[d];
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
    const Tensor emb = embedding_.forward(s.device_ids, rows);
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
        head_.forward(normed, s.targets.data(), device_targets, s.grad_scale, saved ? &s.dhead : nullptr,
                      /*count_top1=*/saved != nullptr);
    stats_[d].loss.sum = loss.sum, stats_[d].loss.tokens = loss.tokens;
    if (saved) {
      MtpDepthTotals& t = step_[d];
      t.loss.sum += loss.sum, t.loss.tokens += loss.tokens, t.top1 += loss.top1;
    }
    prev = x;
  }
  if (saved) *saved = std::move(acts);
}

// B of every depth, deepest first; returns d(loss)/d(h_0).
Tensor MtpTail::backward_input(StageActivations& state) {
  auto& acts = static_cast<MtpActivations&>(state);
  const int64_t batch = acts.batch, h = config_.hidden_size;
  const Device device = stack_->options().device;
  Tensor dprev;  // gradient of h_k from depth k + 1, [batch * length_k, hidden]
  for (size_t d = modules_.size(); d-- > 0;) {
    const Module& m = *modules_[d];
    MtpSaved& s = acts.depths[d];
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
    if (stack_->options().cp) {
      dprev = dsliced;
      continue;
    }
    dprev = Tensor::zeros({batch * (length + 1), h}, DType::f32, device);
    for (int64_t b = 0; b < batch; ++b)
      dprev.view(b * (length + 1) * h, {length, h}).copy_from(dsliced.view(b * length * h, {length, h}));
  }
  if (!tp_) return dprev;
  // Every rank holds the same gradient of every row (the MTP layers' reduce_out is an all-reduce): h_0's
  // shard is this rank's block of rows.
  const int64_t local = dprev.dim(0) / tp_->size();
  return dprev.view(tp_->rank() * local * h, {local, h});
}

void MtpTail::backward_weight(StageActivations& state) {
  auto& acts = static_cast<MtpActivations&>(state);
  for (size_t d = modules_.size(); d-- > 0;) {
    const Module& m = *modules_[d];
    MtpSaved& s = acts.depths[d];
    m.head_norm.backward_weight(s.head_norm);
    m.layer.backward_weight(s.layer);
    m.eh_proj.backward_weight(s.dy, s.joined);
    s.dy = nn::GemmOperand(), s.joined = nn::GemmOperand();
    m.enorm.backward_weight(s.enorm);
    m.hnorm.backward_weight(s.hnorm);
    embedding_.backward_weight(s.device_ids, s.demb);
    s.demb = Tensor();
  }
}

namespace {
std::unique_ptr<StackTail> mtp_tail(const DeepseekV3Config& config, const DeepseekV3Options& options) {
  if (!options.with_mtp || config.num_nextn_predict_layers == 0) return nullptr;
  return std::make_unique<MtpTail>(config, options.mtp_weight);
}
}  // namespace

DeepseekV3Model::DeepseekV3Model(const DeepseekV3Config& config, nn::ComputeOptions options, float init_std,
                                 bool with_grads, StageSpec stage, ParameterStore* into,
                                 DeepseekV3Options model_options)
    : DecoderStack(config, deepseek_v3_spec(config, model_options.with_mtp), options, init_std, with_grads,
                   stage, into, "", mtp_tail(config, model_options)),
      with_mtp_(model_options.with_mtp) {}

const MtpTail* DeepseekV3Model::mtp() const { return static_cast<const MtpTail*>(tail()); }

int64_t DeepseekV3Model::mtp_depth() const { return mtp() ? mtp()->depth() : 0; }

const std::vector<MtpDepthStats>& DeepseekV3Model::mtp_stats() const {
  static const std::vector<MtpDepthStats> none;
  return mtp() ? mtp()->stats() : none;
}

std::vector<MtpDepthTotals> DeepseekV3Model::mtp_totals() const {
  return mtp() ? mtp()->step_totals() : std::vector<MtpDepthTotals>{};
}

ModelFamily deepseek_v3_family() {
  return family_entry<DeepseekV3Config, DeepseekV3Model>("DeepseekV3ForCausalLM", "deepseek_v3");
}

}  // namespace forge::models
