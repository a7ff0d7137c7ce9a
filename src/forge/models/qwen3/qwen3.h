// Qwen3 (Hugging Face Qwen3ForCausalLM): a LLaMA-family decoder with QK-norm (an RMSNorm over head_dim on
// every q and k head before RoPE) and no biases, on the one decoder stack. This folder holds what is Qwen3's
// own: the config.json reader with Hugging Face's Qwen3Config defaults (head_dim 128 whatever the hidden
// size). The tensor names, FLOPs and layer spec are the LLaMA's with the QK-norm
// (LlamaConfig::qk_norm), so the model is a LlamaModel.
//
// Sliding-window layers (use_sliding_window, off in every released Qwen3 config) and attention_bias = true
// are refused in one line.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>

#include "forge/models/llama/llama_config.h"

namespace forge::models {

struct Qwen3Config final : LlamaConfig {
  int64_t max_window_layers = 28;  // kept for a faithful round trip; it matters only with sliding windows on

  Qwen3Config() { qk_norm = true; }
  std::unique_ptr<ModelConfig> clone() const override { return std::make_unique<Qwen3Config>(*this); }
  std::string architecture() const override { return "Qwen3ForCausalLM"; }
  // HF-compatible: from_json(to_json()) round-trips, and transformers reads it as Qwen3ForCausalLM.
  nlohmann::json to_json() const override;
  // Strict like LlamaConfig::from_json; what the file leaves out takes Hugging Face's Qwen3Config default.
  static Qwen3Config from_json(const nlohmann::json& json, std::string_view source_name);
};

// The registry's entry for Qwen3ForCausalLM.
ModelFamily qwen3_family();

}  // namespace forge::models
