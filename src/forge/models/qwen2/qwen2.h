// Qwen2 and Qwen2.5 (Hugging Face Qwen2ForCausalLM): a LLaMA-family decoder with biases on the q, k and v
// projections, on the one decoder stack. This folder holds what is Qwen2's own: the config.json reader with
// Hugging Face's Qwen2Config defaults. The tensor names, FLOPs and layer spec are the LLaMA's with the biases
// (LlamaConfig::qkv_bias), so the model is a LlamaModel.
//
// Sliding-window attention (use_sliding_window, off in every released Qwen2 and Qwen2.5 config) is not
// implemented: a config that turns it on is refused in one line.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>

#include "forge/models/llama/llama_config.h"

namespace forge::models {

struct Qwen2Config final : LlamaConfig {
  // Kept for a faithful round trip; they matter only with sliding windows on.
  int64_t sliding_window = 4096, max_window_layers = 28;

  Qwen2Config() { qkv_bias = true; }
  std::unique_ptr<ModelConfig> clone() const override { return std::make_unique<Qwen2Config>(*this); }
  std::string architecture() const override { return "Qwen2ForCausalLM"; }
  // HF-compatible: from_json(to_json()) round-trips, and transformers reads it as Qwen2ForCausalLM.
  nlohmann::json to_json() const override;
  // Strict like LlamaConfig::from_json; what the file leaves out takes Hugging Face's Qwen2Config default.
  static Qwen2Config from_json(const nlohmann::json& json, std::string_view source_name);
};

// Refuses, in one line naming the key, a config.json whose use_sliding_window is true or whose layer_types
// holds anything but "full_attention" (Qwen2 and Qwen3 configs carry these keys).
void require_full_attention(const nlohmann::json& json, std::string_view source_name,
                            std::string_view family);

// The registry's entry for Qwen2ForCausalLM.
ModelFamily qwen2_family();

}  // namespace forge::models
