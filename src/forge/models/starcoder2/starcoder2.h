// StarCoder2 (Hugging Face Starcoder2ForCausalLM), on the one decoder stack: a LLaMA-shaped decoder (GQA,
// RoPE, pre-norm, an optional sliding window) with GPT-style parts, which the stack's spec names:
// LayerNorms with biases (input_layernorm, post_attention_layernorm, model.norm; eps norm_epsilon), an
// ungated MLP c_proj(gelu(c_fc(x))) (hidden_act, the tanh GELU in every release), and with use_bias a bias
// on every projection (q, k, v, o, c_fc, c_proj). This folder holds the config reader with Hugging Face's
// defaults, the tensor names, the parameter count and FLOPs, and the spec.
//
// Dropout: a config's attention_dropout, residual_dropout and embedding_dropout (0.1 in the released
// checkpoints' configs) are kept for the round trip but not applied; forge's dropout is the run's
// train.hidden_dropout, at the residual and embedding sites (attention dropout is not implemented).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "forge/kernels/ops.h"
#include "forge/models/decoder_stack.h"
#include "forge/models/llama/llama_config.h"

namespace forge::models {

struct Starcoder2Config final : LlamaConfig {
  ops::GeluKind hidden_act = ops::GeluKind::tanh;
  bool use_bias = true;
  double attention_dropout = 0, residual_dropout = 0, embedding_dropout = 0;  // not applied (see above)

  std::unique_ptr<ModelConfig> clone() const override { return std::make_unique<Starcoder2Config>(*this); }
  std::string architecture() const override { return "Starcoder2ForCausalLM"; }
  // HF-compatible: from_json(to_json()) round-trips, and transformers reads it as Starcoder2ForCausalLM.
  nlohmann::json to_json() const override;
  // Strict like LlamaConfig::from_json; what the file leaves out takes Hugging Face's Starcoder2Config
  // default (StarCoder2-3B's shape, tied embeddings, use_bias true, no window).
  static Starcoder2Config from_json(const nlohmann::json& json, std::string_view source_name);
  int64_t matmul_parameters_per_layer() const override;  // q, k, v, o, c_fc, c_proj
  int64_t bias_parameters_per_layer() const override;    // with use_bias: every projection's
  int64_t num_parameters() const override;               // + the LayerNorms' biases
  std::vector<std::pair<std::string, Shape>> tensor_shapes() const override;
};

// The stack's description of a StarCoder2 (validates the config first).
DecoderSpec starcoder2_spec(const Starcoder2Config& config);

class Starcoder2Model final : public DecoderStack {
 public:
  Starcoder2Model(const Starcoder2Config& config, nn::ComputeOptions options, float init_std = 0.02f,
                  bool with_grads = true, StageSpec stage = StageSpec::whole(),
                  ParameterStore* into = nullptr);
};

// The registry's entry for Starcoder2ForCausalLM.
ModelFamily starcoder2_family();

}  // namespace forge::models
