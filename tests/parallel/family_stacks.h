// The small models the tensor- and context-parallel layout tests split: a LLaMA-family config (with a
// Qwen2's biases, a Qwen3's QK-norm or a Mistral's window) or a Gemma 2 / Gemma 3 of the same sizes (norms
// scaling by 1 + w, GeGLU, sandwich norms, soft caps, alternating window and global layers, Gemma 3's local
// RoPE and QK-norm), built on the one decoder stack.
#pragma once

#include <cmath>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "forge/models/gemma/gemma.h"
#include "forge/models/llama/llama_model.h"

namespace forge::layout_models {

// A Gemma of `generation` (2 or 3) with the layout tests' sizes; its first layer slides over 5 keys.
inline std::unique_ptr<models::GemmaConfig> tiny_gemma(int generation, int64_t kv_heads, int64_t vocab = 61) {
  const nlohmann::json j = {{"hidden_size", 32},
                            {"intermediate_size", 48},
                            {"num_hidden_layers", 2},
                            {"num_attention_heads", 4},
                            {"num_key_value_heads", kv_heads},
                            {"head_dim", 8},
                            {"vocab_size", vocab},
                            {"max_position_embeddings", 64},
                            {"query_pre_attn_scalar", 6},
                            {"sliding_window", 5},
                            {"layer_types", {"sliding_attention", "full_attention"}},
                            {"attn_logit_softcapping", 2.0},
                            {"final_logit_softcapping", 3.0},
                            {"rope_local_base_freq", 100.0}};
  if (generation == 2) {
    nlohmann::json two = j;
    two.erase("rope_local_base_freq");
    return std::make_unique<models::Gemma2Config>(models::Gemma2Config::from_json(two, "tiny"));
  }
  nlohmann::json three = j;
  three.erase("attn_logit_softcapping"), three.erase("final_logit_softcapping");
  return std::make_unique<models::Gemma3Config>(models::Gemma3Config::from_json(three, "tiny"));
}

// The stack of `config`: a GemmaModel for a Gemma's, else a LlamaModel.
inline std::unique_ptr<models::DecoderStack> make_stack(const models::LlamaConfig& config,
                                                        const nn::ComputeOptions& options) {
  if (const auto* gemma = dynamic_cast<const models::GemmaConfig*>(&config))
    return std::make_unique<models::GemmaModel>(*gemma, options);
  return std::make_unique<models::LlamaModel>(config, options);
}

// Gemma's norm weights start at zero (a scale of one): values that depend only on the name and the global
// index, so that 1 + w differs from w and every layout holds the same.
inline void set_gemma_norms(ParameterStore& store) {
  for (int id = 0; id < store.count(); ++id) {
    const ParamInfo& p = store.info(id);
    if (p.shape.size() != 1 || p.name.find("norm") == std::string::npos) continue;
    for (const ShardRun& r : shard_runs(p))
      for (int64_t j = 0; j < r.count; ++j)
        store.param(id).f32()[r.local + j] =
            0.1f * std::sin(0.9f * static_cast<float>(r.global + j) + static_cast<float>(p.name.size()));
  }
  store.refresh_bf16();
}

}  // namespace forge::layout_models
