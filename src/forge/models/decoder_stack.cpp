#include "forge/models/decoder_stack.h"

#include <algorithm>
#include <cmath>

#include "forge/core/device.h"
#include "forge/core/memory.h"
#include "forge/kernels/host_memory.h"
#include "forge/kernels/ops.h"
#include "forge/nn/fp8_context.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::models {
namespace {

bool any_layer(const DecoderSpec& s, bool (*is)(const LayerSpec&)) {
  return std::any_of(s.layer_specs.begin(), s.layer_specs.end(), is);
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

// A host array of token ids on `device`: the array itself on the CPU, else a copy kept alive by `holder`.
const int32_t* ids_on(Device device, const int32_t* ids, int64_t n, Tensor& holder) {
  if (device == Device::cpu || ids == nullptr) return ids;
  Tensor host = Tensor::empty({n}, DType::i32);
  std::copy_n(ids, n, host.i32());
  holder = host.to(device);
  return holder.i32();
}

struct DecoderStack::Insertion {
  const Tensor* rows = nullptr;
  std::vector<InsertedRun> runs;
  int64_t count = 0;  // rows of the inserted tensor
};

// What one micro-batch keeps between the stage's forward, backward_input and backward_weight.
struct DecoderStack::Activations final : StageActivations {
  int64_t batch = 0, seq = 0;
  Tensor ids_holder;
  const int32_t* device_ids = nullptr;
  std::vector<nn::DecoderLayer::Saved> layers;
  nn::Norm::Saved norm;
  Tensor dhead;   // last stage: the loss head's gradient at the final norm's output, for B
  Tensor dembed;  // first stage: the gradient at the embedding's output, for W
  std::vector<InsertedRun> inserted_runs;  // forward_inserted: where the inserted rows went
  int64_t inserted_count = 0;
  Tensor dinserted;                        // their gradient, taken out of dembed
  nn::DropoutRows dropout;                 // where the rows sit (hidden dropout; inactive outside training)
  nn::MoeRouterAux routing;                // with Hugging Face's load-balancing loss: its record
  Tensor positions_holder;                 // dropout.positions on a GPU
  std::unique_ptr<StageActivations> tail;  // the tail's
  bool input_done = false;                 // backward_input ran
  bool weight_done = false;                // backward_weight ran
};

DecoderStack::DecoderStack(const ModelConfig& config, DecoderSpec spec, nn::ComputeOptions options,
                           float init_std, bool with_grads, StageSpec stage, ParameterStore* into,
                           std::string name_prefix, std::unique_ptr<StackTail> tail)
    : config_(config.clone()),
      spec_(std::move(spec)),
      source_(config.source().empty() ? "model config" : config.source()),
      prefix_(std::move(name_prefix)),
      options_(options),
      stage_(stage),
      params_(into ? *into : own_params_),
      tail_(std::move(tail)) {
  check_stage_and_split(with_grads);
  // One loss over every MoE layer's routing: each layer's backward reads all layers' (nn::MoeRouterAux).
  if (spec_.router_aux_loss_coef > 0) moe_scale_.router_aux = static_cast<float>(spec_.router_aux_loss_coef);
  register_parameters(init_std);
  if (!into) params_.allocate(options.gemm_dtype == DType::bf16, with_grads, options.device);
  build_modules();
  if (options.fp8 && !into) options.fp8->seal();
  if (with_grads) register_tensor_parallel_sums();
}

// Refused before anything is allocated: a stage outside the model, a model too big for the machine, sizes
// that do not split over the tensor- or expert-parallel group.
void DecoderStack::check_stage_and_split(bool with_grads) {
  const DecoderSpec& s = spec_;
  const std::string& source = source_;
  const int64_t layers = s.layers;
  FORGE_CHECK(static_cast<int64_t>(s.layer_specs.size()) >= layers, "{}: {} layer specs for {} layers",
              source, s.layer_specs.size(), layers);
  if (stage_.end_layer < 0) stage_.end_layer = layers;
  if (stage_.first_layer < 0 || stage_.first_layer > stage_.end_layer || stage_.end_layer > layers)
    fail("{}: stage layers [{}, {}) are outside the model's {} layers", source, stage_.first_layer,
         stage_.end_layer, layers);
  if (!stage_.post_process) tail_.reset();  // the tail runs on the last stage
  // One line, not bad_alloc or the OOM killer. On the CPU the host holds everything (with gradients, the
  // optimizer's two moments too: whoever trains a model with gradients steps it with AdamW); a model on a
  // device needs a full fp32 host copy while its weights are initialised or loaded, and the device's
  // allocator reports its own memory. Under tensor parallelism a rank holds 1/tp of the model, but a group's
  // ranks usually share a machine, so the whole model is what the machine must hold (an over-estimate when
  // the group spans machines).
  const bool on_host = options_.device == Device::cpu;
  // (A dry device initialises nothing on the host: no bound there, kernels/host_memory.h.)
  config_->check_fits_in_memory(on_host && with_grads, on_host && options_.gemm_dtype == DType::bf16,
                                model_host_memory_bytes(), source);
  const int tp_size = options_.tp_size();
  const bool gqa = any_layer(s, [](const LayerSpec& l) { return l.attention == AttentionKind::gqa; });
  const bool mla = any_layer(s, [](const LayerSpec& l) { return l.attention == AttentionKind::mla; });
  const bool dense = any_layer(s, [](const LayerSpec& l) { return l.feed_forward != FeedForwardKind::moe; });
  const bool moe = any_layer(s, [](const LayerSpec& l) { return l.feed_forward == FeedForwardKind::moe; });
  if (moe && s.moe.experts % options_.ep_size() != 0)
    fail("{}: n_routed_experts = {} does not split over parallel.ep = {}", source, s.moe.experts,
         options_.ep_size());
  const bool heads_split = (!gqa || s.heads % tp_size == 0) && (!mla || s.mla.heads % tp_size == 0);
  const bool kv_split = !gqa || s.kv_heads % tp_size == 0 || tp_size % s.kv_heads == 0;
  const bool ffn_split = (!dense || s.ffn % tp_size == 0) && (!moe || s.moe.expert_ffn % tp_size == 0);
  if (!heads_split || !kv_split || !ffn_split)
    fail("{}: {} heads{}, ffn {}{} do not split over tp = {}", source, gqa ? s.heads : s.mla.heads,
         gqa ? fmt::format(" ({} kv heads)", s.kv_heads) : "", s.ffn,
         moe ? fmt::format(" and expert ffn {}", s.moe.expert_ffn) : "", tp_size);
}

// The stage's parameters in their fixed order: the embedding, each layer, the final norm and the head, and
// the tail's.
void DecoderStack::register_parameters(float init_std) {
  const DecoderSpec& s = spec_;
  const int tp_size = options_.tp_size(), rank = options_.tp_rank();
  // Vocabulary-parallel embedding and head: rows padded to a multiple of vocab_divisible_by x tp, split
  // evenly; the padding rows are zero, masked out of the softmax and never saved.
  const int64_t h = s.hidden, v = s.vocab;
  const int64_t unit = std::max<int64_t>(1, options_.vocab_divisible_by) * tp_size;
  padded_vocab_ = tp_size > 1 ? (v + unit - 1) / unit * unit : v;
  local_vocab_ = padded_vocab_ / tp_size, vocab_start_ = rank * local_vocab_;
  const ShardSpec vocab_shard{0, vocab_start_, {v, h}, true};

  // The embedding: the first stage's, a tail's input, and with tied embeddings the last stage's head (a last
  // stage without the first holds its own copy under the same name, the same values since initialisation
  // depends on the name, which pipelines keep equal). In a store shared with another chunk of the rank (the
  // V schedules put the first and the last stage on one rank) the tensor is registered once.
  const std::string embed_name = prefix_ + "model.embed_tokens.weight";
  const bool tied = s.tie_word_embeddings;
  const int tail_embedding = tail_ ? tail_->embedding_reads() : 0;
  const int head_reads = stage_.post_process ? 1 + (tail_ ? tail_->head_reads() : 0) : 0;
  const int existing_embedding = params_.find(embed_name);
  int embedding_uses = 0;
  if (stage_.pre_process || tail_embedding > 0 || (tied && stage_.post_process)) {
    embed_id_ = existing_embedding >= 0
                    ? existing_embedding
                    : params_.add(embed_name, {local_vocab_, h}, true, Init::normal, init_std, vocab_shard);
    embedding_uses = (stage_.pre_process ? 1 : 0) + tail_embedding;
  }
  for (int64_t i = stage_.first_layer; i < stage_.end_layer; ++i)
    layer_ids_.push_back(register_layer(i, init_std));
  if (stage_.post_process) {
    norm_id_ = register_norm(prefix_ + "model.norm");
    if (tied) {
      head_id_ = embed_id_;
      embedding_uses += head_reads;
    } else {
      head_id_ = params_.add(prefix_ + "lm_head.weight", {local_vocab_, h}, true, Init::normal, init_std,
                             vocab_shard);
      if (head_reads > 1) params_.set_grad_uses(head_id_, head_reads);
    }
    if (tail_) tail_->register_parameters(*this, init_std);
  }
  if (embed_id_ >= 0) {
    if (existing_embedding >= 0) embedding_uses += params_.info(embed_id_).grad_uses;
    if (embedding_uses > 1) params_.set_grad_uses(embed_id_, embedding_uses);
  }
}

// The modules over the allocated store: embedding, layers, final norm and head, and the tail's.
void DecoderStack::build_modules() {
  rope_ = spec_.rope;
  rope_.cos = rope_.cos.to(options_.device), rope_.sin = rope_.sin.to(options_.device);
  spec_.rope = nn::RopeTable{};  // the stack's copy is the one kept
  if (spec_.local_rope.positions > 0) {
    local_rope_ = spec_.local_rope;
    local_rope_.cos = local_rope_.cos.to(options_.device),
    local_rope_.sin = local_rope_.sin.to(options_.device);
    spec_.local_rope = nn::RopeTable{};
  }
  if (embed_id_ >= 0) {
    // The rows may come from the bf16 weights where they go straight into a bf16 residual stream (rounding
    // the fp32 rows would give the same numbers); scaled, or into fp32 residuals, they are read in fp32.
    const bool bf16_rows = options_.gemm_dtype == DType::bf16 && options_.residual_dtype == DType::bf16 &&
                           spec_.embedding_scale == 1.0f;
    embedding_ =
        nn::Embedding(&params_, embed_id_, tp(), spec_.embedding_scale, bf16_rows ? DType::bf16 : DType::f32);
  }
  for (size_t l = 0; l < layer_ids_.size(); ++l) {
    const int64_t i = stage_.first_layer + static_cast<int64_t>(l);
    layers_.push_back(make_layer(i, layer_ids_[l], layer_options(i)));
  }
  if (stage_.post_process) {
    final_norm_ = make_norm(norm_id_);
    head_ = nn::LossHead(&params_, head_id_, spec_.vocab, vocab_start_, options_, spec_.final_softcap);
    if (tail_) tail_->build(*this);
  }
}

nn::TensorParallel* DecoderStack::tp() const {
  return options_.tp && options_.tp->size() > 1 ? options_.tp : nullptr;
}

void DecoderStack::require_whole(const char* what) const {
  if (!stage_.pre_process || !stage_.post_process || stage_.first_layer != 0 ||
      stage_.end_layer != spec_.layers)
    fail("{} needs the whole model; this stage holds layers [{}, {}){}{}", what, stage_.first_layer,
         stage_.end_layer, stage_.pre_process ? " with the embedding" : "",
         stage_.post_process ? " with the head" : "");
}

void DecoderStack::check_ids(const int32_t* ids, int64_t n) const {
  for (int64_t i = 0; i < n; ++i)
    if (ids[i] < 0 || ids[i] >= spec_.vocab)
      fail("token id {} at position {} is outside the vocabulary [0, {})", ids[i], i, spec_.vocab);
}

void DecoderStack::check_documents(const MicroBatch& mb) const {
  if (!mb.documents) return;
  if (options_.cp) fail("packed documents (document masks) are not supported under context parallelism yet");
  int64_t row = 0;
  for (const int64_t length : *mb.documents) {
    if (length < 1 || row / mb.seq != (row + length - 1) / mb.seq)
      fail("packed documents: a document of {} tokens at row {} does not lie within one sequence of {}",
           length, row, mb.seq);
    row += length;
  }
  if (row != mb.batch * mb.seq)
    fail("packed documents: their lengths add up to {} tokens, the micro-batch holds {} x {}", row, mb.batch,
         mb.seq);
}

void DecoderStack::check_inputs(const MicroBatch& mb) const {
  if (mb.batch <= 0 || mb.seq <= 0)
    fail("batch ({}) and sequence length ({}) must be positive", mb.batch, mb.seq);
  if (mb.seq > spec_.max_positions)
    fail("sequence length {} exceeds max_position_embeddings {}", mb.seq, spec_.max_positions);
  const int64_t n = mb.batch * mb.seq;
  if (stage_.pre_process || (tail_ && tail_->reads_ids())) {
    FORGE_CHECK(mb.ids != nullptr, "{} needs token ids", stage_.pre_process ? "the first stage" : "the tail");
    check_ids(mb.ids, n);
  }
  if (stage_.post_process && mb.targets)
    for (int64_t i = 0; i < n; ++i)
      if (mb.targets[i] >= spec_.vocab)
        fail("target id {} at position {} is outside the vocabulary [0, {})", mb.targets[i], i, spec_.vocab);
  if (tail_) tail_->check(mb);
  if (tp() && tp()->sequence_parallel() && n % tp()->size() != 0)
    fail("sequence parallelism splits the {} x {} token rows over tp = {} ranks: they do not divide",
         mb.batch, mb.seq, tp()->size());
}

StageOutput DecoderStack::forward(const MicroBatch& mb, const Tensor& hidden,
                                  std::unique_ptr<StageActivations>* saved) {
  if (mb.pixels || mb.images)
    fail("{} takes no images ({} given); a multimodal model is a LlavaForConditionalGeneration",
         config_->architecture(), mb.images);
  return run_forward(mb, hidden, nullptr, saved);
}

StageOutput DecoderStack::forward_inserted(const MicroBatch& mb, int32_t token, const Tensor& inserted,
                                           std::unique_ptr<StageActivations>* saved) {
  const Insertion insertion = make_insertion(mb, token, inserted);
  return run_forward(mb, Tensor(), &insertion, saved);
}

// The embeddings x [rows, hidden] of this rank's tokens with the inserted rows in place (nothing: null).
void DecoderStack::splice(const Insertion* insertion, const Tensor& x) const {
  if (!insertion) return;
  for (const InsertedRun& run : insertion->runs)
    copy_rows(*insertion->rows, run.source, x, run.row, run.count, spec_.hidden);
}

DecoderStack::Insertion DecoderStack::make_insertion(const MicroBatch& mb, int32_t token,
                                                     const Tensor& inserted) const {
  FORGE_CHECK(stage_.pre_process, "inserted embeddings go to the first stage");
  check_inputs(mb);
  const int64_t h = spec_.hidden, n = mb.batch * mb.seq;
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

Tensor DecoderStack::logits_inserted(const int32_t* ids, int64_t batch, int64_t seq, int32_t token,
                                     const Tensor& inserted) {
  require_whole("logits");
  const Insertion insertion = make_insertion({ids, nullptr, batch, seq, 0.0f}, token, inserted);
  return head_.logits(final_hidden(ids, batch, seq, &insertion)).to(Device::cpu);
}

Tensor DecoderStack::inserted_gradient(StageActivations& state) const {
  auto& acts = static_cast<Activations&>(state);
  FORGE_CHECK(acts.input_done, "inserted_gradient before backward_input");
  Tensor out = std::move(acts.dinserted);
  acts.dinserted = Tensor();
  return out;
}

// After B of the first stage: the gradient at the embedding's output (dropout's backward applied) kept for W,
// in the stream's dtype, which the embedding gathers it in; with inserted rows in fp32, their gradient moved
// out of it (the embedding's own gradient must not see it: those tokens' embeddings were replaced).
void DecoderStack::keep_embedding_gradient(Activations& acts, Tensor dx) const {
  nn::dropout_inplace(options_, acts.dropout, dx, spec_.hidden);
  if (acts.inserted_runs.empty() && acts.inserted_count == 0) {
    acts.dembed = dx;
    return;
  }
  acts.dembed = nn::to_dtype(dx, DType::f32);
  const int64_t h = spec_.hidden;
  acts.dinserted = Tensor::zeros({acts.inserted_count, h}, DType::f32, options_.device);
  for (const InsertedRun& run : acts.inserted_runs) {
    copy_rows(acts.dembed, run.row, acts.dinserted, run.source, run.count, h);
    acts.dembed.view(run.row * h, {run.count * h}).fill_zero();
  }
}

nn::DropoutRows DecoderStack::dropout_rows(const MicroBatch& mb, Tensor& positions_holder) const {
  nn::DropoutRows rows;
  if (options_.hidden_dropout <= 0.0f || mb.first_sample < 0) return rows;
  rows.first_sample = mb.first_sample, rows.seq = mb.seq;
  // Under sequence parallelism this rank's rows are [rank * n / tp, (rank + 1) * n / tp) of the micro-batch.
  if (tp() && tp()->sequence_parallel()) rows.row_begin = tp()->rank() * (mb.batch * mb.seq / tp()->size());
  if (mb.positions) rows.positions = ids_on(options_.device, mb.positions, mb.seq, positions_holder);
  return rows;
}

StageOutput DecoderStack::run_forward(const MicroBatch& mb, const Tensor& hidden, const Insertion* insertion,
                                      std::unique_ptr<StageActivations>* saved) {
  if (saved && !params_.has_grads())
    fail("forward for backward: this model was built for inference, without gradients");
  check_inputs(mb);
  check_documents(mb);
  if (stage_.post_process) FORGE_CHECK(mb.targets != nullptr, "the last stage needs targets");
  // Training micro-batches (those that will run backward) feed the FP8 amax history.
  const nn::Fp8Recording fp8_recording(options_.fp8, saved != nullptr);
  auto acts = std::make_unique<Activations>();
  acts->batch = mb.batch, acts->seq = mb.seq;
  const int64_t n = mb.batch * mb.seq;
  Tensor x;
  if (stage_.pre_process) {
    acts->device_ids = ids_on(options_.device, mb.ids, n, acts->ids_holder);
    // Into the residual stream's dtype before the vocabulary shards' sum (not with inserted rows: their
    // features splice into fp32 rows).
    x = embedding_.forward(acts->device_ids, n, insertion ? DType::f32 : options_.residual_dtype);
    if (insertion) {
      splice(insertion, x);
      acts->inserted_runs = insertion->runs, acts->inserted_count = insertion->count;
    }
  } else {
    const int64_t rows = tp() && tp()->sequence_parallel() ? n / tp()->size() : n;
    FORGE_CHECK(hidden.defined() && hidden.numel() == rows * spec_.hidden,
                "stage input: {} elements, expected [{}, {}] hidden states",
                hidden.defined() ? hidden.numel() : 0, rows, spec_.hidden);
    x = hidden;
  }
  acts->dropout = dropout_rows(mb, acts->positions_holder);
  nn::MoeRouterAux* routing = saved ? begin_routing(mb, acts->routing) : nullptr;
  if (stage_.pre_process) {
    nn::dropout_inplace(options_, acts->dropout, x, spec_.hidden);  // site 0
    x = nn::to_dtype(x, options_.residual_dtype);
  }
  if (saved) acts->layers.resize(layers_.size());
  for (size_t l = 0; l < layers_.size(); ++l) {
    nn::DecoderLayer::Saved scratch;
    nn::DecoderLayer::Saved& kept = saved ? acts->layers[l] : scratch;
    kept.dropout = acts->dropout;  // sites 1 + 2 i and 2 + 2 i of layer i
    kept.dropout.stream = static_cast<uint32_t>(1 + 2 * (stage_.first_layer + static_cast<int64_t>(l)));
    kept.router_aux = routing;
    kept.documents = mb.documents;
    x = layers_[l].forward(x, mb.batch, mb.seq, kept);
  }
  StageOutput out;
  if (!stage_.post_process) {
    out.hidden = x;
    if (routing) out.routing = routing->through_here();
  } else {
    nn::Norm::Saved scratch;
    const Tensor normed = final_norm_.forward(x, saved ? acts->norm : scratch);
    Tensor targets_holder;
    const int32_t* device_targets = ids_on(options_.device, mb.targets, n, targets_holder);
    const nn::LossTotals loss =
        head_.forward(normed, mb.targets, device_targets, mb.grad_scale, saved ? &acts->dhead : nullptr);
    out.loss.sum = loss.sum, out.loss.tokens = loss.tokens;
    if (tail_) tail_->forward(mb, nn::to_dtype(x, DType::f32), loss.tokens, saved ? &acts->tail : nullptr);
  }
  if (saved) *saved = std::move(acts);
  return out;
}

// Hugging Face's load-balancing loss: the micro-batch's record, with the earlier stages' sums; null when the
// loss is off.
nn::MoeRouterAux* DecoderStack::begin_routing(const MicroBatch& mb, nn::MoeRouterAux& record) const {
  if (spec_.router_aux_loss_coef <= 0) return nullptr;
  const int64_t experts = spec_.moe.experts;
  record.reset(expert_layer_count(), static_cast<int64_t>(moe_layers_.size()), experts);
  FORGE_CHECK(stage_.pre_process || mb.routing_before,
              "layers {}..{}: a training forward without the earlier stages' routing", stage_.first_layer,
              stage_.end_layer);
  if (!stage_.pre_process) std::copy(mb.routing_before, mb.routing_before + experts, record.before.begin());
  return &record;
}

// Before a micro-batch's backward: its routing over every layer, which the last stage has whole and the
// others are given (StageActivations::routing_total).
void DecoderStack::finish_routing(Activations& acts) const {
  if (spec_.router_aux_loss_coef <= 0 || acts.routing.layers == 0) return;
  if (stage_.post_process) acts.routing_total = acts.routing.through_here();
  FORGE_CHECK(static_cast<int64_t>(acts.routing_total.size()) == spec_.moe.experts,
              "layers {}..{}: backward without the later stages' routing", stage_.first_layer,
              stage_.end_layer);
  acts.routing.total = acts.routing_total;
}

Tensor DecoderStack::head_backward(Activations& acts, bool fused) {
  const Tensor dtail = tail_ ? tail_->backward_input(*acts.tail) : Tensor();
  if (tail_ && fused) tail_->backward_weight(*acts.tail);
  Tensor dx = final_norm_.backward_input(acts.dhead, acts.norm, options_.residual_dtype);
  acts.dhead = Tensor();
  if (fused) final_norm_.backward_weight(acts.norm);
  if (dtail.defined()) ops::add_inplace(dx.elements(), dtail.elements(), dx.numel(), options_.device);
  return dx;
}

Tensor DecoderStack::backward_input(const Tensor& doutput, StageActivations& state) {
  auto& acts = static_cast<Activations&>(state);
  FORGE_CHECK(!acts.input_done, "backward_input ran twice for one micro-batch");
  const nn::Fp8Recording fp8_recording(options_.fp8, true);
  finish_routing(acts);
  Tensor dx = stage_.post_process ? head_backward(acts, false) : doutput;
  FORGE_CHECK(dx.defined(), "backward_input of a stage that is not the last needs its output's gradient");
  for (size_t l = layers_.size(); l-- > 0;)
    dx = layers_[l].backward_input(dx, acts.batch, acts.seq, acts.layers[l]);
  acts.input_done = true;
  if (!stage_.pre_process) return dx;
  keep_embedding_gradient(acts, dx);
  return Tensor();
}

void DecoderStack::backward_weight(StageActivations& state) {
  auto& acts = static_cast<Activations&>(state);
  FORGE_CHECK(acts.input_done && !acts.weight_done, "backward_weight before backward_input, or twice");
  const nn::Fp8Recording fp8_recording(options_.fp8, true);
  if (stage_.post_process) {
    if (tail_) tail_->backward_weight(*acts.tail);
    final_norm_.backward_weight(acts.norm);
  }
  for (size_t l = layers_.size(); l-- > 0;) layers_[l].backward_weight(acts.layers[l]);
  if (stage_.pre_process) embedding_.backward_weight(acts.device_ids, acts.dembed), acts.dembed = Tensor();
  acts.weight_done = true;
}

// The fused order: each part's weight gradients right after its input gradient, so that what W reads is
// released as early as possible (the least memory); bitwise the same gradients as B-then-W.
Tensor DecoderStack::backward(const Tensor& doutput, StageActivations& state) {
  auto& acts = static_cast<Activations&>(state);
  FORGE_CHECK(!acts.input_done, "backward ran twice for one micro-batch");
  const nn::Fp8Recording fp8_recording(options_.fp8, true);
  finish_routing(acts);
  Tensor dx = stage_.post_process ? head_backward(acts, true) : doutput;
  FORGE_CHECK(dx.defined(), "backward of a stage that is not the last needs its output's gradient");
  for (size_t l = layers_.size(); l-- > 0;) {
    dx = layers_[l].backward_input(dx, acts.batch, acts.seq, acts.layers[l]);
    layers_[l].backward_weight(acts.layers[l]);
  }
  acts.input_done = acts.weight_done = true;
  if (!stage_.pre_process) return dx;
  keep_embedding_gradient(acts, dx);
  embedding_.backward_weight(acts.device_ids, acts.dembed), acts.dembed = Tensor();
  return Tensor();
}

Tensor DecoderStack::embed(const int32_t* ids, int64_t rows) const {
  FORGE_CHECK(stage_.pre_process, "embed: this stage has no embedding");
  Tensor holder;
  return embedding_.forward(ids_on(options_.device, ids, rows, holder), rows);
}

Tensor DecoderStack::final_hidden(const int32_t* ids, int64_t batch, int64_t seq,
                                  const Insertion* insertion) {
  Tensor holder;
  Tensor x = embedding_.forward(ids_on(options_.device, ids, batch * seq, holder), batch * seq);
  splice(insertion, x);
  x = nn::to_dtype(x, options_.residual_dtype);
  for (const nn::DecoderLayer& layer : layers_) {
    nn::DecoderLayer::Saved scratch;
    x = layer.forward(x, batch, seq, scratch);
  }
  nn::Norm::Saved scratch;
  return final_norm_.forward(x, scratch);
}

Tensor DecoderStack::logits(const int32_t* ids, int64_t batch, int64_t seq) {
  require_whole("logits");
  check_inputs({ids, nullptr, batch, seq, 0.0f});
  return head_.logits(final_hidden(ids, batch, seq, nullptr)).to(Device::cpu);
}

nn::KvCache DecoderStack::make_cache(int64_t batch, int64_t capacity) const {
  require_whole("a KV cache");
  const int64_t max_positions = spec_.max_positions;
  if (capacity == 0) capacity = max_positions;
  if (capacity < 0 || capacity > max_positions)
    fail("KV cache capacity {} is outside [1, max_position_embeddings = {}]", capacity, max_positions);
  if (batch <= 0) fail("KV cache batch must be positive, got {}", batch);
  return nn::KvCache(spec_.layers, batch, capacity, spec_.cache_heads, spec_.cache_dim, options_.device);
}

Tensor DecoderStack::forward_cached(const int32_t* ids, int64_t batch, int64_t new_tokens, nn::KvCache& cache,
                                    bool all_logits) {
  return run_cached(ids, batch, new_tokens, cache, all_logits, nullptr);
}

Tensor DecoderStack::forward_cached_inserted(const int32_t* ids, int64_t batch, int64_t new_tokens,
                                             nn::KvCache& cache, int32_t token, const Tensor& inserted) {
  require_whole("cached inference");
  if (tp())
    fail("cached inference runs on one process; this model is split over tp = {} ranks", tp()->size());
  // The splice's rows are this call's new tokens.
  const Insertion insertion = make_insertion({ids, nullptr, batch, new_tokens, 0.0f}, token, inserted);
  return run_cached(ids, batch, new_tokens, cache, false, &insertion);
}

// Inference through the main layers (a tail is not used).
Tensor DecoderStack::run_cached(const int32_t* ids, int64_t batch, int64_t new_tokens, nn::KvCache& cache,
                                bool all_logits, const Insertion* insertion) {
  require_whole("cached inference");
  if (tp())
    fail("cached inference runs on one process; this model is split over tp = {} ranks", tp()->size());
  if (batch <= 0 || new_tokens <= 0)
    fail("batch ({}) and new tokens ({}) must be positive", batch, new_tokens);
  if (!cache.allocated() || cache.layers() != spec_.layers || cache.batch() != batch ||
      cache.kv_heads() != spec_.cache_heads || cache.head_dim() != spec_.cache_dim)
    fail(
        "KV cache ({} layers, batch {}, {} kv heads x {}) does not fit this model and batch "
        "({} layers, batch {}, {} kv heads x {}); make it with make_cache",
        cache.layers(), cache.batch(), cache.kv_heads(), cache.head_dim(), spec_.layers, batch,
        spec_.cache_heads, spec_.cache_dim);
  const int64_t end = cache.length() + new_tokens;
  if (end > spec_.max_positions)
    fail("context full: {} cached + {} new tokens exceed max_position_embeddings {}", cache.length(),
         new_tokens, spec_.max_positions);
  if (end > cache.capacity())
    fail("KV cache full: {} cached + {} new tokens exceed its capacity of {} positions", cache.length(),
         new_tokens, cache.capacity());
  check_ids(ids, batch * new_tokens);

  const int64_t h = spec_.hidden;
  Tensor ids_holder;
  Tensor x =
      embedding_.forward(ids_on(options_.device, ids, batch * new_tokens, ids_holder), batch * new_tokens);
  splice(insertion, x);
  for (size_t l = 0; l < layers_.size(); ++l)
    x = layers_[l].forward_cached(x, batch, new_tokens, cache.layer(static_cast<int64_t>(l)));
  cache.advance(new_tokens);
  if (!all_logits && new_tokens > 1) {  // only each sequence's last token goes through the head
    Tensor last = Tensor::empty({batch, h}, DType::f32, options_.device);
    for (int64_t b = 0; b < batch; ++b)
      last.view(b * h, {h}).copy_from(x.view(((b + 1) * new_tokens - 1) * h, {h}));
    x = last;
  }
  nn::Norm::Saved norm_saved;
  return head_.logits(final_norm_.forward(x, norm_saved)).to(Device::cpu);
}

// ---- Routed experts.

void DecoderStack::begin_train_step(const TrainStepSettings& settings) {
  set_balance_scale(settings.balance_scale);
  set_aux_loss_scale(settings.aux_loss_scale);
  moe_scale_.router_aux = static_cast<float>(spec_.router_aux_loss_coef * settings.micro_batch_weight);
  for (nn::MoeStats& s : moe_stats_) s.reset(spec_.moe.experts);
  if (tail_) tail_->begin_train_step(settings);
}

int64_t DecoderStack::expert_layer_count() const {
  return std::count_if(spec_.layer_specs.begin(), spec_.layer_specs.end(),
                       [](const LayerSpec& l) { return l.feed_forward == FeedForwardKind::moe; });
}

std::vector<ExpertLayerView> DecoderStack::expert_layers() {
  std::vector<ExpertLayerView> views;
  for (size_t i = 0; i < moe_layer_ids_.size(); ++i) {
    const auto [layer, bias] = moe_layer_ids_[i];
    // Its slot: the MoE layers before it in the whole model.
    const int64_t slot =
        std::count_if(spec_.layer_specs.begin(), spec_.layer_specs.begin() + layer,
                      [](const LayerSpec& l) { return l.feed_forward == FeedForwardKind::moe; });
    views.push_back({layer, slot, &moe_stats_[i], bias});
  }
  return views;
}

void DecoderStack::apply_bias_updates(float rate, bool zero_mean) {
  for (const nn::Moe* moe : moe_layers_) moe->apply_bias_update(rate, zero_mean);
}

double DecoderStack::balance_loss(double coefficient) const {
  double total = 0;
  for (const nn::MoeStats& s : moe_stats_)
    if (s.sequences > 0) total += coefficient * s.balance_sum / static_cast<double>(s.sequences);
  return total;
}

double DecoderStack::aux_loss(double coefficient) const {
  double total = 0;
  for (const nn::MoeStats& s : moe_stats_)
    if (s.micro_batches > 0) total += coefficient * s.aux_sum / static_cast<double>(s.micro_batches);
  return total;
}

}  // namespace forge::models
