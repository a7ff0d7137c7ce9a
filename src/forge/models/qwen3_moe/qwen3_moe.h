// Qwen3-MoE (Hugging Face Qwen3MoeForCausalLM): Qwen3's attention (QK-norm, no biases) with sparse
// mixture-of-experts feed-forwards: in layer i unless i is in mlp_only_layers or (i + 1) is not a multiple of
// decoder_sparse_step, a router (mlp.gate) scores every token against num_experts SwiGLU experts
// (mlp.experts.<e>.gate_proj, up_proj, down_proj, each moe_intermediate_size wide) with a softmax and keeps
// the top num_experts_per_tok, renormalised to sum to one when norm_topk_prob; the other layers have
// Qwen3's dense MLP (intermediate_size). On the one decoder stack, on the MoE layer DeepSeek-V3 uses (no
// shared experts, no correction bias).
//
// With output_router_logits = true, training adds Hugging Face's load-balancing loss over every MoE layer's
// router logits at once (Mixtral's, nn::MoeRouterAux). Sliding-window layers (use_sliding_window) and
// attention_bias = true are refused in one line.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "forge/models/decoder_stack.h"
#include "forge/models/llama/llama_config.h"

namespace forge::models {

struct Qwen3MoeConfig final : LlamaConfig {
  int64_t num_experts = 128;
  int64_t num_experts_per_tok = 8;
  int64_t moe_intermediate_size = 768;
  int64_t decoder_sparse_step = 1;
  std::vector<int64_t> mlp_only_layers;
  bool norm_topk_prob = false;
  bool output_router_logits = false;
  double router_aux_loss_coef = 0.001;       // used with output_router_logits, kept for a faithful round trip
  std::optional<int64_t> max_window_layers;  // the same (sliding windows are off)
  std::optional<int64_t> sliding_window;     // the same (null: transformers writes none without windows)

  Qwen3MoeConfig() { qk_norm = true; }
  std::unique_ptr<ModelConfig> clone() const override { return std::make_unique<Qwen3MoeConfig>(*this); }
  std::string architecture() const override { return "Qwen3MoeForCausalLM"; }
  // HF-compatible: from_json(to_json()) round-trips, and transformers reads it as Qwen3MoeForCausalLM.
  nlohmann::json to_json() const override;
  // Strict like LlamaConfig::from_json; what the file leaves out takes Hugging Face's Qwen3MoeConfig default.
  static Qwen3MoeConfig from_json(const nlohmann::json& json, std::string_view source_name);
  // Whether layer `index` is a MoE layer (Hugging Face's rule).
  bool is_moe_layer(int64_t index) const;
  std::vector<std::pair<std::string, Shape>> tensor_shapes() const override;
  int64_t routed_experts() const override { return num_experts; }
  double training_router_aux_loss_coef() const override {
    return output_router_logits ? router_aux_loss_coef : 0;
  }
  int64_t num_parameters() const override;
  // LLaMA's accounting with the experts a token takes (and the router) in the MoE layers.
  double flops_per_token(int64_t seq_len) const override;
};

class Qwen3MoeModel final : public DecoderStack {
 public:
  Qwen3MoeModel(const Qwen3MoeConfig& config, nn::ComputeOptions options, float init_std = 0.02f,
                bool with_grads = true, StageSpec stage = StageSpec::whole(), ParameterStore* into = nullptr);
};

// The registry's entry for Qwen3MoeForCausalLM.
ModelFamily qwen3_moe_family();

}  // namespace forge::models
