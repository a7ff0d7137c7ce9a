#include "forge/models/mistral/mistral.h"

#include <nlohmann/json.hpp>

#include "forge/core/error.h"
#include "forge/models/config_json.h"
#include "forge/models/llama/llama_model.h"

namespace forge::models {
namespace {
using nlohmann::json;
using namespace config_json;

// Hugging Face's MistralConfig defaults (Mistral-7B's shape) for the keys a file may leave out; head_dim
// defaults to hidden_size / num_attention_heads as in LLaMA's reader.
const json kDefaults = {{"vocab_size", 32000},
                        {"hidden_size", 4096},
                        {"intermediate_size", 14336},
                        {"num_hidden_layers", 32},
                        {"num_attention_heads", 32},
                        {"num_key_value_heads", 8},
                        {"max_position_embeddings", 131072}};
constexpr int64_t kDefaultWindow = 4096;
}  // namespace

MistralConfig MistralConfig::from_json(const json& j, std::string_view source) {
  MistralConfig c;
  static_cast<LlamaConfig&>(c) =
      LlamaConfig::from_family_json(j, source, "mistral", {"sliding_window", "layer_types"}, kDefaults);
  if (j.contains("layer_types") && !j["layer_types"].is_null())
    fail(
        "{}: key 'layer_types' is not a MistralForCausalLM key (alternating window and full layers are "
        "transformers' Ministral, which forge does not implement)",
        source);
  // Absent: HF's default window; null: full causal attention.
  if (!j.contains("sliding_window")) {
    c.attention_window = kDefaultWindow;
  } else if (auto window = read_integer(j, "sliding_window", source)) {
    if (*window <= 0) fail("{}: key 'sliding_window' must be positive or null, got {}", source, *window);
    c.attention_window = *window;
  }
  c.validate(source);
  return c;
}

json MistralConfig::to_json() const {
  json j = family_json("MistralForCausalLM", "mistral");
  j["sliding_window"] = attention_window > 0 ? json(attention_window) : json(nullptr);
  return j;
}

ModelFamily mistral_family() {
  return family_entry<MistralConfig, LlamaModel>("MistralForCausalLM", "mistral");
}

}  // namespace forge::models
