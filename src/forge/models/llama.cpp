#include "forge/models/llama.h"

#include <algorithm>
#include <cmath>

#include "forge/kernels/ops.h"
#include "forge/kernels/rope_tables.h"

namespace forge {

LlamaModel::LlamaModel(const LlamaConfig& config, nn::ComputeOptions options, float init_std, bool with_grads)
    : config_(config), options_(options) {
  config_.validate("model config");
  const int64_t h = config.hidden_size, v = config.vocab_size;
  embed_id_ = params_.add("model.embed_tokens.weight", {v, h}, true, nn::Init::normal, init_std);
  nn::LayerShape shape;
  shape.attention = {h, config.num_attention_heads, config.num_key_value_heads, config.head_dim};
  shape.ffn = config.intermediate_size;
  shape.norm_eps = static_cast<float>(config.rms_norm_eps);
  const int layers = static_cast<int>(config.num_hidden_layers);
  for (int i = 0; i < layers; ++i) layers_.emplace_back(&params_, i, shape, init_std, layers);
  norm_id_ = params_.add("model.norm.weight", {h}, false, nn::Init::ones);
  head_id_ = config.tie_word_embeddings ? embed_id_
                                        : params_.add("lm_head.weight", {v, h}, true, nn::Init::normal, init_std);
  params_.allocate(options.gemm_dtype == DType::bf16, with_grads);

  rope_.positions = config.max_position_embeddings;
  rope_.half_dim = config.head_dim / 2;
  rope_.cos = Tensor::empty({rope_.positions, rope_.half_dim}, DType::f32);
  rope_.sin = Tensor::empty({rope_.positions, rope_.half_dim}, DType::f32);
  rope_tables(rope_.positions, config.head_dim, config.rope_theta, config.rope_scaling, rope_.cos.f32(),
              rope_.sin.f32());

  embedding_ = nn::Embedding(&params_, embed_id_);
  for (auto& layer : layers_) layer.bind(&rope_, options);
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
                                     float grad_scale) {
  if (!params_.has_grads()) fail("forward_backward: this model was built for inference, without gradients");
  check_inputs(ids, targets, batch, seq);
  const int64_t rows = batch * seq, h = config_.hidden_size;
  std::vector<nn::TransformerLayer::Saved> saved(layers_.size());
  nn::RmsNorm::Saved norm_saved;
  Tensor hidden = final_hidden(ids, batch, seq, &saved, &norm_saved);

  Tensor dhidden = Tensor::empty({rows, h}, DType::f32);
  LossSum result = loss_head(hidden, targets, grad_scale, &dhidden);
  hidden = Tensor();

  Tensor dx = final_norm_.backward_input(dhidden, norm_saved);
  final_norm_.backward_weight(norm_saved);
  for (size_t l = layers_.size(); l-- > 0;) {
    dx = layers_[l].backward_input(dx, batch, seq, saved[l]);
    layers_[l].backward_weight(saved[l]);
  }
  embedding_.backward_weight(ids, dx);
  return result;
}

LossSum LlamaModel::loss_head(const Tensor& hidden, const int32_t* targets, float grad_scale, Tensor* dhidden) {
  // The vocabulary-chunked fused projection + cross-entropy; with dhidden it also computes the hidden
  // gradient and accumulates the head's weight gradient while each logits chunk is live.
  const int64_t rows = hidden.dim(0);
  Tensor hidden_gemm = nn::to_gemm_dtype(hidden, options_.gemm_dtype);
  Tensor weight_gemm = head_weight_gemm();
  Tensor lse = Tensor::empty({rows}, DType::f32), loss = Tensor::empty({rows}, DType::f32);
  ops::LinearCrossEntropyParams p;
  p.rows = rows, p.dim = config_.hidden_size, p.vocab = config_.vocab_size;
  p.gemm_dtype = options_.gemm_dtype;
  p.hidden_gemm = hidden_gemm.raw(), p.weight_gemm = weight_gemm.raw();
  p.targets = targets, p.lse = lse.f32(), p.loss = loss.f32();
  if (dhidden) p.grad_scale = grad_scale, p.dhidden = dhidden->f32(), p.dweight = params_.grad(head_id_).f32();
  Tensor workspace = Tensor::empty({ops::linear_cross_entropy_workspace_floats(p)}, DType::f32);
  p.workspace = workspace.f32();
  ops::linear_cross_entropy_forward(p);
  if (dhidden) ops::linear_cross_entropy_backward(p);
  LossSum result;
  for (int64_t i = 0; i < rows; ++i)
    if (targets[i] >= 0) result.sum += loss.f32()[i], ++result.tokens;
  return result;
}

LossSum LlamaModel::forward_loss(const int32_t* ids, const int32_t* targets, int64_t batch, int64_t seq) {
  check_inputs(ids, targets, batch, seq);
  return loss_head(final_hidden(ids, batch, seq, nullptr, nullptr), targets, 0.0f, nullptr);
}

Tensor LlamaModel::logits(const int32_t* ids, int64_t batch, int64_t seq) {
  check_inputs(ids, nullptr, batch, seq);
  return project_logits(final_hidden(ids, batch, seq, nullptr, nullptr));
}

KvCache LlamaModel::make_cache(int64_t batch, int64_t capacity) const {
  const int64_t max_positions = config_.max_position_embeddings;
  if (capacity == 0) capacity = max_positions;
  if (capacity < 0 || capacity > max_positions)
    fail("KV cache capacity {} is outside [1, max_position_embeddings = {}]", capacity, max_positions);
  if (batch <= 0) fail("KV cache batch must be positive, got {}", batch);
  return KvCache(config_.num_hidden_layers, batch, capacity, config_.num_key_value_heads, config_.head_dim);
}

Tensor LlamaModel::forward_cached(const int32_t* ids, int64_t batch, int64_t new_tokens, KvCache& cache,
                                  bool all_logits) {
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
  Tensor x = embedding_.forward(ids, batch * new_tokens);
  for (size_t l = 0; l < layers_.size(); ++l)
    x = layers_[l].forward_cached(x, batch, new_tokens, cache.layer(static_cast<int64_t>(l)));
  cache.advance(new_tokens);
  if (!all_logits && new_tokens > 1) {  // only each sequence's last token goes through the head
    Tensor last = Tensor::empty({batch, h}, DType::f32);
    for (int64_t b = 0; b < batch; ++b)
      std::copy_n(x.f32() + ((b + 1) * new_tokens - 1) * h, h, last.f32() + b * h);
    x = last;
  }
  nn::RmsNorm::Saved norm_saved;
  return project_logits(final_norm_.forward(x, norm_saved));
}

Tensor LlamaModel::project_logits(const Tensor& hidden) const {
  const int64_t rows = hidden.dim(0), v = config_.vocab_size;
  Tensor hidden_gemm = nn::to_gemm_dtype(hidden, options_.gemm_dtype);
  Tensor weight_gemm = head_weight_gemm();
  Tensor out = Tensor::empty({rows, v}, DType::f32);
  ops::GemmParams p;
  p.m = rows, p.n = v, p.k = config_.hidden_size;
  p.a = hidden_gemm.raw(), p.lda = p.k, p.b = weight_gemm.raw(), p.ldb = p.k, p.trans_b = true;
  p.ab_dtype = options_.gemm_dtype, p.c = out.f32(), p.ldc = v;
  ops::gemm(p);
  return out;
}

}  // namespace forge
