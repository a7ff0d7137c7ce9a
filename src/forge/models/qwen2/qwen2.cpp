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
// (1e-6), rope_theta (1e4) and tie_word_embeddings (false) default as in LlamaConfig's reader.
const std::pair<const char*, json> kDefaults[] = {
    {"vocab_size", 151936},    {"hidden_size", 4096},       {"intermediate_size", 22016},
    {"num_hidden_layers", 32}, {"num_attention_heads", 32}, {"max_position_embeddings", 32768}};
}  // namespace

Qwen2Config Qwen2Config::from_json(const json& j, std::string_view source) {
  if (!j.is_object()) fail("{}: expected a JSON object at the top level, got {}", source, j.type_name());
  if (auto t = read_string(j, "model_type", source); t && *t != "qwen2")
    fail("{}: key 'model_type' is \"{}\", not \"qwen2\"", source, *t);
  Qwen2Config c;
  if (read_bool(j, "use_sliding_window", source).value_or(false))
    fail("{}: key 'use_sliding_window' is true, but forge's Qwen2 implements full attention only", source);
  c.sliding_window = read_integer(j, "sliding_window", source).value_or(c.sliding_window);
  c.max_window_layers = read_integer(j, "max_window_layers", source).value_or(c.max_window_layers);
  if (auto types = j.find("layer_types"); types != j.end() && !types->is_null()) {
    if (!types->is_array()) fail("{}: key 'layer_types' must be a list, got {}", source, types->type_name());
    for (const json& type : *types)
      if (type != "full_attention")
        fail("{}: key 'layer_types' holds {}, but forge's Qwen2 implements \"full_attention\" only", source,
             type.dump());
  }
  // The rest is a LLaMA's config: read strictly by its reader, Qwen2's defaults filled in first.
  json llama = json::object();
  for (const auto& [key, value] : j.items())
    if (key != "use_sliding_window" && key != "sliding_window" && key != "max_window_layers" &&
        key != "layer_types" && key != "model_type" && key != "architectures")
      llama[key] = value;
  for (const auto& [key, value] : kDefaults)
    if (!llama.contains(key) || llama[key].is_null()) llama[key] = value;
  // Qwen2Config's num_key_value_heads defaults to 32, not to the heads; a file without it means 32.
  if (!llama.contains("num_key_value_heads") || llama["num_key_value_heads"].is_null())
    llama["num_key_value_heads"] = 32;
  static_cast<LlamaConfig&>(c) = LlamaConfig::from_json(llama, source);
  c.qkv_bias = true;
  c.validate(source);
  return c;
}

json Qwen2Config::to_json() const {
  json j = LlamaConfig::to_json();
  j["architectures"] = json::array({"Qwen2ForCausalLM"});
  j["model_type"] = "qwen2";
  j.erase("attention_bias");
  j.erase("mlp_bias");
  j["use_sliding_window"] = false;
  j["sliding_window"] = sliding_window;
  j["max_window_layers"] = max_window_layers;
  j["attention_dropout"] = 0.0;
  return j;
}

ModelFamily qwen2_family() { return family_entry<Qwen2Config, LlamaModel>("Qwen2ForCausalLM", "qwen2"); }

}  // namespace forge::models
