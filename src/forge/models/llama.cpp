#include "forge/models/llama.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "forge/core/device.h"
#include "forge/core/memory.h"
#include "forge/kernels/ops.h"
#include "forge/kernels/rope_tables.h"
#include "forge/nn/fp8_context.h"
#include "forge/nn/tensor_parallel.h"

namespace forge {
namespace {
// A host array of token ids on `device`: the array itself on the CPU, else a copy kept alive by `holder`.
const int32_t* ids_on(Device device, const int32_t* ids, int64_t n, Tensor& holder) {
  if (device == Device::cpu || ids == nullptr) return ids;
  Tensor host = Tensor::empty({n}, DType::i32);
  std::copy_n(ids, n, host.i32());
  holder = host.to(device);
  return holder.i32();
}
}  // namespace

LlamaModel::LlamaModel(const LlamaConfig& config, nn::ComputeOptions options, float init_std, bool with_grads)
    : config_(config), options_(options) {
  const std::string source = config.origin.name.empty() ? "model config" : config.origin.name;
  config_.validate(source);
  // Refused before anything is allocated, so a config too big for the machine is one line, not bad_alloc or
  // the OOM killer. On the CPU the host holds everything (with gradients, the optimizer's two moments too:
  // whoever trains a model with gradients steps it with AdamW); a model on a device needs a full fp32 host
  // copy while its weights are initialised or loaded, and the device's allocator reports its own memory.
  // Under tensor parallelism a rank holds 1/tp of the model, but a group's ranks usually share a machine, so
  // the whole model is what the machine must hold (an over-estimate when the group spans machines).
  const bool on_host = options.device == Device::cpu;
  config_.check_fits_in_memory(on_host && with_grads, on_host && options.gemm_dtype == DType::bf16,
                               host_memory_bytes(), source);
  const int64_t h = config.hidden_size, v = config.vocab_size;
  const int tp_size = options.tp_size(), rank = options.tp_rank();
  // Vocabulary-parallel embedding and head: rows padded to a multiple of vocab_divisible_by x tp, split
  // evenly; the padding rows are zero, masked out of the softmax and never saved.
  const int64_t unit = std::max<int64_t>(1, options.vocab_divisible_by) * tp_size;
  padded_vocab_ = tp_size > 1 ? (v + unit - 1) / unit * unit : v;
  local_vocab_ = padded_vocab_ / tp_size, vocab_start_ = rank * local_vocab_;
  const nn::ShardSpec vocab_shard{0, vocab_start_, {v, h}, true};
  const nn::ShardSpec replicated{-1, 0, {}, rank == 0};
  embed_id_ = params_.add("model.embed_tokens.weight", {local_vocab_, h}, true, nn::Init::normal, init_std, vocab_shard);
  nn::LayerShape shape;
  shape.attention = {h, config.num_attention_heads, config.num_key_value_heads, config.head_dim};
  shape.ffn = config.intermediate_size;
  shape.norm_eps = static_cast<float>(config.rms_norm_eps);
  shape.tp_rank = rank, shape.tp_size = tp_size;
  const int layers = static_cast<int>(config.num_hidden_layers);
  for (int i = 0; i < layers; ++i) layers_.emplace_back(&params_, i, shape, init_std, layers);
  norm_id_ = params_.add("model.norm.weight", {h}, false, nn::Init::ones, 0.02f, replicated);
  head_id_ = config.tie_word_embeddings
                 ? embed_id_
                 : params_.add("lm_head.weight", {local_vocab_, h}, true, nn::Init::normal, init_std, vocab_shard);
  params_.allocate(options.gemm_dtype == DType::bf16, with_grads, options.device);

  rope_.positions = config.max_position_embeddings;
  rope_.half_dim = config.head_dim / 2;
  rope_.cos = Tensor::empty({rope_.positions, rope_.half_dim}, DType::f32);
  rope_.sin = Tensor::empty({rope_.positions, rope_.half_dim}, DType::f32);
  rope_tables(rope_.positions, config.head_dim, config.rope_theta, config.rope_scaling, rope_.cos.f32(),
              rope_.sin.f32());
  rope_.cos = rope_.cos.to(options.device), rope_.sin = rope_.sin.to(options.device);

  embedding_ = nn::Embedding(&params_, embed_id_, tp());
  // FP8: every transformer layer's Linears except the first and last bf16_*_layers, which stay in the
  // GEMM dtype (the layers nearest the embedding and the loss are the most sensitive to precision).
  for (int i = 0; i < layers; ++i) {
    nn::ComputeOptions layer_options = options;
    if (options.fp8) {
      const nn::Fp8Options& f = options.fp8->options();
      if (i < f.bf16_first_layers || i >= layers - f.bf16_last_layers) layer_options.fp8 = nullptr;
    }
    layers_[static_cast<size_t>(i)].bind(&rope_, layer_options);
  }
  if (options.fp8) options.fp8->seal();
  final_norm_ = nn::RmsNorm(&params_, norm_id_, static_cast<float>(config.rms_norm_eps));
}

void LlamaModel::check_inputs(const int32_t* ids, const int32_t* targets, int64_t batch, int64_t seq) const {
  if (batch <= 0 || seq <= 0) fail("batch ({}) and sequence length ({}) must be positive", batch, seq);
  if (seq > config_.max_position_embeddings)
    fail("sequence length {} exceeds max_position_embeddings {}", seq, config_.max_position_embeddings);
  for (int64_t i = 0; i < batch * seq; ++i) {
    if (ids[i] < 0 || ids[i] >= config_.vocab_size)
      fail("token id {} at position {} is outside the vocabulary [0, {})", ids[i], i, config_.vocab_size);
    if (targets && targets[i] >= config_.vocab_size)
      fail("target id {} at position {} is outside the vocabulary [0, {})", targets[i], i, config_.vocab_size);
  }
  if (tp() && tp()->sequence_parallel() && (batch * seq) % tp()->size() != 0)
    fail("sequence parallelism splits the {} x {} token rows over tp = {} ranks: they do not divide", batch, seq,
         tp()->size());
}

Tensor LlamaModel::head_weight_gemm() const {
  const auto& info = params_.info(head_id_);
  if (options_.gemm_dtype == DType::bf16) return params_.params_bf16().view(info.offset, info.shape);
  return params_.param(head_id_);
}

Tensor LlamaModel::final_hidden(const int32_t* ids, int64_t batch, int64_t seq,
                                std::vector<nn::TransformerLayer::Saved>* saved, nn::RmsNorm::Saved* norm_saved) {
  Tensor x = embedding_.forward(ids, batch * seq);
  for (size_t l = 0; l < layers_.size(); ++l) {
    nn::TransformerLayer::Saved scratch;
    x = layers_[l].forward(x, batch, seq, saved ? (*saved)[l] : scratch);
  }
  nn::RmsNorm::Saved scratch;
  return final_norm_.forward(x, norm_saved ? *norm_saved : scratch);
}

LossSum LlamaModel::forward_backward(const int32_t* ids, const int32_t* targets, int64_t batch, int64_t seq,
                                     float grad_scale, bool last_micro_batch) {
  if (!params_.has_grads()) fail("forward_backward: this model was built for inference, without gradients");
  check_inputs(ids, targets, batch, seq);
  const nn::Fp8Recording fp8_recording(options_.fp8, true);  // training micro-batches feed the amax history
  Tensor ids_holder, targets_holder;
  const int32_t* device_ids = ids_on(options_.device, ids, batch * seq, ids_holder);
  const int32_t* device_targets = ids_on(options_.device, targets, batch * seq, targets_holder);
  std::vector<nn::TransformerLayer::Saved> saved(layers_.size());
  nn::RmsNorm::Saved norm_saved;
  Tensor hidden = final_hidden(device_ids, batch, seq, &saved, &norm_saved);

  Tensor dhidden;
  LossSum result = loss_head(hidden, targets, device_targets, grad_scale, &dhidden);
  hidden = Tensor();

  Tensor dx = final_norm_.backward_input(dhidden, norm_saved);
  final_norm_.backward_weight(norm_saved);
  if (last_micro_batch) {
    if (tp() && tp()->sequence_parallel())
      tp()->all_reduce_sum(params_.grad(norm_id_).f32(), config_.hidden_size, options_.device);
    notify_ready(norm_id_);
  }
  for (size_t l = layers_.size(); l-- > 0;) {
    dx = layers_[l].backward_input(dx, batch, seq, saved[l]);
    layers_[l].backward_weight(saved[l]);
    if (last_micro_batch) {
      layers_[l].reduce_replicated_grads();
      notify_ready(layers_[l].first_param());
    }
  }
  embedding_.backward_weight(device_ids, dx);
  if (last_micro_batch) notify_ready(embed_id_);
  return result;
}

Tensor LlamaModel::embed(const int32_t* ids, int64_t rows) const {
  Tensor holder;
  return embedding_.forward(ids_on(options_.device, ids, rows, holder), rows);
}

nn::TensorParallel* LlamaModel::tp() const { return options_.tp && options_.tp->size() > 1 ? options_.tp : nullptr; }

void LlamaModel::notify_ready(int param_id) const {
  if (grads_ready_) grads_ready_(params_.info(param_id).offset);
}

LossSum LlamaModel::loss_head(const Tensor& hidden, const int32_t* targets, const int32_t* device_targets,
                              float grad_scale, Tensor* dhidden) {
  // The vocabulary-chunked fused projection + cross-entropy; with dhidden it also computes the hidden
  // gradient and accumulates the head's weight gradient while each logits chunk is live.
  // Vocabulary-parallel (tp > 1): each rank covers its vocabulary range over all rows (gathered under
  // sequence parallelism); the per-range log-sum-exps and target logits combine over the group into the
  // global loss, and backward's partial hidden gradients sum (or reduce-scatter) over the group.
  nn::TensorParallel* group = tp();
  const Tensor full = nn::gather_in(group, hidden);
  const int64_t rows = full.dim(0);
  Tensor hidden_gemm = nn::to_gemm_dtype(full, options_.gemm_dtype);
  Tensor weight_gemm = head_weight_gemm();
  const Device device = options_.device;
  Tensor lse = Tensor::empty({rows}, DType::f32, device), loss = Tensor::empty({rows}, DType::f32, device);
  Tensor target_logit = Tensor::empty({rows}, DType::f32, device);
  ops::LinearCrossEntropyParams p;
  p.rows = rows, p.dim = config_.hidden_size, p.vocab = local_vocab_;
  p.vocab_start = vocab_start_, p.global_vocab = config_.vocab_size;
  p.gemm_dtype = options_.gemm_dtype;
  // GPUs want few, large GEMMs: 16 chunks for a 128K vocabulary (a 256 MiB workspace at 8192 rows).
  if (device != Device::cpu) p.vocab_chunk = 8192;
  p.hidden_gemm = hidden_gemm.raw(), p.weight_gemm = weight_gemm.raw();
  p.targets = device_targets, p.lse = lse.f32(), p.loss = loss.f32(), p.target_logit = target_logit.f32();
  Tensor dfull;
  if (dhidden) {
    dfull = Tensor::empty({rows, config_.hidden_size}, DType::f32, device);
    p.grad_scale = grad_scale, p.dhidden = dfull.f32(), p.dweight = params_.grad(head_id_).f32();
  }
  // Training (forward then backward here, on the same workspace): keep the logits for backward when the
  // budget allows, rather than computing them twice.
  p.keep_logits = dhidden != nullptr &&
                  rows * local_vocab_ * static_cast<int64_t>(sizeof(float)) <= options_.keep_logits_bytes;
  Tensor workspace = Tensor::empty({ops::linear_cross_entropy_workspace_floats(p)}, DType::f32, device);
  p.workspace = workspace.f32();
  ops::linear_cross_entropy_forward(p, device);
  if (group) {
    // The per-row statistics (a float per row each way) are combined on the host; on the CPU the host
    // tensors are the outputs themselves.
    const int n = group->size();
    std::vector<float> all(static_cast<size_t>(n) * rows);
    Tensor host_lse = lse.to(Device::cpu), host_target = target_logit.to(Device::cpu);
    Tensor host_loss = device == Device::cpu ? loss : Tensor::empty({rows}, DType::f32);
    group->all_gather(host_lse.f32(), all.data(), rows, Device::cpu);
    group->all_reduce_sum(host_target.f32(), rows, Device::cpu);
    for (int64_t r = 0; r < rows; ++r) {
      float m = -std::numeric_limits<float>::infinity();
      for (int i = 0; i < n; ++i) m = std::max(m, all[i * rows + r]);
      double sum = 0;
      for (int i = 0; i < n; ++i) sum += std::exp(static_cast<double>(all[i * rows + r]) - m);
      host_lse.f32()[r] = m + static_cast<float>(std::log(sum));
      host_loss.f32()[r] = targets[r] < 0 ? 0.0f : host_lse.f32()[r] - host_target.f32()[r];
    }
    if (device != Device::cpu) lse.copy_from(host_lse), loss.copy_from(host_loss);
  }
  if (dhidden) {
    ops::linear_cross_entropy_backward(p, device);
    *dhidden = nn::reduce_out(group, dfull);
  }
  const Tensor host_loss = loss.to(Device::cpu);
  LossSum result;
  for (int64_t i = 0; i < rows; ++i)
    if (targets[i] >= 0) result.sum += host_loss.f32()[i], ++result.tokens;
  return result;
}

LossSum LlamaModel::forward_loss(const int32_t* ids, const int32_t* targets, int64_t batch, int64_t seq) {
  check_inputs(ids, targets, batch, seq);
  Tensor ids_holder, targets_holder;
  const int32_t* device_ids = ids_on(options_.device, ids, batch * seq, ids_holder);
  const int32_t* device_targets = ids_on(options_.device, targets, batch * seq, targets_holder);
  return loss_head(final_hidden(device_ids, batch, seq, nullptr, nullptr), targets, device_targets, 0.0f, nullptr);
}

Tensor LlamaModel::logits(const int32_t* ids, int64_t batch, int64_t seq) {
  check_inputs(ids, nullptr, batch, seq);
  Tensor ids_holder;
  const int32_t* device_ids = ids_on(options_.device, ids, batch * seq, ids_holder);
  return project_logits(final_hidden(device_ids, batch, seq, nullptr, nullptr)).to(Device::cpu);
}

KvCache LlamaModel::make_cache(int64_t batch, int64_t capacity) const {
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
  if (tp()) fail("cached inference runs on one process; this model is split over tp = {} ranks", tp()->size());
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
  Tensor x = embedding_.forward(ids_on(options_.device, ids, batch * new_tokens, ids_holder), batch * new_tokens);
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
  return project_logits(final_norm_.forward(x, norm_saved)).to(Device::cpu);
}

Tensor LlamaModel::project_logits(const Tensor& hidden) const {
  nn::TensorParallel* group = tp();
  const Tensor full = nn::gather_in(group, hidden);
  const int64_t rows = full.dim(0), v = config_.vocab_size, local = local_vocab_;
  Tensor hidden_gemm = nn::to_gemm_dtype(full, options_.gemm_dtype);
  Tensor weight_gemm = head_weight_gemm();
  Tensor out = Tensor::empty({rows, local}, DType::f32, options_.device);
  ops::GemmParams p;
  p.m = rows, p.n = local, p.k = config_.hidden_size;
  p.a = hidden_gemm.raw(), p.lda = p.k, p.b = weight_gemm.raw(), p.ldb = p.k, p.trans_b = true;
  p.ab_dtype = options_.gemm_dtype, p.c = out.f32(), p.ldc = local;
  ops::gemm(p, options_.device);
  if (!group) return out;
  // Gather the vocabulary ranges and drop the padding: [tp, rows, local] -> [rows, vocab].
  const int n = group->size();
  Tensor all = Tensor::empty({n, rows, local}, DType::f32);
  const Tensor host_out = out.to(Device::cpu);
  group->all_gather(host_out.f32(), all.f32(), rows * local, Device::cpu);
  Tensor logits = Tensor::empty({rows, v}, DType::f32);
  for (int i = 0; i < n; ++i) {
    const int64_t width = std::clamp<int64_t>(v - i * local, 0, local);
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(all.f32() + (i * rows + r) * local, width, logits.f32() + r * v + i * local);
  }
  return logits;
}

}  // namespace forge
