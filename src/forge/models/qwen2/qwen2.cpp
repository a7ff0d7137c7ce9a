#include "forge/models/qwen2/qwen2.h"

#include <nlohmann/json.hpp>
#include <utility>

#include "forge/core/error.h"
#include "forge/models/config_json.h"
#include "forge/models/llama/llama_model.h"

namespace forge::models {
namespace {
using nlohmann::json;
using namespace config_json;

// Hugging Face's Qwen2Config defaults (Qwen2-7B's shape) for the keys a file may leave out. rms_norm_eps
// (1e-6), rope_theta (1e4) and tie_word_embeddings (false) default as in LlamaConfig's reader; Qwen2Config's
// num_key_value_heads defaults to 32, not to the heads.
const json kDefaults = {{"vocab_size", 151936},       {"hidden_size", 4096},
                        {"intermediate_size", 22016}, {"num_hidden_layers", 32},
                        {"num_attention_heads", 32},  {"max_position_embeddings", 32768},
                        {"num_key_value_heads", 32}};
}  // namespace

// Only full attention: every layer's "layer_types" entry must say so (Qwen2 and Qwen3 share this check).
void require_full_attention(const json& j, std::string_view source, std::string_view family) {
  if (read_bool(j, "use_sliding_window", source).value_or(false))
    fail("{}: key 'use_sliding_window' is true, but forge's {} implements full attention only", source,
         family);
  if (auto types = j.find("layer_types"); types != j.end() && !types->is_null()) {
    if (!types->is_array()) fail("{}: key 'layer_types' must be a list, got {}", source, types->type_name());
    for (const json& type : *types)
      if (type != "full_attention")
        fail("{}: key 'layer_types' holds {}, but forge's {} implements \"full_attention\" only", source,
             type.dump(), family);
  }
}

Qwen2Config Qwen2Config::from_json(const json& j, std::string_view source) {
  // A LLaMA's config read strictly by its reader, Qwen2's defaults filled in first; then Qwen2's own keys.
  Qwen2Config c;
  static_cast<LlamaConfig&>(c) = LlamaConfig::from_family_json(
      j, source, "qwen2", {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
      kDefaults);
  require_full_attention(j, source, "Qwen2");
  c.sliding_window = read_integer(j, "sliding_window", source).value_or(c.sliding_window);
  c.max_window_layers = read_integer(j, "max_window_layers", source).value_or(c.max_window_layers);
  c.qkv_bias = true;
  c.validate(source);
  return c;
}

json Qwen2Config::to_json() const {
  json j = family_json("Qwen2ForCausalLM", "qwen2");
  j["use_sliding_window"] = false;
  j["sliding_window"] = sliding_window;
  j["max_window_layers"] = max_window_layers;
  return j;
}

ModelFamily qwen2_family() { return family_entry<Qwen2Config, LlamaModel>("Qwen2ForCausalLM", "qwen2"); }

}  // namespace forge::models
