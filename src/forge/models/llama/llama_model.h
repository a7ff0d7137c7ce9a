// LlamaModel: a stage of a LLaMA-family decoder (Hugging Face LlamaForCausalLM semantics): decoder layers
// of grouped-query attention and SwiGLU (nn/ parts), with the embedding on the first stage and the final
// norm and fused loss head on the last, its parameters under their Hugging Face names in one ParameterStore.
// It implements the stage interface of models/model.h; the whole model is the one-stage case, and only that
// one runs inference (forward_cached over a KvCache: a prompt at once, then one token per step).
// ComputeOptions::device places the parameters, every activation and the KV cache on a device; ids and
// targets are host arrays in every case, and losses and logits come back to the host.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "forge/models/llama/llama_config.h"
#include "forge/models/model.h"
#include "forge/nn/attention.h"
#include "forge/nn/decoder_layer.h"
#include "forge/nn/embedding.h"
#include "forge/nn/loss_head.h"
#include "forge/nn/mlp.h"
#include "forge/nn/rmsnorm.h"

namespace forge::models {

using nn::KvCache;

class LlamaModel final : public Model {
 public:
  // Registers and allocates the stage's parameters; they start at zero until initialize() or a load.
  // with_grads = false builds an inference model (no gradient buffers; backward is refused). into: see
  // models::build_model (the parameters go into a store shared with other chunks, allocated by the caller).
  // name_prefix: before every parameter's Hugging Face name (a LLaVA's language model is "language_model.").
  LlamaModel(const LlamaConfig& config, nn::ComputeOptions options, float init_std = 0.02f,
             bool with_grads = true, StageSpec stage = StageSpec::whole(), ParameterStore* into = nullptr,
             std::string name_prefix = "");
  LlamaModel(const LlamaModel&) = delete;
  LlamaModel& operator=(const LlamaModel&) = delete;

  const LlamaConfig& config() const override { return config_; }
  const StageSpec& stage() const override { return stage_; }
  const nn::ComputeOptions& options() const override { return options_; }
  ParameterStore& params() override { return params_; }
  const ParameterStore& params() const override { return params_; }
  int64_t padded_vocab_size() const { return padded_vocab_; }  // vocabulary rows over all tp ranks

  StageOutput forward(const MicroBatch& mb, const Tensor& hidden,
                      std::unique_ptr<StageActivations>* saved) override;
  Tensor backward_input(const Tensor& doutput, StageActivations& saved) override;
  void backward_weight(StageActivations& saved) override;
  Tensor backward(const Tensor& doutput, StageActivations& saved) override;

  Tensor logits(const int32_t* ids, int64_t batch, int64_t seq) override;
  KvCache make_cache(int64_t batch, int64_t capacity = 0) const override;
  Tensor forward_cached(const int32_t* ids, int64_t batch, int64_t new_tokens, KvCache& cache,
                        bool all_logits = false) override;
  using Model::forward_cached_images;

  // ---- Embeddings inserted in place of a token's (a LLaVA's image features; models/llava/). The rows of
  // `inserted` [count, hidden] (on the model's device) replace, in order, the embeddings of the micro-batch's
  // tokens equal to `token`: forward_inserted is forward with that splice (first stage only), and after
  // backward_input (or backward) inserted_gradient hands over the gradient of those rows [count, hidden],
  // which then take no part in the embedding's own gradient. Under sequence parallelism each rank holds the
  // gradient of its own rows only (zero elsewhere): the caller sums it over the tensor-parallel group.
  StageOutput forward_inserted(const MicroBatch& mb, int32_t token, const Tensor& inserted,
                               std::unique_ptr<StageActivations>* saved);
  Tensor inserted_gradient(StageActivations& saved) const;
  // Full logits [batch * seq, vocab] on the host with the splice (the whole model only).
  Tensor logits_inserted(const int32_t* ids, int64_t batch, int64_t seq, int32_t token,
                         const Tensor& inserted);
  // forward_cached with the splice (inference of a multimodal prompt).
  Tensor forward_cached_inserted(const int32_t* ids, int64_t batch, int64_t new_tokens, KvCache& cache,
                                 int32_t token, const Tensor& inserted);

  // Module access for tests of the backward split.
  const std::vector<nn::DecoderLayer>& layers() const { return layers_; }
  Tensor embed(const int32_t* ids, int64_t rows) const;  // host ids; first stage only

 private:
  struct Activations;
  struct Insertion;
  StageOutput run_forward(const MicroBatch& mb, const Tensor& hidden, const Insertion* insertion,
                          std::unique_ptr<StageActivations>* saved);
  void take_inserted_rows(Activations& acts) const;
  void register_layer(int64_t index, float init_std);
  void register_tensor_parallel_sums();
  void check_inputs(const MicroBatch& mb) const;
  Tensor final_hidden(const int32_t* ids, int64_t batch, int64_t seq, const Insertion* insertion = nullptr);
  Insertion make_insertion(const MicroBatch& mb, int32_t token, const Tensor& inserted) const;
  void splice(const Insertion* insertion, const Tensor& x) const;
  Tensor run_cached(const int32_t* ids, int64_t batch, int64_t new_tokens, KvCache& cache, bool all_logits,
                    const Insertion* insertion);
  void require_whole(const char* what) const;
  nn::TensorParallel* tp() const;  // null unless split over more than one rank

  LlamaConfig config_;
  std::string prefix_;
  nn::ComputeOptions options_;
  StageSpec stage_;
  ParameterStore own_params_;  // unless built into a shared store
  ParameterStore& params_;
  nn::RopeTable rope_;
  int embed_id_ = -1, norm_id_ = -1, head_id_ = -1;
  int64_t padded_vocab_ = 0, vocab_start_ = 0, local_vocab_ = 0;
  nn::Embedding embedding_;
  // Per local layer: the parameter ids registered for it.
  struct LayerIds {
    int norm1 = -1, norm2 = -1;
    nn::AttentionParams attention;
    nn::MlpParams mlp;
  };
  std::vector<LayerIds> layer_ids_;
  std::vector<nn::DecoderLayer> layers_;
  nn::RmsNorm final_norm_;
  nn::LossHead head_;
};

// The registry's entry for LlamaForCausalLM.
ModelFamily llama_family();

}  // namespace forge::models
