// Mixtral (Hugging Face MixtralForCausalLM): a Mistral decoder whose feed-forward is a sparse mixture of
// experts: a router (block_sparse_moe.gate) scores every token against num_local_experts SwiGLU experts
// (experts.<e>.w1 gate, w3 up, w2 down, each intermediate_size wide) with a softmax, keeps the top
// num_experts_per_tok and renormalises their weights to sum to one. On the one decoder stack: the attention
// is the LLaMA's (with Mistral's optional sliding window), every layer's feed-forward the stack's MoE with
// softmax scores, normalised top-k, no shared experts and no correction bias, under Mixtral's names.
//
// With output_router_logits = true, training adds Hugging Face's load-balancing loss: router_aux_loss_coef
// times one loss over every layer's router logits at once (nn::MoeRouterAux; transformers'
// load_balancing_loss_func), as MixtralForCausalLM adds it to its loss, under every layout (pipeline stages
// hand on their layers' routing); it replaces forge's classic moe.aux_loss_coeff (not both).
// router_jitter_noise other than 0 is refused.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "forge/models/decoder_stack.h"
#include "forge/models/llama/llama_config.h"

namespace forge::models {

struct MixtralConfig final : LlamaConfig {
  int64_t num_local_experts = 8;
  int64_t num_experts_per_tok = 2;
  bool output_router_logits = false;
  double router_aux_loss_coef = 0.001;  // used with output_router_logits, kept for a faithful round trip

  std::unique_ptr<ModelConfig> clone() const override { return std::make_unique<MixtralConfig>(*this); }
  std::string architecture() const override { return "MixtralForCausalLM"; }
  // HF-compatible: from_json(to_json()) round-trips, and transformers reads it as MixtralForCausalLM.
  nlohmann::json to_json() const override;
  // Strict like LlamaConfig::from_json; what the file leaves out takes Hugging Face's MixtralConfig default.
  static MixtralConfig from_json(const nlohmann::json& json, std::string_view source_name);
  std::vector<std::pair<std::string, Shape>> tensor_shapes() const override;
  int64_t routed_experts() const override { return num_local_experts; }
  double training_router_aux_loss_coef() const override {
    return output_router_logits ? router_aux_loss_coef : 0;
  }
  // Every expert's weights and the router (the parameter count); the FLOPs count the experts a token runs.
  int64_t matmul_parameters_per_layer() const override;
  // Model FLOPs per trained token: LLaMA's accounting with num_experts_per_tok experts and the router per
  // layer.
  double flops_per_token(int64_t seq_len) const override;
};

class MixtralModel final : public DecoderStack {
 public:
  MixtralModel(const MixtralConfig& config, nn::ComputeOptions options, float init_std = 0.02f,
               bool with_grads = true, StageSpec stage = StageSpec::whole(), ParameterStore* into = nullptr);
};

// The registry's entry for MixtralForCausalLM.
ModelFamily mixtral_family();

}  // namespace forge::models
