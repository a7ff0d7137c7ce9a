// LlamaModel: a stage of a LLaMA-family decoder (Hugging Face LlamaForCausalLM semantics) on the one decoder
// stack (models/decoder_stack.h): every layer grouped-query attention and a SwiGLU MLP, pre-norm. What is
// LLaMA's is the spec (llama_spec), the config reader, the tensor names and the FLOPs (llama_config.h).
// ComputeOptions::device places the parameters, every activation and the KV cache on a device; ids and
// targets are host arrays in every case, and losses and logits come back to the host.
#pragma once

#include <string>

#include "forge/models/decoder_stack.h"
#include "forge/models/llama/llama_config.h"

namespace forge::models {

using nn::KvCache;

// The stack's description of a LLaMA-family model (validates the config first; messages name its source).
DecoderSpec llama_spec(const LlamaConfig& config);

class LlamaModel final : public DecoderStack {
 public:
  // name_prefix: before every parameter's Hugging Face name (a LLaVA's language model is "language_model.").
  LlamaModel(const LlamaConfig& config, nn::ComputeOptions options, float init_std = 0.02f,
             bool with_grads = true, StageSpec stage = StageSpec::whole(), ParameterStore* into = nullptr,
             std::string name_prefix = "");

  const LlamaConfig& config() const override {
    return static_cast<const LlamaConfig&>(DecoderStack::config());
  }
};

// The registry's entry for LlamaForCausalLM.
ModelFamily llama_family();

}  // namespace forge::models
