#include "forge/models/gemma/gemma.h"

#include <cmath>
#include <nlohmann/json.hpp>

#include "forge/core/error.h"
#include "forge/kernels/ops.h"
#include "forge/models/config_json.h"
#include "forge/models/llama/llama_model.h"

namespace forge::models {
namespace {
using nlohmann::json;
using namespace config_json;

// Hugging Face's Gemma2Config and Gemma3TextConfig defaults for the size keys a file may leave out.
const json kGemma2Defaults = {{"vocab_size", 256000},
                              {"hidden_size", 2304},
                              {"intermediate_size", 9216},
                              {"num_hidden_layers", 26},
                              {"num_attention_heads", 8},
                              {"num_key_value_heads", 4},
                              {"head_dim", 256},
                              {"max_position_embeddings", 8192},
                              {"tie_word_embeddings", true},
                              {"rms_norm_eps", 1e-6}};
// Gemma3TextConfig's differ in the vocabulary and the context only.
const json kGemma3Defaults = [] {
  json d = kGemma2Defaults;
  d["vocab_size"] = 262208, d["max_position_embeddings"] = 131072;
  return d;
}();

// Gemma's own keys, read here (the rest go to LLaMA's strict reader). dtype, cache_implementation and
// sliding_window_pattern's underscore form are bookkeeping.
const std::vector<std::string_view> kOwnKeys = {"hidden_activation",
                                                "hidden_act",
                                                "query_pre_attn_scalar",
                                                "sliding_window",
                                                "layer_types",
                                                "final_logit_softcapping",
                                                "attn_logit_softcapping",
                                                "use_bidirectional_attention",
                                                "rope_parameters",
                                                "rope_theta",
                                                "rope_scaling",
                                                "rope_local_base_freq",
                                                "sliding_window_pattern",
                                                "_sliding_window_pattern",
                                                "cache_implementation",
                                                "attention_bias",
                                                "attention_dropout",
                                                "dtype"};

// One RoPE: its base and scaling. Gemma's configs use "default" and "linear" (Gemma 3's global layers).
struct Rope {
  double theta = 10000.0;
  RopeScaling scaling;
};

void read_rope_into(const json& object, std::string_view source, const std::string& prefix, Rope& rope) {
  if (!object.is_object())
    fail("{}: key '{}' must be an object, got {}", source, prefix.substr(0, prefix.size() - 1),
         object.dump());
  std::optional<std::string> type;
  for (const auto& [key, value] : object.items()) {
    if (key == "rope_type" || key == "type") {
      if (!value.is_string())
        fail("{}: key '{}{}' must be a string, got {}", source, prefix, key, value.dump());
      type = value.get<std::string>();
    } else if (key != "rope_theta" && key != "factor") {
      fail("{}: unknown key '{}{}' (forge reads rope_type, rope_theta and factor of a Gemma's RoPE)", source,
           prefix, key);
    }
  }
  if (auto theta = read_number(object, "rope_theta", source, prefix)) rope.theta = *theta;
  if (!type || *type == "default") return;
  if (*type != "linear")
    fail("{}: key '{}rope_type' is \"{}\", but forge implements \"default\" and \"linear\" for Gemma", source,
         prefix, *type);
  rope.scaling.kind = RopeScaling::Kind::linear;
  const auto factor = read_number(object, "factor", source, prefix);
  if (!factor) fail("{}: missing required key '{}factor' for rope_type \"linear\"", source, prefix);
  rope.scaling.factor = *factor;
}

// Gemma 2: rope_parameters (one RoPE) or rope_theta / rope_scaling. Gemma 3: rope_parameters
// {"full_attention": ..., "sliding_attention": ...} or rope_theta / rope_scaling (global) and
// rope_local_base_freq (local). Hugging Face's defaults: 10000 (Gemma 2); 1e6 global, 1e4 local (Gemma 3).
void read_ropes(const json& j, std::string_view source, int generation, Rope& global, Rope& local) {
  global.theta = generation == 2 ? 10000.0 : 1e6;
  local.theta = 10000.0;
  const auto parameters = j.find("rope_parameters");
  if (parameters != j.end() && !parameters->is_null()) {
    if (generation == 2) return read_rope_into(*parameters, source, "rope_parameters.", global);
    if (!parameters->is_object())
      fail("{}: key 'rope_parameters' must be an object, got {}", source, parameters->dump());
    for (const auto& [key, value] : parameters->items()) {
      if (key == "full_attention")
        read_rope_into(value, source, "rope_parameters.full_attention.", global);
      else if (key == "sliding_attention")
        read_rope_into(value, source, "rope_parameters.sliding_attention.", local);
      else
        fail("{}: unknown key 'rope_parameters.{}' (a Gemma 3 names full_attention and sliding_attention)",
             source, key);
    }
    return;
  }
  if (auto theta = read_number(j, "rope_theta", source)) global.theta = *theta;
  if (auto it = j.find("rope_scaling"); it != j.end() && !it->is_null())
    read_rope_into(*it, source, "rope_scaling.", global);
  if (generation == 2 && j.contains("rope_local_base_freq") && !j["rope_local_base_freq"].is_null())
    fail("{}: key 'rope_local_base_freq' is a Gemma 3 key", source);
  if (auto theta = read_number(j, "rope_local_base_freq", source)) local.theta = *theta;
}

// layer_types, or Hugging Face's pattern when absent: Gemma 2 alternates (sliding first), Gemma 3 has every
// sliding_window_pattern-th layer global (default 6).
std::vector<bool> read_layer_types(const json& j, std::string_view source, int generation, int64_t layers) {
  std::vector<bool> sliding(static_cast<size_t>(layers));
  const auto types = j.find("layer_types");
  if (types == j.end() || types->is_null()) {
    int64_t pattern = 2;
    if (generation == 3) {
      pattern = read_integer(j, "sliding_window_pattern", source).value_or(6);
      require_positive(pattern, "sliding_window_pattern", source);
    }
    for (int64_t i = 0; i < layers; ++i) sliding[static_cast<size_t>(i)] = (i + 1) % pattern != 0;
    return sliding;
  }
  if (!types->is_array() || static_cast<int64_t>(types->size()) != layers)
    fail("{}: key 'layer_types' must be a list of num_hidden_layers = {} entries, got {}", source, layers,
         types->dump());
  for (size_t i = 0; i < types->size(); ++i) {
    const json& t = (*types)[i];
    if (t == "sliding_attention")
      sliding[i] = true;
    else if (t != "full_attention")
      fail(
          "{}: key 'layer_types' holds {} at {}; a Gemma's layers are \"sliding_attention\" or "
          "\"full_attention\"",
          source, t.dump(), i);
  }
  return sliding;
}

// A soft cap: absent takes the generation's default, null is none.
double read_softcap(const json& j, const char* key, std::string_view source, double absent) {
  if (!j.contains(key)) return absent;
  const auto value = read_number(j, key, source);
  if (!value) return 0.0;
  require_positive_finite(*value, key, source);
  return *value;
}

json rope_json(const Rope& rope) {
  json r = {{"rope_type", rope.scaling.kind == RopeScaling::Kind::linear ? "linear" : "default"},
            {"rope_theta", rope.theta}};
  if (rope.scaling.kind == RopeScaling::Kind::linear) r["factor"] = rope.scaling.factor;
  return r;
}

json nullable(double value) { return value > 0 ? json(value) : json(nullptr); }

}  // namespace

void GemmaConfig::read(GemmaConfig& c, const json& j, std::string_view source, int generation) {
  static_cast<LlamaConfig&>(c) =
      LlamaConfig::from_family_json(j, source, generation == 2 ? "gemma2" : "gemma3_text", kOwnKeys,
                                    generation == 2 ? kGemma2Defaults : kGemma3Defaults);
  c.generation = generation;
  c.qk_norm = generation == 3;
  for (const char* key : {"hidden_activation", "hidden_act"})
    if (auto act = read_string(j, key, source); act && ops::gelu_kind_from_name(*act) != ops::GeluKind::tanh)
      fail("{}: key '{}' is \"{}\", but forge's Gemma implements the tanh GELU (\"gelu_pytorch_tanh\")",
           source, key, *act);
  if (read_bool(j, "attention_bias", source).value_or(false))
    fail("{}: key 'attention_bias' is true, but forge's Gemma has no attention biases (must be false)",
         source);
  if (auto dropout = read_number(j, "attention_dropout", source); dropout && *dropout != 0.0)
    fail("{}: key 'attention_dropout' is {}, but forge does not implement dropout (must be 0)", source,
         *dropout);
  if (read_bool(j, "use_bidirectional_attention", source).value_or(false))
    fail(
        "{}: key 'use_bidirectional_attention' is true, but forge's Gemma is a causal decoder (must be "
        "false)",
        source);
  c.query_pre_attn_scalar = read_number(j, "query_pre_attn_scalar", source).value_or(256.0);
  c.attn_logit_softcapping = read_softcap(j, "attn_logit_softcapping", source, generation == 2 ? 50.0 : 0.0);
  c.final_logit_softcapping =
      read_softcap(j, "final_logit_softcapping", source, generation == 2 ? 30.0 : 0.0);
  if (!j.contains("sliding_window")) {
    c.sliding_window = 4096;
  } else {
    const auto window = read_integer(j, "sliding_window", source);
    c.sliding_window = window.value_or(0);  // null: the sliding layers see every earlier key
    if (window) require_positive(*window, "sliding_window", source);
  }
  c.sliding_layers = read_layer_types(j, source, generation, c.num_hidden_layers);
  Rope global, local;
  read_ropes(j, source, generation, global, local);
  c.rope_theta = global.theta, c.rope_scaling = global.scaling;
  c.local_rope_theta = local.theta, c.local_rope_scaling = local.scaling;
  c.validate(source);
}

Gemma2Config Gemma2Config::from_json(const json& j, std::string_view source) {
  Gemma2Config c;
  read(c, j, source, 2);
  return c;
}

Gemma3Config Gemma3Config::from_json(const json& j, std::string_view source) {
  Gemma3Config c;
  read(c, j, source, 3);
  return c;
}

void GemmaConfig::validate(std::string_view source) const {
  LlamaConfig::validate(source);
  require_positive_finite(query_pre_attn_scalar, "query_pre_attn_scalar", source);
  if (!(attn_logit_softcapping >= 0 && std::isfinite(attn_logit_softcapping)))
    fail("{}: key 'attn_logit_softcapping' must be positive or null, got {}", source, attn_logit_softcapping);
  if (!(final_logit_softcapping >= 0 && std::isfinite(final_logit_softcapping)))
    fail("{}: key 'final_logit_softcapping' must be positive or null, got {}", source,
         final_logit_softcapping);
  if (sliding_window < 0)
    fail("{}: key 'sliding_window' must be positive or null, got {}", source, sliding_window);
  if (static_cast<int64_t>(sliding_layers.size()) != num_hidden_layers)
    fail("{}: key 'layer_types' has {} entries for {} layers", source, sliding_layers.size(),
         num_hidden_layers);
  require_positive_finite(local_rope_theta, "rope_local_base_freq", source);
  for (const RopeScaling* s : {&rope_scaling, &local_rope_scaling})
    if (s->kind == RopeScaling::Kind::linear)
      require_positive_finite(s->factor, "rope_scaling.factor", source);
}

json GemmaConfig::to_json() const {
  json j = family_json(architecture(), model_type());
  j.erase("rope_theta"), j.erase("rope_scaling"), j.erase("hidden_act");
  j["hidden_activation"] = "gelu_pytorch_tanh";
  j["attention_bias"] = false;
  j["query_pre_attn_scalar"] = query_pre_attn_scalar;
  j["attn_logit_softcapping"] = nullable(attn_logit_softcapping);
  j["final_logit_softcapping"] = nullable(final_logit_softcapping);
  j["sliding_window"] = sliding_window > 0 ? json(sliding_window) : json(nullptr);
  json types = json::array();
  for (bool sliding : sliding_layers) types.push_back(sliding ? "sliding_attention" : "full_attention");
  j["layer_types"] = types;
  const Rope global{rope_theta, rope_scaling}, local{local_rope_theta, local_rope_scaling};
  if (generation == 2)
    j["rope_parameters"] = rope_json(global);
  else
    j["rope_parameters"] = {{"full_attention", rope_json(global)}, {"sliding_attention", rope_json(local)}};
  if (generation == 3) j["use_bidirectional_attention"] = false;
  return j;
}

int64_t GemmaConfig::num_parameters() const {
  return LlamaConfig::num_parameters() + num_hidden_layers * 2 * hidden_size;  // pre/post feed-forward norms
}

// Hugging Face's state_dict names: LLaMA's, with the sandwich norms.
std::vector<std::pair<std::string, Shape>> GemmaConfig::tensor_shapes() const {
  std::vector<std::pair<std::string, Shape>> shapes;
  for (auto& [name, shape] : LlamaConfig::tensor_shapes()) {
    const bool feed_forward_norm = name.ends_with(".post_attention_layernorm.weight");
    if (feed_forward_norm) {  // after the attention in a Gemma, then the norms around the MLP
      shapes.push_back({name, shape});
      const std::string p =
          name.substr(0, name.size() - std::string("post_attention_layernorm.weight").size());
      shapes.push_back({p + "pre_feedforward_layernorm.weight", shape});
      continue;
    }
    shapes.push_back({name, shape});
    if (name.ends_with(".mlp.down_proj.weight")) {
      const std::string p = name.substr(0, name.size() - std::string("mlp.down_proj.weight").size());
      shapes.push_back({p + "post_feedforward_layernorm.weight", {hidden_size}});
    }
  }
  return shapes;
}

DecoderSpec gemma_spec(const GemmaConfig& config) {
  const std::string& source = config.origin.name.empty() ? "model config" : config.origin.name;
  config.validate(source);
  DecoderSpec s = llama_spec(config);  // sizes, the global RoPE table, the cache
  for (size_t i = 0; i < s.layer_specs.size(); ++i) {
    LayerSpec& layer = s.layer_specs[i];
    const bool sliding = config.sliding_layers[i];
    layer.feed_forward = FeedForwardKind::geglu;
    layer.sandwich_norms = true;
    layer.qk_norm = config.qk_norm;
    layer.attention_scale = static_cast<float>(1.0 / std::sqrt(config.query_pre_attn_scalar));
    layer.attention_softcap = static_cast<float>(config.attn_logit_softcapping);
    layer.window = sliding ? config.sliding_window : 0;
    layer.local_rope = config.generation == 3 && sliding;
  }
  s.norm_weight_offset = 1.0f;
  s.embedding_scale = static_cast<float>(std::sqrt(static_cast<double>(config.hidden_size)));
  s.final_softcap = static_cast<float>(config.final_logit_softcapping);
  if (config.generation == 3) {
    s.local_rope.positions = config.max_position_embeddings;
    s.local_rope.half_dim = config.head_dim / 2;
    s.local_rope.cos = Tensor::empty({s.local_rope.positions, s.local_rope.half_dim}, DType::f32);
    s.local_rope.sin = Tensor::empty({s.local_rope.positions, s.local_rope.half_dim}, DType::f32);
    rope_tables(s.local_rope.positions, config.head_dim, config.local_rope_theta, config.local_rope_scaling,
                s.local_rope.cos.f32(), s.local_rope.sin.f32());
  }
  return s;
}

GemmaModel::GemmaModel(const GemmaConfig& config, nn::ComputeOptions options, float init_std, bool with_grads,
                       StageSpec stage, ParameterStore* into)
    : DecoderStack(config, gemma_spec(config), options, init_std, with_grads, stage, into) {}

ModelFamily gemma2_family() { return family_entry<Gemma2Config, GemmaModel>("Gemma2ForCausalLM", "gemma2"); }
ModelFamily gemma3_family() {
  return family_entry<Gemma3Config, GemmaModel>("Gemma3ForCausalLM", "gemma3_text");
}

}  // namespace forge::models
