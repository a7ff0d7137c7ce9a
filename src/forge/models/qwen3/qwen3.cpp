#include "forge/models/qwen3/qwen3.h"

#include <nlohmann/json.hpp>

#include "forge/core/error.h"
#include "forge/models/config_json.h"
#include "forge/models/llama/llama_model.h"
#include "forge/models/qwen2/qwen2.h"

namespace forge::models {
namespace {
using nlohmann::json;
using namespace config_json;

// Hugging Face's Qwen3Config defaults for the keys a file may leave out. Unlike LLaMA's, head_dim is 128
// whatever hidden_size / num_attention_heads is, and num_key_value_heads is 32, not the heads.
const json kDefaults = {{"vocab_size", 151936},
                        {"hidden_size", 4096},
                        {"intermediate_size", 22016},
                        {"num_hidden_layers", 32},
                        {"num_attention_heads", 32},
                        {"num_key_value_heads", 32},
                        {"head_dim", 128},
                        {"max_position_embeddings", 32768}};
}  // namespace

Qwen3Config Qwen3Config::from_json(const json& j, std::string_view source) {
  Qwen3Config c;
  static_cast<LlamaConfig&>(c) = LlamaConfig::from_family_json(
      j, source, "qwen3",
      {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types", "attention_bias"},
      kDefaults);
  require_full_attention(j, source, "Qwen3");
  // Without use_sliding_window, transformers ignores sliding_window (and writes null); it must still be a
  // size.
  if (auto window = read_integer(j, "sliding_window", source))
    require_positive(*window, "sliding_window", source);
  c.max_window_layers = read_integer(j, "max_window_layers", source).value_or(c.max_window_layers);
  // attention_bias would put biases on q, k, v and o alike; no released Qwen3 has them.
  if (read_bool(j, "attention_bias", source).value_or(false))
    fail("{}: key 'attention_bias' is true, but forge's Qwen3 has no attention biases (must be false)",
         source);
  c.qk_norm = true;
  c.validate(source);
  return c;
}

json Qwen3Config::to_json() const {
  json j = family_json("Qwen3ForCausalLM", "qwen3");
  j["attention_bias"] = false;  // Qwen3Config's own key (q, k, v and o alike)
  j["use_sliding_window"] = false, j["sliding_window"] = nullptr;
  j["max_window_layers"] = max_window_layers;
  return j;
}

ModelFamily qwen3_family() { return family_entry<Qwen3Config, LlamaModel>("Qwen3ForCausalLM", "qwen3"); }

}  // namespace forge::models
