// LlamaConfig: the architecture of a LLaMA-family model, read from a Hugging Face config.json.
//
// Reading is strict: a key forge does not understand is an error (a typo must not silently train a
// different model), except the HF bookkeeping keys listed in llama_config.cpp (kIgnoredKeys) that do not
// change the computation forge performs. Keys that would change it (hidden_act, attention_bias,
// mlp_bias, attention_dropout) are accepted only with the value forge implements.
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "forge/kernels/rope_tables.h"
#include "forge/models/model.h"

namespace forge::models {

struct LlamaConfig : ModelConfig {
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_key_value_heads = 0;  // from_json: defaults to num_attention_heads
  int64_t head_dim = 0;             // from_json: defaults to hidden_size / num_attention_heads
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeScaling rope_scaling;
  int64_t vocab_size = 0;
  bool tie_word_embeddings = false;
  int64_t max_position_embeddings = 2048;
  // Biases on the q, k and v projections: never in a LLaMA (attention_bias must be false), always in a Qwen2
  // (models/qwen2/, whose config derives from this one).
  bool qkv_bias = false;
  // QK-norm (Qwen3, models/qwen3/): an RMSNorm over head_dim on every q and k head before RoPE, with weights
  // self_attn.{q,k}_norm.weight [head_dim]. Never in a LLaMA.
  bool qk_norm = false;
  // Sliding-window attention (Mistral, models/mistral/): > 0, each query sees the `sliding_window` latest
  // keys, itself included (its config.json key sliding_window); 0 = all earlier keys (every LLaMA).
  int64_t attention_window = 0;
  // Where the config was read from (the config.json path; from_json's source_name), for messages. Not part
  // of the architecture: == ignores it.
  struct Origin {
    std::string name;
    bool operator==(const Origin&) const { return true; }
  };
  Origin origin;

  bool operator==(const LlamaConfig& o) const { return to_json() == o.to_json(); }

  // ModelConfig
  std::unique_ptr<ModelConfig> clone() const override { return std::make_unique<LlamaConfig>(*this); }
  std::string architecture() const override { return "LlamaForCausalLM"; }
  ModelShape shape() const override;
  const std::string& source() const override { return origin.name; }
  std::vector<std::pair<std::string, Shape>> tensor_shapes() const override;

  // Errors are forge::Error with one line "<path>: <what> '<key>'".
  static LlamaConfig from_json_file(const std::filesystem::path& path);
  static LlamaConfig from_json(const nlohmann::json& json, std::string_view source_name);
  // A LLaMA-family config.json (Qwen2, Qwen3, Mistral) read as a LLaMA's: model_type must be `model_type`
  // when given; the family's own keys (`own_keys`, which the family reads itself) and `architectures` are
  // left out; `defaults` (a JSON object) fills the keys the file leaves out or sets to null; the rest is read
  // strictly by from_json.
  static LlamaConfig from_family_json(const nlohmann::json& json, std::string_view source_name,
                                      std::string_view model_type,
                                      const std::vector<std::string_view>& own_keys,
                                      const nlohmann::json& defaults);
  // HF-compatible: from_json(to_json()) round-trips, and transformers can read it as LlamaForCausalLM.
  nlohmann::json to_json() const override;
  // Checks sizes (each within the bounds of llama_config.cpp, and the parameter count within 2^50, so that
  // no size or product wraps) and divisibility; from_json calls it. Messages start with source_name.
  void validate(std::string_view source_name) const;

  // to_json() under a family's name (Qwen2, Qwen3, Mistral): `architectures` and `model_type` set, LLaMA's
  // bias keys left out, attention_dropout 0; the family adds its own keys.
  nlohmann::json family_json(std::string_view architecture, std::string_view model_type) const;

  // Host bytes a model of this config holds before its first step: fp32 weights, a bf16 copy of them with
  // bf16_shadow, with `training` fp32 gradients and AdamW's two fp32 moments, and the rotary tables.
  // Call after validate() (which keeps it within int64).
  int64_t memory_bytes(bool training, bool bf16_shadow) const;
  // Refuses, before anything is allocated, a model that needs more than available_bytes:
  // "<source_name>: the model needs 12.3 TiB for its weights, gradients and optimizer state (...); this
  // machine has 24.0 GiB".
  void check_fits_in_memory(bool training, bool bf16_shadow, int64_t available_bytes,
                            std::string_view source_name) const override;

  int64_t q_size() const { return num_attention_heads * head_dim; }
  int64_t kv_size() const { return num_key_value_heads * head_dim; }
  // Weights of the q, k, v, o and gate, up, down projections of one layer (a family with another MLP
  // overrides it, and the FLOPs and parameter count follow).
  virtual int64_t matmul_parameters_per_layer() const;
  // The q, k and v biases and the QK-norm weights of one layer (0 without them); a family's other biases.
  virtual int64_t bias_parameters_per_layer() const {
    return (qkv_bias ? q_size() + 2 * kv_size() : 0) + (qk_norm ? 2 * head_dim : 0);
  }
  // All trainable parameters (embedding, layers with their norms, final norm, lm_head unless tied).
  int64_t num_parameters() const override;
  // Model FLOPs per trained token (forward + backward), Megatron's accounting:
  //   6 * (matmul parameters of all layers + lm_head) + 12 * layers * seq_len * (heads * head_dim).
  // The embedding lookup does no matmul; the lm_head matmul is counted even when tied. The attention
  // term (QK^T and PV, 2 FLOPs per multiply-add, x3 for backward) is NOT halved for the causal mask,
  // matching Megatron and PaLM's MFU definition, so MFU is comparable with their published numbers.
  double flops_per_token(int64_t seq_len) const override;
  // One forward's FLOPs per token in the weight matmuls (layers and loss head): 2 per matmul parameter.
  double matmul_flops_per_token() const;
};

}  // namespace forge::models
