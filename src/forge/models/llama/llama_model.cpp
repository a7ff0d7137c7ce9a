#include "forge/models/llama/llama_model.h"

#include <algorithm>
#include <cmath>

#include "forge/core/device.h"
#include "forge/core/memory.h"
#include "forge/kernels/emulated_device.h"
#include "forge/kernels/ops.h"
#include "forge/kernels/rope_tables.h"
#include "forge/nn/fp8_context.h"
#include "forge/nn/mlp.h"
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

// Heads and kv heads of one tensor-parallel rank: heads split over tp; kv heads too when tp divides them,
// else each rank keeps the one kv head its query heads read (replicated over tp / kv_heads ranks).
nn::AttentionShape local_attention(const LlamaConfig& c, int tp) {
  nn::AttentionShape a{c.hidden_size, c.num_attention_heads / tp, 0, c.head_dim};
  a.kv_heads = c.num_key_value_heads >= tp ? c.num_key_value_heads / tp : 1;
  return a;
}

// A run of consecutive token rows of this rank whose embeddings are replaced by rows [source, source + count)
// of the inserted tensor.
struct InsertedRun {
  int64_t row = 0, count = 0, source = 0;
};

// dst rows [dst_row, +count) = src rows [src_row, +count), [*, h] fp32.
void copy_rows(const Tensor& src, int64_t src_row, const Tensor& dst, int64_t dst_row, int64_t count,
               int64_t h) {
  dst.view(dst_row * h, {count * h}).copy_from(src.view(src_row * h, {count * h}));
}
}  // namespace

struct LlamaModel::Insertion {
  const Tensor* rows = nullptr;
  std::vector<InsertedRun> runs;
  int64_t count = 0;  // rows of the inserted tensor
};

// The embeddings x [rows, hidden] of this rank's tokens with the inserted rows in place (nothing: null).
void LlamaModel::splice(const Insertion* insertion, const Tensor& x) const {
  if (!insertion) return;
  for (const InsertedRun& run : insertion->runs)
    copy_rows(*insertion->rows, run.source, x, run.row, run.count, config_.hidden_size);
}

// What one micro-batch keeps between the stage's forward, backward_input and backward_weight.
struct LlamaModel::Activations final : StageActivations {
  int64_t batch = 0, seq = 0;
  Tensor ids_holder;
  const int32_t* device_ids = nullptr;
  std::vector<nn::DecoderLayer::Saved> layers;
  nn::RmsNorm::Saved norm;
  Tensor dhead;   // last stage: the loss head's gradient at the final norm's output, for B
  Tensor dembed;  // first stage: the gradient at the embedding's output, for W
  std::vector<InsertedRun> inserted_runs;  // forward_inserted: where the inserted rows went
  int64_t inserted_count = 0;
  Tensor dinserted;          // their gradient, taken out of dembed
  bool input_done = false;   // backward_input ran
  bool weight_done = false;  // backward_weight ran
};

LlamaModel::LlamaModel(const LlamaConfig& config, nn::ComputeOptions options, float init_std, bool with_grads,
                       StageSpec stage, ParameterStore* into, std::string name_prefix)
    : config_(config),
      prefix_(std::move(name_prefix)),
      options_(options),
      stage_(stage),
      params_(into ? *into : own_params_) {
  const std::string source = config.origin.name.empty() ? "model config" : config.origin.name;
  config_.validate(source);
  const int64_t layers = config.num_hidden_layers;
  if (stage_.end_layer < 0) stage_.end_layer = layers;
  if (stage_.first_layer < 0 || stage_.first_layer > stage_.end_layer || stage_.end_layer > layers)
    fail("{}: stage layers [{}, {}) are outside the model's {} layers", source, stage_.first_layer,
         stage_.end_layer, layers);
  // Refused before anything is allocated, so a config too big for the machine is one line, not bad_alloc or
  // the OOM killer. On the CPU the host holds everything (with gradients, the optimizer's two moments too:
  // whoever trains a model with gradients steps it with AdamW); a model on a device needs a full fp32 host
  // copy while its weights are initialised or loaded, and the device's allocator reports its own memory.
  // Under tensor parallelism a rank holds 1/tp of the model, but a group's ranks usually share a machine, so
  // the whole model is what the machine must hold (an over-estimate when the group spans machines).
  const bool on_host = options.device == Device::cpu;
  // A dry run (kernels/emulated_device.h, the simulator's traces) initialises nothing on the host.
  if (!EmulatedDevice::check_only())
    config_.check_fits_in_memory(on_host && with_grads, on_host && options.gemm_dtype == DType::bf16,
                                 host_memory_bytes(), source);
  const int64_t h = config.hidden_size, v = config.vocab_size;
  const int tp_size = options.tp_size(), rank = options.tp_rank();
  FORGE_CHECK(config.num_attention_heads % tp_size == 0 && config.intermediate_size % tp_size == 0 &&
                  (config.num_key_value_heads % tp_size == 0 || tp_size % config.num_key_value_heads == 0),
              "{}: {} heads, {} kv heads and ffn {} do not split over tp = {}", source,
              config.num_attention_heads, config.num_key_value_heads, config.intermediate_size, tp_size);
  // Vocabulary-parallel embedding and head: rows padded to a multiple of vocab_divisible_by x tp, split
  // evenly; the padding rows are zero, masked out of the softmax and never saved.
  const int64_t unit = std::max<int64_t>(1, options.vocab_divisible_by) * tp_size;
  padded_vocab_ = tp_size > 1 ? (v + unit - 1) / unit * unit : v;
  local_vocab_ = padded_vocab_ / tp_size, vocab_start_ = rank * local_vocab_;
  const ShardSpec vocab_shard{0, vocab_start_, {v, h}, true};
  const ShardSpec replicated{-1, 0, {}, rank == 0};
  // Tied embeddings in a store shared with another chunk of the rank (the V schedules put the first and the
  // last stage on one rank): the tensor is registered once and both chunks use it.
  const int shared_embedding =
      config.tie_word_embeddings ? params_.find(prefix_ + "model.embed_tokens.weight") : -1;
  if (stage_.pre_process)
    embed_id_ = shared_embedding >= 0 ? shared_embedding
                                      : params_.add(prefix_ + "model.embed_tokens.weight", {local_vocab_, h},
                                                    true, Init::normal, init_std, vocab_shard);
  if (stage_.pre_process && shared_embedding >= 0) params_.set_grad_uses(embed_id_, 2);
  for (int64_t i = stage_.first_layer; i < stage_.end_layer; ++i) register_layer(i, init_std);
  if (stage_.post_process) {
    norm_id_ = params_.add(prefix_ + "model.norm.weight", {h}, false, Init::ones, 0.02f, replicated);
    // Tied: the head reads the embedding; a last stage without the embedding holds its own copy under the
    // same name (the same values: initialisation depends on the name), which pipelines keep equal.
    if (config.tie_word_embeddings && (stage_.pre_process || shared_embedding >= 0)) {
      head_id_ = stage_.pre_process ? embed_id_ : shared_embedding;
      params_.set_grad_uses(head_id_, 2);  // the embedding's and the head's gradients
    } else {
      head_id_ =
          params_.add(prefix_ + (config.tie_word_embeddings ? "model.embed_tokens.weight" : "lm_head.weight"),
                      {local_vocab_, h}, true, Init::normal, init_std, vocab_shard);
    }
  }
  if (!into) params_.allocate(options.gemm_dtype == DType::bf16, with_grads, options.device);

  rope_.positions = config.max_position_embeddings;
  rope_.half_dim = config.head_dim / 2;
  rope_.cos = Tensor::empty({rope_.positions, rope_.half_dim}, DType::f32);
  rope_.sin = Tensor::empty({rope_.positions, rope_.half_dim}, DType::f32);
  rope_tables(rope_.positions, config.head_dim, config.rope_theta, config.rope_scaling, rope_.cos.f32(),
              rope_.sin.f32());
  rope_.cos = rope_.cos.to(options.device), rope_.sin = rope_.sin.to(options.device);

  if (stage_.pre_process) embedding_ = nn::Embedding(&params_, embed_id_, tp());
  const float eps = static_cast<float>(config.rms_norm_eps);
  const nn::AttentionShape attention = local_attention(config, tp_size);
  for (size_t l = 0; l < layer_ids_.size(); ++l) {
    const int64_t i = stage_.first_layer + static_cast<int64_t>(l);
    const LayerIds& ids = layer_ids_[l];
    // FP8: every decoder layer's Linears except the first and last bf16_*_layers, which stay in the GEMM
    // dtype (the layers nearest the embedding and the loss are the most sensitive to precision).
    nn::ComputeOptions layer_options = options;
    if (options.fp8) {
      const nn::Fp8Options& f = options.fp8->options();
      if (i < f.bf16_first_layers || i >= layers - f.bf16_last_layers) layer_options.fp8 = nullptr;
    }
    layers_.emplace_back(
        &params_, ids.norm1,
        std::make_unique<nn::Attention>(&params_, ids.attention, attention, &rope_, layer_options), ids.norm2,
        std::make_unique<nn::Mlp>(&params_, ids.mlp, h, config.intermediate_size / tp_size, layer_options),
        eps, layer_options);
  }
  if (options.fp8 && !into) options.fp8->seal();
  if (stage_.post_process) {
    final_norm_ = nn::RmsNorm(&params_, norm_id_, eps);
    head_ = nn::LossHead(&params_, head_id_, v, vocab_start_, options);
  }

  if (with_grads) register_tensor_parallel_sums();
}

// Gradients that several tensor-parallel ranks hold copies of, each having seen only part of them, are summed
// over the group as soon as they are final: norm weights under sequence parallelism (each rank normed only
// its rows), kv heads replicated over ranks (each holder saw only its own query heads).
void LlamaModel::register_tensor_parallel_sums() {
  nn::TensorParallel* group = tp();
  if (!group) return;
  const Device device = options_.device;
  const LlamaConfig& config = config_;
  const int64_t h = config.hidden_size;
  auto sum_over_group = [this, group, device](int id) {
    params_.add_grad_finalizer({id}, [this, group, device, id] {
      group->all_reduce_sum(params_.grad(id).f32(), params_.grad(id).numel(), device);
    });
  };
  if (group->sequence_parallel()) {
    for (const LayerIds& ids : layer_ids_) sum_over_group(ids.norm1), sum_over_group(ids.norm2);
    if (stage_.post_process) sum_over_group(norm_id_);
  }
  const int64_t kv_heads = config.num_key_value_heads;
  if (kv_heads >= group->size()) return;
  // Sum the copies of each kv head through a buffer of all kv heads in which each rank fills its head's slot.
  const int64_t per_head = config.head_dim * h;
  const int64_t head = static_cast<int64_t>(group->rank()) * kv_heads / group->size();
  for (const LayerIds& ids : layer_ids_) {
    const int k = ids.attention.k, vv = ids.attention.v;
    params_.add_grad_finalizer({k, vv}, [this, group, device, k, vv, kv_heads, per_head, head] {
      Tensor buffer = Tensor::zeros({2, kv_heads, per_head}, DType::f32, device);
      const int kv_ids[2] = {k, vv};
      for (int kv = 0; kv < 2; ++kv)
        buffer.view((kv * kv_heads + head) * per_head, {per_head})
            .copy_from(params_.grad(kv_ids[kv]).reshape({per_head}));
      group->all_reduce_sum(buffer.f32(), buffer.numel(), device);
      for (int kv = 0; kv < 2; ++kv)
        params_.grad(kv_ids[kv])
            .reshape({per_head})
            .copy_from(buffer.view((kv * kv_heads + head) * per_head, {per_head}));
    });
  }
}

// Layer `index`'s parameters under their Hugging Face names "model.layers.{index}.*", this rank's shards.
void LlamaModel::register_layer(int64_t index, float init_std) {
  const LlamaConfig& c = config_;
  const std::string p = prefix_ + "model.layers." + std::to_string(index) + ".";
  const int tp = options_.tp_size(), r = options_.tp_rank();
  const nn::AttentionShape l = local_attention(c, tp);
  const int64_t hidden = c.hidden_size, d = c.head_dim, qd = c.num_attention_heads * d;
  const int64_t kvd = c.num_key_value_heads * d;
  // Replicated kv heads: rank r's query heads read kv head r * kv / tp; the first of its holders is primary.
  const bool kv_split = c.num_key_value_heads >= tp;
  const int64_t kv_start =
      kv_split ? r * l.kv_heads * d : (static_cast<int64_t>(r) * c.num_key_value_heads / tp) * d;
  const bool kv_primary = kv_split || r % (tp / c.num_key_value_heads) == 0;
  const ShardSpec norm_shard{-1, 0, {}, r == 0};  // every rank holds the norms; rank 0's copy counts
  // Output projections feed the residual stream: scale their init by 1/sqrt(2 * layers) (GPT-2/Megatron).
  const float out_std = init_std / std::sqrt(2.0f * static_cast<float>(c.num_hidden_layers));
  LayerIds ids;
  ids.norm1 = params_.add(p + "input_layernorm.weight", {hidden}, false, Init::ones, 0.02f, norm_shard);
  ids.attention.q = params_.add(p + "self_attn.q_proj.weight", {l.heads * d, hidden}, true, Init::normal,
                                init_std, split({qd, hidden}, 0, r * l.heads * d));
  ids.attention.k = params_.add(p + "self_attn.k_proj.weight", {l.kv_heads * d, hidden}, true, Init::normal,
                                init_std, split({kvd, hidden}, 0, kv_start, kv_primary));
  ids.attention.v = params_.add(p + "self_attn.v_proj.weight", {l.kv_heads * d, hidden}, true, Init::normal,
                                init_std, split({kvd, hidden}, 0, kv_start, kv_primary));
  ids.attention.o = params_.add(p + "self_attn.o_proj.weight", {hidden, l.heads * d}, true, Init::normal,
                                out_std, split({hidden, qd}, 1, r * l.heads * d));
  ids.norm2 =
      params_.add(p + "post_attention_layernorm.weight", {hidden}, false, Init::ones, 0.02f, norm_shard);
  const int64_t f = c.intermediate_size / tp;
  ids.mlp.gate = params_.add(p + "mlp.gate_proj.weight", {f, hidden}, true, Init::normal, init_std,
                             split({c.intermediate_size, hidden}, 0, r * f));
  ids.mlp.up = params_.add(p + "mlp.up_proj.weight", {f, hidden}, true, Init::normal, init_std,
                           split({c.intermediate_size, hidden}, 0, r * f));
  ids.mlp.down = params_.add(p + "mlp.down_proj.weight", {hidden, f}, true, Init::normal, out_std,
                             split({hidden, c.intermediate_size}, 1, r * f));
  layer_ids_.push_back(ids);
}

nn::TensorParallel* LlamaModel::tp() const {
  return options_.tp && options_.tp->size() > 1 ? options_.tp : nullptr;
}

void LlamaModel::require_whole(const char* what) const {
  if (!stage_.pre_process || !stage_.post_process || stage_.first_layer != 0 ||
      stage_.end_layer != config_.num_hidden_layers)
    fail("{} needs the whole model; this stage holds layers [{}, {}){}{}", what, stage_.first_layer,
         stage_.end_layer, stage_.pre_process ? " with the embedding" : "",
         stage_.post_process ? " with the head" : "");
}

void LlamaModel::check_inputs(const MicroBatch& mb) const {
  if (mb.batch <= 0 || mb.seq <= 0)
    fail("batch ({}) and sequence length ({}) must be positive", mb.batch, mb.seq);
  if (mb.seq > config_.max_position_embeddings)
    fail("sequence length {} exceeds max_position_embeddings {}", mb.seq, config_.max_position_embeddings);
  const int64_t n = mb.batch * mb.seq;
  if (stage_.pre_process) {
    FORGE_CHECK(mb.ids != nullptr, "the first stage needs token ids");
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
  if (tp() && tp()->sequence_parallel() && n % tp()->size() != 0)
    fail("sequence parallelism splits the {} x {} token rows over tp = {} ranks: they do not divide",
         mb.batch, mb.seq, tp()->size());
}

StageOutput LlamaModel::forward(const MicroBatch& mb, const Tensor& hidden,
                                std::unique_ptr<StageActivations>* saved) {
  if (mb.pixels || mb.images)
    fail("{} takes no images ({} given); a multimodal model is a LlavaForConditionalGeneration",
         config_.architecture(), mb.images);
  return run_forward(mb, hidden, nullptr, saved);
}

StageOutput LlamaModel::forward_inserted(const MicroBatch& mb, int32_t token, const Tensor& inserted,
                                         std::unique_ptr<StageActivations>* saved) {
  const Insertion insertion = make_insertion(mb, token, inserted);
  return run_forward(mb, Tensor(), &insertion, saved);
}

LlamaModel::Insertion LlamaModel::make_insertion(const MicroBatch& mb, int32_t token,
                                                 const Tensor& inserted) const {
  FORGE_CHECK(stage_.pre_process, "inserted embeddings go to the first stage");
  check_inputs(mb);
  const int64_t h = config_.hidden_size, n = mb.batch * mb.seq;
  Insertion insertion;
  insertion.rows = &inserted;
  insertion.count = inserted.defined() ? inserted.numel() / h : 0;
  FORGE_CHECK(!inserted.defined() || inserted.numel() == insertion.count * h,
              "inserted embeddings: {} values are not rows of {}", inserted.numel(), h);
  // Under sequence parallelism this rank's rows are [rank * n / tp, (rank + 1) * n / tp) of the micro-batch.
  const bool split_rows = tp() && tp()->sequence_parallel();
  const int64_t local = split_rows ? n / tp()->size() : n;
  const int64_t begin = split_rows ? tp()->rank() * local : 0;
  int64_t source = 0;
  for (int64_t r = 0; r < n; ++r) {
    if (mb.ids[r] != token) continue;
    if (r >= begin && r < begin + local) {
      InsertedRun* last = insertion.runs.empty() ? nullptr : &insertion.runs.back();
      if (last && last->row + last->count == r - begin && last->source + last->count == source)
        ++last->count;
      else
        insertion.runs.push_back({r - begin, 1, source});
    }
    ++source;
  }
  if (source != insertion.count)
    fail("the micro-batch holds {} image tokens (id {}) but its images give {} features ({} per image)",
         source, token, insertion.count, mb.images > 0 ? insertion.count / mb.images : 0);
  return insertion;
}

Tensor LlamaModel::logits_inserted(const int32_t* ids, int64_t batch, int64_t seq, int32_t token,
                                   const Tensor& inserted) {
  require_whole("logits");
  const Insertion insertion = make_insertion({ids, nullptr, batch, seq, 0.0f}, token, inserted);
  return head_.logits(final_hidden(ids, batch, seq, &insertion)).to(Device::cpu);
}

Tensor LlamaModel::inserted_gradient(StageActivations& state) const {
  auto& acts = static_cast<Activations&>(state);
  FORGE_CHECK(acts.input_done, "inserted_gradient before backward_input");
  Tensor out = std::move(acts.dinserted);
  acts.dinserted = Tensor();
  return out;
}

// After B of the first stage: the inserted rows' gradient moves out of dembed (the embedding's own gradient
// must not see it: those tokens' embeddings were replaced).
void LlamaModel::take_inserted_rows(Activations& acts) const {
  if (acts.inserted_runs.empty() && acts.inserted_count == 0) return;
  const int64_t h = config_.hidden_size;
  acts.dinserted = Tensor::zeros({acts.inserted_count, h}, DType::f32, options_.device);
  for (const InsertedRun& run : acts.inserted_runs) {
    copy_rows(acts.dembed, run.row, acts.dinserted, run.source, run.count, h);
    acts.dembed.view(run.row * h, {run.count * h}).fill_zero();
  }
}

StageOutput LlamaModel::run_forward(const MicroBatch& mb, const Tensor& hidden, const Insertion* insertion,
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
    if (insertion) {
      splice(insertion, x);
      acts->inserted_runs = insertion->runs, acts->inserted_count = insertion->count;
    }
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
    x = Tensor();
    Tensor targets_holder;
    const int32_t* device_targets = ids_on(options_.device, mb.targets, n, targets_holder);
    const nn::LossTotals loss =
        head_.forward(normed, mb.targets, device_targets, mb.grad_scale, saved ? &acts->dhead : nullptr);
    out.loss.sum = loss.sum, out.loss.tokens = loss.tokens;
  }
  if (saved) *saved = std::move(acts);
  return out;
}

Tensor LlamaModel::backward_input(const Tensor& doutput, StageActivations& state) {
  auto& acts = static_cast<Activations&>(state);
  FORGE_CHECK(!acts.input_done, "backward_input ran twice for one micro-batch");
  const nn::Fp8Recording fp8_recording(options_.fp8, true);
  Tensor dx = doutput;
  if (stage_.post_process) dx = final_norm_.backward_input(acts.dhead, acts.norm), acts.dhead = Tensor();
  FORGE_CHECK(dx.defined(), "backward_input of a stage that is not the last needs its output's gradient");
  for (size_t l = layers_.size(); l-- > 0;)
    dx = layers_[l].backward_input(dx, acts.batch, acts.seq, acts.layers[l]);
  acts.input_done = true;
  if (!stage_.pre_process) return dx;
  acts.dembed = dx;
  take_inserted_rows(acts);
  return Tensor();
}

void LlamaModel::backward_weight(StageActivations& state) {
  auto& acts = static_cast<Activations&>(state);
  FORGE_CHECK(acts.input_done && !acts.weight_done, "backward_weight before backward_input, or twice");
  const nn::Fp8Recording fp8_recording(options_.fp8, true);
  if (stage_.post_process) final_norm_.backward_weight(acts.norm);
  for (size_t l = layers_.size(); l-- > 0;) layers_[l].backward_weight(acts.layers[l]);
  if (stage_.pre_process) embedding_.backward_weight(acts.device_ids, acts.dembed), acts.dembed = Tensor();
  acts.weight_done = true;
}

// The fused order: each part's weight gradients right after its input gradient, so that what W reads is
// released as early as possible (the least memory); bitwise the same gradients as B-then-W.
Tensor LlamaModel::backward(const Tensor& doutput, StageActivations& state) {
  auto& acts = static_cast<Activations&>(state);
  FORGE_CHECK(!acts.input_done, "backward ran twice for one micro-batch");
  const nn::Fp8Recording fp8_recording(options_.fp8, true);
  Tensor dx = doutput;
  if (stage_.post_process) {
    dx = final_norm_.backward_input(acts.dhead, acts.norm), acts.dhead = Tensor();
    final_norm_.backward_weight(acts.norm);
  }
  FORGE_CHECK(dx.defined(), "backward of a stage that is not the last needs its output's gradient");
  for (size_t l = layers_.size(); l-- > 0;) {
    dx = layers_[l].backward_input(dx, acts.batch, acts.seq, acts.layers[l]);
    layers_[l].backward_weight(acts.layers[l]);
  }
  acts.input_done = acts.weight_done = true;
  if (!stage_.pre_process) return dx;
  acts.dembed = dx;
  take_inserted_rows(acts);
  embedding_.backward_weight(acts.device_ids, acts.dembed), acts.dembed = Tensor();
  return Tensor();
}

Tensor LlamaModel::embed(const int32_t* ids, int64_t rows) const {
  FORGE_CHECK(stage_.pre_process, "embed: this stage has no embedding");
  Tensor holder;
  return embedding_.forward(ids_on(options_.device, ids, rows, holder), rows);
}

Tensor LlamaModel::final_hidden(const int32_t* ids, int64_t batch, int64_t seq, const Insertion* insertion) {
  Tensor holder;
  Tensor x = embedding_.forward(ids_on(options_.device, ids, batch * seq, holder), batch * seq);
  splice(insertion, x);
  for (const nn::DecoderLayer& layer : layers_) {
    nn::DecoderLayer::Saved scratch;
    x = layer.forward(x, batch, seq, scratch);
  }
  nn::RmsNorm::Saved scratch;
  return final_norm_.forward(x, scratch);
}

Tensor LlamaModel::logits(const int32_t* ids, int64_t batch, int64_t seq) {
  require_whole("logits");
  check_inputs({ids, nullptr, batch, seq, 0.0f});
  return head_.logits(final_hidden(ids, batch, seq)).to(Device::cpu);
}

KvCache LlamaModel::make_cache(int64_t batch, int64_t capacity) const {
  require_whole("a KV cache");
  const int64_t max_positions = config_.max_position_embeddings;
  if (capacity == 0) capacity = max_positions;
  if (capacity < 0 || capacity > max_positions)
    fail("KV cache capacity {} is outside [1, max_position_embeddings = {}]", capacity, max_positions);
  if (batch <= 0) fail("KV cache batch must be positive, got {}", batch);
  return KvCache(config_.num_hidden_layers, batch, capacity, config_.num_key_value_heads, config_.head_dim,
                 options_.device);
}

Tensor LlamaModel::forward_cached(const int32_t* ids, int64_t batch, int64_t new_tokens, KvCache& cache,
                                  bool all_logits) {
  return run_cached(ids, batch, new_tokens, cache, all_logits, nullptr);
}

Tensor LlamaModel::forward_cached_inserted(const int32_t* ids, int64_t batch, int64_t new_tokens,
                                           KvCache& cache, int32_t token, const Tensor& inserted) {
  require_whole("cached inference");
  if (tp())
    fail("cached inference runs on one process; this model is split over tp = {} ranks", tp()->size());
  // The splice's rows are this call's new tokens.
  const Insertion insertion = make_insertion({ids, nullptr, batch, new_tokens, 0.0f}, token, inserted);
  return run_cached(ids, batch, new_tokens, cache, false, &insertion);
}

Tensor LlamaModel::run_cached(const int32_t* ids, int64_t batch, int64_t new_tokens, KvCache& cache,
                              bool all_logits, const Insertion* insertion) {
  require_whole("cached inference");
  if (tp())
    fail("cached inference runs on one process; this model is split over tp = {} ranks", tp()->size());
  if (batch <= 0 || new_tokens <= 0)
    fail("batch ({}) and new tokens ({}) must be positive", batch, new_tokens);
  if (!cache.allocated() || cache.layers() != config_.num_hidden_layers || cache.batch() != batch ||
      cache.kv_heads() != config_.num_key_value_heads || cache.head_dim() != config_.head_dim)
    fail(
        "KV cache ({} layers, batch {}, {} kv heads x {}) does not fit this model and batch "
        "({} layers, batch {}, {} kv heads x {}); make it with make_cache",
        cache.layers(), cache.batch(), cache.kv_heads(), cache.head_dim(), config_.num_hidden_layers, batch,
        config_.num_key_value_heads, config_.head_dim);
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
  splice(insertion, x);
  for (size_t l = 0; l < layers_.size(); ++l)
    x = layers_[l].forward_cached(x, batch, new_tokens, cache.layer(static_cast<int64_t>(l)));
  cache.advance(new_tokens);
  if (!all_logits && new_tokens > 1) {  // only each sequence's last token goes through the head
    Tensor last = Tensor::empty({batch, h}, DType::f32, options_.device);
    for (int64_t b = 0; b < batch; ++b) {
      Tensor row = last.view(b * h, {h});
      row.copy_from(x.view(((b + 1) * new_tokens - 1) * h, {h}));
    }
    x = last;
  }
  nn::RmsNorm::Saved norm_saved;
  return head_.logits(final_norm_.forward(x, norm_saved)).to(Device::cpu);
}

ModelFamily llama_family() {
  ModelFamily f;
  f.architecture = "LlamaForCausalLM";
  f.model_type = "llama";
  f.parse_config = [](const nlohmann::json& json, std::string_view source) -> std::unique_ptr<ModelConfig> {
    return std::make_unique<LlamaConfig>(LlamaConfig::from_json(json, source));
  };
  f.build = [](const ModelConfig& config, const nn::ComputeOptions& options, const StageSpec& stage,
               float init_std, bool with_grads, ParameterStore* into) -> std::unique_ptr<Model> {
    const auto* llama = dynamic_cast<const LlamaConfig*>(&config);
    FORGE_CHECK(llama != nullptr, "a {} config given to the LlamaForCausalLM family", config.architecture());
    return std::make_unique<LlamaModel>(*llama, options, init_std, with_grads, stage, into);
  };
  return f;
}

}  // namespace forge::models
