// Mistral (Hugging Face MistralForCausalLM): a LLaMA-family decoder whose attention may look back over a
// sliding window only (sliding_window: each query sees its `sliding_window` latest keys, itself included;
// null for full causal attention), on the one decoder stack. This folder holds what is Mistral's own: the
// config.json reader with Hugging Face's MistralConfig defaults. The tensor names, FLOPs and layer spec are
// the LLaMA's with the window (LlamaConfig::attention_window), so the model is a LlamaModel.
//
// Alternating window and full layers (layer_types, transformers' Ministral) are refused in one line.
#pragma once

#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>

#include "forge/models/llama/llama_config.h"

namespace forge::models {

struct MistralConfig final : LlamaConfig {
  std::unique_ptr<ModelConfig> clone() const override { return std::make_unique<MistralConfig>(*this); }
  std::string architecture() const override { return "MistralForCausalLM"; }
  // HF-compatible: from_json(to_json()) round-trips, and transformers reads it as MistralForCausalLM.
  nlohmann::json to_json() const override;
  // Strict like LlamaConfig::from_json; what the file leaves out takes Hugging Face's MistralConfig default
  // (sliding_window 4096 when the key is absent; null turns the window off).
  static MistralConfig from_json(const nlohmann::json& json, std::string_view source_name);
};

// The registry's entry for MistralForCausalLM.
ModelFamily mistral_family();

}  // namespace forge::models
