// Gemma 2 and Gemma 3 (Hugging Face Gemma2ForCausalLM and Gemma3ForCausalLM, text), on the one decoder stack.
// What differs from a LLaMA is data in the stack's spec: RMSNorms that scale by 1 + w (weights stored as w,
// starting at zero), embeddings multiplied by sqrt(hidden_size), a GeGLU MLP (the tanh GELU), sandwich norms
// (input, post-attention, pre- and post-feed-forward), attention scaled by query_pre_attn_scalar^-1/2,
// layers alternating between a sliding window and full attention (layer_types), and per generation:
//   Gemma 2: attention and final logit soft-capping (attn_logit_softcapping, final_logit_softcapping);
//   Gemma 3: QK-norm, and a RoPE base of its own for the sliding-window layers (rope_parameters'
//            sliding_attention, or rope_local_base_freq), the global layers' optionally scaled linearly.
// This folder holds the config reader with Hugging Face's defaults, the tensor names, the parameter count
// and the spec. Bidirectional attention (use_bidirectional_attention, Gemma 3's embedding variants) is
// refused in one line. Runs on CPUs; the CUDA kernels refuse the GeGLU gate, the 1 + w norms and
// soft-capping. Unlike transformers, forge gives the pad token's embedding row (pad_token_id, 0 in Gemma's
// configs) the gradient of its lookups: transformers' nn.Embedding(padding_idx) keeps it out. Batches that
// mask their padding from the loss still differ there, in that one row.
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "forge/models/decoder_stack.h"
#include "forge/models/llama/llama_config.h"

namespace forge::models {

struct GemmaConfig : LlamaConfig {
  int generation = 2;                  // 2 or 3
  double query_pre_attn_scalar = 256;  // attention scale = this^-1/2
  double attn_logit_softcapping = 0;   // 0: none (Gemma 3)
  double final_logit_softcapping = 0;  // 0: none (Gemma 3)
  int64_t sliding_window = 4096;       // keys a sliding layer's query sees, itself included
  std::vector<bool> sliding_layers;    // per layer: layer_types[i] == "sliding_attention"
  // Gemma 3's sliding layers: their own RoPE base and scaling (the global layers' are rope_theta and
  // rope_scaling).
  double local_rope_theta = 10000.0;
  RopeScaling local_rope_scaling;

  std::string model_type() const { return generation == 2 ? "gemma2" : "gemma3_text"; }
  nlohmann::json to_json() const override;
  void validate(std::string_view source_name) const;
  int64_t num_parameters() const override;  // four norms per layer (and Gemma 3's QK-norms)
  std::vector<std::pair<std::string, Shape>> tensor_shapes() const override;

 protected:
  // Reads a Gemma config.json of `generation` (2 or 3) with Hugging Face's defaults for that generation.
  static void read(GemmaConfig& c, const nlohmann::json& json, std::string_view source, int generation);
};

struct Gemma2Config final : GemmaConfig {
  Gemma2Config() { generation = 2; }
  std::unique_ptr<ModelConfig> clone() const override { return std::make_unique<Gemma2Config>(*this); }
  std::string architecture() const override { return "Gemma2ForCausalLM"; }
  static Gemma2Config from_json(const nlohmann::json& json, std::string_view source_name);
};

struct Gemma3Config final : GemmaConfig {
  Gemma3Config() { generation = 3, qk_norm = true; }
  std::unique_ptr<ModelConfig> clone() const override { return std::make_unique<Gemma3Config>(*this); }
  std::string architecture() const override { return "Gemma3ForCausalLM"; }
  static Gemma3Config from_json(const nlohmann::json& json, std::string_view source_name);
};

// The stack's description of a Gemma (validates the config first).
DecoderSpec gemma_spec(const GemmaConfig& config);

class GemmaModel final : public DecoderStack {
 public:
  GemmaModel(const GemmaConfig& config, nn::ComputeOptions options, float init_std = 0.02f,
             bool with_grads = true, StageSpec stage = StageSpec::whole(), ParameterStore* into = nullptr);
};

// The registry's entries for Gemma2ForCausalLM and Gemma3ForCausalLM.
ModelFamily gemma2_family();
ModelFamily gemma3_family();

}  // namespace forge::models
