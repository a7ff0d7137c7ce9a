// LlamaModel: a LLaMA-family decoder (Hugging Face LlamaForCausalLM semantics) assembled from nn/
// modules, with parameters under their Hugging Face names in one ParameterStore. Training runs
// forward_backward over whole sequences; inference runs forward_cached over a KvCache, a prompt at once
// (prefill) and then one token per step (decode). ComputeOptions::device places the parameters, every
// activation and the KV cache on a device; ids and targets are host arrays in every case, and losses and
// logits come back to the host.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include "forge/models/llama_config.h"
#include "forge/nn/compute.h"
#include "forge/nn/embedding.h"
#include "forge/nn/kv_cache.h"
#include "forge/nn/parameters.h"
#include "forge/nn/rmsnorm.h"
#include "forge/nn/transformer_layer.h"

namespace forge {

using nn::KvCache;

struct LossSum {
  double sum = 0;      // sum of per-token losses (nats)
  int64_t tokens = 0;  // tokens with a target (target >= 0)
  double mean() const { return tokens ? sum / static_cast<double>(tokens) : 0.0; }
};

class LlamaModel {
 public:
  // Registers and allocates parameters; they start at zero until initialize() or a load.
  // with_grads = false builds an inference model (no gradient buffers; forward_backward is refused).
  LlamaModel(const LlamaConfig& config, nn::ComputeOptions options, float init_std = 0.02f, bool with_grads = true);
  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;

  void initialize(uint64_t seed) { params_.initialize(seed); }
  const LlamaConfig& config() const { return config_; }
  const nn::ComputeOptions& options() const { return options_; }
  nn::ParameterStore& params() { return params_; }
  const nn::ParameterStore& params() const { return params_; }

  // One micro-batch: forward, loss, backward. Gradients accumulate (+=) into params().grads(); the
  // gradient is that of grad_scale * (sum of per-token losses). ids, targets: [batch, seq]; a negative
  // target is ignored.
  // Under tensor parallelism every rank of the group passes the same ids and targets and gets the same
  // loss. last_micro_batch (the last of an optimizer step) finishes the step's gradients: copies held by
  // several tensor-parallel ranks are summed, and grads_ready (if set) is told as each layer's gradients
  // become final, from the end of the parameter buffer backwards, so data-parallel reduction can start.
  LossSum forward_backward(const int32_t* ids, const int32_t* targets, int64_t batch, int64_t seq,
                           float grad_scale, bool last_micro_batch = true);
  // Called with a flat offset into the parameter store: every gradient at or past it is final for the step.
  void set_grads_ready(std::function<void(int64_t)> callback) { grads_ready_ = std::move(callback); }
  int64_t padded_vocab_size() const { return padded_vocab_; }  // vocabulary rows over all tp ranks
  // Loss only (evaluation); keeps no activations.
  LossSum forward_loss(const int32_t* ids, const int32_t* targets, int64_t batch, int64_t seq);
  // Full logits [batch * seq, vocab] (tests, generation), on the host whatever the model's device.
  Tensor logits(const int32_t* ids, int64_t batch, int64_t seq);

  // A KV cache for `batch` sequences of up to `capacity` positions (0 = max_position_embeddings, which also
  // bounds it), allocated once.
  KvCache make_cache(int64_t batch, int64_t capacity = 0) const;
  // Inference: runs `new_tokens` tokens per sequence (ids [batch, new_tokens]) at positions cache.length() ..
  // cache.length() + new_tokens - 1 (many at once to prefill a prompt, one per step to decode), appends
  // their keys and values to the cache and returns the logits of each sequence's last new token
  // [batch, vocab], or with all_logits those of every new token [batch * new_tokens, vocab]. Passing the
  // cache's capacity or max_position_embeddings is an error that leaves the cache unchanged.
  Tensor forward_cached(const int32_t* ids, int64_t batch, int64_t new_tokens, KvCache& cache,
                        bool all_logits = false);

  // Module access for tests of the backward split.
  const std::vector<nn::TransformerLayer>& layers() const { return layers_; }
  Tensor embed(const int32_t* ids, int64_t rows) const;  // host ids

 private:
  Tensor final_hidden(const int32_t* ids, int64_t batch, int64_t seq, std::vector<nn::TransformerLayer::Saved>* saved,
                      nn::RmsNorm::Saved* norm_saved);
  void check_inputs(const int32_t* ids, const int32_t* targets, int64_t batch, int64_t seq) const;
  Tensor head_weight_gemm() const;
  Tensor project_logits(const Tensor& hidden) const;  // hidden [rows, hidden] -> logits [rows, vocab]
  // targets: the host array; device_targets: the same on the model's device.
  LossSum loss_head(const Tensor& hidden, const int32_t* targets, const int32_t* device_targets, float grad_scale,
                    Tensor* dhidden);
  void notify_ready(int param_id) const;
  nn::TensorParallel* tp() const;  // null unless split over more than one rank

  LlamaConfig config_;
  nn::ComputeOptions options_;
  nn::ParameterStore params_;
  nn::RopeTable rope_;
  int embed_id_ = -1, norm_id_ = -1, head_id_ = -1;
  int64_t padded_vocab_ = 0, vocab_start_ = 0, local_vocab_ = 0;
  std::function<void(int64_t)> grads_ready_;
  nn::Embedding embedding_;
  std::vector<nn::TransformerLayer> layers_;
  nn::RmsNorm final_norm_;
};

}  // namespace forge
