#include "forge/models/llama/llama_config.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <fstream>
#include <iterator>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/core/suggest.h"
#include "forge/models/config_json.h"

namespace forge::models {
namespace {

using nlohmann::json;
using namespace config_json;

// Keys forge reads.
constexpr std::array<std::string_view, 12> kKnownKeys = {
    "hidden_size",         "intermediate_size", "num_hidden_layers",   "num_attention_heads",
    "num_key_value_heads", "head_dim",          "rms_norm_eps",        "rope_theta",
    "rope_scaling",        "vocab_size",        "tie_word_embeddings", "max_position_embeddings"};

// HF keys forge knowingly ignores: bookkeeping (names, dtype of the saved weights, token ids the tokenizer
// owns, init range of HF's own initialiser, generation cache) or, for pretraining_tp, an HF-only way of
// splitting the same matmuls. The four keys checked in check_ignored_key() are accepted only with the
// value forge implements.
constexpr std::array<std::string_view, 15> kIgnoredKeys = {
    "architectures",  "model_type",     "torch_dtype",  "transformers_version",
    "bos_token_id",   "eos_token_id",   "pad_token_id", "initializer_range",
    "hidden_act",     "attention_bias", "mlp_bias",     "attention_dropout",
    "pretraining_tp", "use_cache",      "_name_or_path"};

constexpr std::array<std::string_view, 6> kRopeScalingKeys = {
    "rope_type", "type", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"};

template <size_t N>
std::string did_you_mean(std::string_view key, const std::array<std::string_view, N>& candidates) {
  return forge::did_you_mean(key, std::vector<std::string_view>(candidates.begin(), candidates.end()));
}

void check_ignored_key(const std::string& key, const json& value, std::string_view source) {
  if (key == "hidden_act" && !(value.is_string() && value.get<std::string>() == "silu"))
    fail("{}: key 'hidden_act' is {}, but forge's LLaMA MLP implements only \"silu\"", source, value.dump());
  if ((key == "attention_bias" || key == "mlp_bias") && !(value.is_boolean() && !value.get<bool>()))
    fail("{}: key '{}' is {}, but forge's LLaMA has no biases (must be false)", source, key, value.dump());
  if (key == "attention_dropout" && !(value.is_number() && value.get<double>() == 0.0))
    fail("{}: key 'attention_dropout' is {}, but forge does not implement dropout (must be 0)", source,
         value.dump());
}

RopeScaling read_rope_scaling(const json& object, std::string_view source) {
  RopeScaling scaling;
  auto it = object.find("rope_scaling");
  if (it == object.end() || it->is_null()) return scaling;
  const json& rope = *it;
  if (!rope.is_object())
    fail("{}: key 'rope_scaling' must be an object or null, got {} {}", source, rope.type_name(),
         rope.dump());
  for (const auto& [key, value] : rope.items()) {
    if (!contains(kRopeScalingKeys, key))
      fail("{}: unknown key 'rope_scaling.{}'{}", source, key, did_you_mean(key, kRopeScalingKeys));
  }
  // Older HF configs spell the kind "type", newer ones "rope_type".
  std::optional<std::string> type;
  for (const char* type_key : {"rope_type", "type"}) {
    auto t = rope.find(type_key);
    if (t == rope.end()) continue;
    if (!t->is_string())
      fail("{}: key 'rope_scaling.{}' must be a string, got {}", source, type_key, t->dump());
    if (type && *type != t->get<std::string>())
      fail("{}: keys 'rope_scaling.rope_type' and 'rope_scaling.type' disagree", source);
    type = t->get<std::string>();
  }
  if (!type) fail("{}: missing required key 'rope_scaling.rope_type'", source);
  if (*type == "default") return scaling;
  if (*type != "llama3")
    fail("{}: unsupported rope_scaling type '{}' (forge implements 'llama3' and 'default')", source, *type);

  scaling.kind = RopeScaling::Kind::llama3;
  auto number = [&](const char* key) {
    auto value = read_number(rope, key, source);
    if (!value) fail("{}: missing required key 'rope_scaling.{}' for rope_type 'llama3'", source, key);
    return *value;
  };
  scaling.factor = number("factor");
  scaling.low_freq_factor = number("low_freq_factor");
  scaling.high_freq_factor = number("high_freq_factor");
  auto original = read_integer(rope, "original_max_position_embeddings", source);
  if (!original)
    fail("{}: missing required key 'rope_scaling.original_max_position_embeddings' for rope_type 'llama3'",
         source);
  scaling.original_max_position_embeddings = *original;
  return scaling;
}

// transformers 5 writes rope_theta and the scaling as one object, rope_parameters {"rope_type", "rope_theta",
// the scaling's keys}: back to the two keys older configs (and forge's to_json) use. Given both ways, they
// must agree.
json unfold_rope_parameters(const json& j, std::string_view source) {
  auto it = j.find("rope_parameters");
  if (it == j.end()) return j;
  json out = j;
  out.erase("rope_parameters");
  if (it->is_null()) return out;
  if (!it->is_object())
    fail("{}: key 'rope_parameters' must be an object or null, got {} {}", source, it->type_name(),
         it->dump());
  json scaling = *it;
  if (auto theta = scaling.find("rope_theta"); theta != scaling.end()) {
    if (out.contains("rope_theta") && !out["rope_theta"].is_null() && out["rope_theta"] != *theta)
      fail("{}: keys 'rope_theta' ({}) and 'rope_parameters.rope_theta' ({}) disagree", source,
           out["rope_theta"].dump(), theta->dump());
    out["rope_theta"] = *theta;
    scaling.erase("rope_theta");
  }
  const bool plain = scaling.empty() || (scaling.size() == 1 && scaling.contains("rope_type") &&
                                         scaling["rope_type"] == "default");
  if (plain) return out;
  if (out.contains("rope_scaling") && !out["rope_scaling"].is_null() && out["rope_scaling"] != scaling)
    fail("{}: keys 'rope_scaling' and 'rope_parameters' disagree", source);
  out["rope_scaling"] = scaling;
  return out;
}

// Upper bounds on the sizes: far above any published model (LLaMA 3 405B: hidden 16384, FFN 53248, 126
// layers, vocabulary 128256; contexts of 10M positions), low enough that no size wraps the int the modules
// take and no product of sizes wraps int64. A config beyond them is corrupt or hostile, not a model.
constexpr SizeLimit<LlamaConfig> kSizeLimits[] = {
    {"hidden_size", &LlamaConfig::hidden_size, int64_t{1} << 20},
    {"intermediate_size", &LlamaConfig::intermediate_size, int64_t{1} << 22},
    {"num_hidden_layers", &LlamaConfig::num_hidden_layers, int64_t{1} << 16},
    {"num_attention_heads", &LlamaConfig::num_attention_heads, int64_t{1} << 16},
    {"num_key_value_heads", &LlamaConfig::num_key_value_heads, int64_t{1} << 16},
    {"head_dim", &LlamaConfig::head_dim, int64_t{1} << 16},
    {"vocab_size", &LlamaConfig::vocab_size, int64_t{1} << 30},  // token ids are int32
    {"max_position_embeddings", &LlamaConfig::max_position_embeddings, int64_t{1} << 24},
};

// The parameter count without overflow, for sizes that may be out of range (exact up to 2^64).
long double wide_parameter_count(const LlamaConfig& c) {
  const long double h = c.hidden_size, v = c.vocab_size, layers = c.num_hidden_layers;
  const long double q = static_cast<long double>(c.num_attention_heads) * c.head_dim;
  const long double kv = static_cast<long double>(c.num_key_value_heads) * c.head_dim;
  const long double per_layer = 2 * h * q + 2 * h * kv + 3 * h * c.intermediate_size + 2 * h +
                                (c.qkv_bias ? q + 2 * kv : 0) + (c.qk_norm ? 2.0L * c.head_dim : 0);
  return v * h * (c.tie_word_embeddings ? 1 : 2) + layers * per_layer + h;
}

// The sizes that make a model big, for messages about its memory.
std::string size_summary(const LlamaConfig& c) {
  return fmt::format("hidden_size {}, intermediate_size {}, num_hidden_layers {}, vocab_size {}",
                     c.hidden_size, c.intermediate_size, c.num_hidden_layers, c.vocab_size);
}

}  // namespace

LlamaConfig LlamaConfig::from_json_file(const std::filesystem::path& path) {
  const std::string source = path.string();
  const std::string text = read_file(path, "model config");
  // Strict: a key given twice is refused (nlohmann would keep the last one silently).
  return from_json(parse_json_strict(text, source), source);
}

LlamaConfig LlamaConfig::from_json(const json& input, std::string_view source) {
  if (!input.is_object())
    fail("{}: expected a JSON object at the top level, got {}", source, input.type_name());
  const json j = unfold_rope_parameters(input, source);
  for (const auto& [key, value] : j.items()) {
    if (contains(kKnownKeys, key)) continue;
    if (contains(kIgnoredKeys, key)) {
      check_ignored_key(key, value, source);
      continue;
    }
    fail("{}: unknown key '{}'{}", source, key, did_you_mean(key, kKnownKeys));
  }

  LlamaConfig c;
  c.hidden_size = require_integer(j, "hidden_size", source);
  c.intermediate_size = require_integer(j, "intermediate_size", source);
  c.num_hidden_layers = require_integer(j, "num_hidden_layers", source);
  c.num_attention_heads = require_integer(j, "num_attention_heads", source);
  c.vocab_size = require_integer(j, "vocab_size", source);
  require_positive(c.hidden_size, "hidden_size", source);
  require_positive(c.num_attention_heads, "num_attention_heads", source);
  c.num_key_value_heads = read_integer(j, "num_key_value_heads", source).value_or(c.num_attention_heads);
  if (auto head_dim = read_integer(j, "head_dim", source)) {
    c.head_dim = *head_dim;
  } else {
    if (c.hidden_size % c.num_attention_heads != 0)
      fail(
          "{}: key 'hidden_size' ({}) must be divisible by 'num_attention_heads' ({}) when 'head_dim' is "
          "absent",
          source, c.hidden_size, c.num_attention_heads);
    c.head_dim = c.hidden_size / c.num_attention_heads;
  }
  c.rms_norm_eps = read_number(j, "rms_norm_eps", source).value_or(c.rms_norm_eps);
  c.rope_theta = read_number(j, "rope_theta", source).value_or(c.rope_theta);
  c.rope_scaling = read_rope_scaling(j, source);
  c.tie_word_embeddings = read_bool(j, "tie_word_embeddings", source).value_or(c.tie_word_embeddings);
  c.max_position_embeddings =
      read_integer(j, "max_position_embeddings", source).value_or(c.max_position_embeddings);
  c.origin.name = std::string(source);
  c.validate(source);
  return c;
}

LlamaConfig LlamaConfig::from_family_json(const json& j, std::string_view source, std::string_view model_type,
                                          const std::vector<std::string_view>& own_keys,
                                          const json& defaults) {
  if (!j.is_object()) fail("{}: expected a JSON object at the top level, got {}", source, j.type_name());
  if (auto t = read_string(j, "model_type", source); t && *t != model_type)
    fail("{}: key 'model_type' is \"{}\", not \"{}\"", source, *t, model_type);
  json llama = json::object();
  for (const auto& [key, value] : j.items())
    if (key != "model_type" && key != "architectures" &&
        std::find(own_keys.begin(), own_keys.end(), key) == own_keys.end())
      llama[key] = value;
  for (const auto& [key, value] : defaults.items())
    if (!llama.contains(key) || llama[key].is_null()) llama[key] = value;
  return from_json(llama, source);
}

void LlamaConfig::validate(std::string_view source) const {
  require_positive(hidden_size, "hidden_size", source);
  require_positive(intermediate_size, "intermediate_size", source);
  require_positive(num_hidden_layers, "num_hidden_layers", source);
  require_positive(num_attention_heads, "num_attention_heads", source);
  require_positive(num_key_value_heads, "num_key_value_heads", source);
  require_positive(head_dim, "head_dim", source);
  require_positive(vocab_size, "vocab_size", source);
  require_positive(max_position_embeddings, "max_position_embeddings", source);
  // Sizes are bounded before any product of them is formed (a wrapped size would build another model).
  check_size_limits(*this, kSizeLimits, wide_parameter_count(*this), size_summary(*this), source);
  if (num_attention_heads % num_key_value_heads != 0)
    fail("{}: key 'num_attention_heads' ({}) must be divisible by 'num_key_value_heads' ({})", source,
         num_attention_heads, num_key_value_heads);
  // RoPE rotates pairs of channels.
  if (head_dim % 2 != 0)
    fail("{}: key 'head_dim' must be even for rotary embeddings, got {}", source, head_dim);
  require_positive_finite(rms_norm_eps, "rms_norm_eps", source);
  if (attention_window < 0)
    fail("{}: key 'sliding_window' must be positive or null, got {}", source, attention_window);
  require_positive_finite(rope_theta, "rope_theta", source);
  if (rope_scaling.kind == RopeScaling::Kind::llama3) {
    require_positive_finite(rope_scaling.factor, "rope_scaling.factor", source);
    require_positive_finite(rope_scaling.low_freq_factor, "rope_scaling.low_freq_factor", source);
    require_positive_finite(rope_scaling.high_freq_factor, "rope_scaling.high_freq_factor", source);
    require_positive(rope_scaling.original_max_position_embeddings,
                     "rope_scaling.original_max_position_embeddings", source);
    if (rope_scaling.original_max_position_embeddings > (int64_t{1} << 24))
      fail("{}: key 'rope_scaling.original_max_position_embeddings' is {}, above forge's limit of {}", source,
           rope_scaling.original_max_position_embeddings, int64_t{1} << 24);
    // The llama3 rule interpolates between the two wavelength bounds and divides by their difference.
    if (!(rope_scaling.high_freq_factor > rope_scaling.low_freq_factor))
      fail(
          "{}: key 'rope_scaling.high_freq_factor' ({}) must be greater than 'rope_scaling.low_freq_factor' "
          "({})",
          source, rope_scaling.high_freq_factor, rope_scaling.low_freq_factor);
  }
}

json LlamaConfig::to_json() const {
  json j;
  j["architectures"] = json::array({"LlamaForCausalLM"});
  j["model_type"] = "llama";
  j["hidden_act"] = "silu";
  j["attention_bias"] = false;
  j["mlp_bias"] = false;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["rms_norm_eps"] = rms_norm_eps;
  j["rope_theta"] = rope_theta;
  if (rope_scaling.kind == RopeScaling::Kind::llama3) {
    j["rope_scaling"] = {{"rope_type", "llama3"},
                         {"factor", rope_scaling.factor},
                         {"low_freq_factor", rope_scaling.low_freq_factor},
                         {"high_freq_factor", rope_scaling.high_freq_factor},
                         {"original_max_position_embeddings", rope_scaling.original_max_position_embeddings}};
  } else {
    j["rope_scaling"] = nullptr;
  }
  j["vocab_size"] = vocab_size;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["max_position_embeddings"] = max_position_embeddings;
  return j;
}

json LlamaConfig::family_json(std::string_view architecture, std::string_view model_type) const {
  json j = LlamaConfig::to_json();  // not the family's override, which calls this
  j["architectures"] = json::array({architecture});
  j["model_type"] = model_type;
  j.erase("attention_bias");
  j.erase("mlp_bias");
  j["attention_dropout"] = 0.0;
  return j;
}

int64_t LlamaConfig::matmul_parameters_per_layer() const {
  const int64_t attention = hidden_size * q_size() + 2 * hidden_size * kv_size() + q_size() * hidden_size;
  const int64_t mlp = 3 * hidden_size * intermediate_size;
  return attention + mlp;
}

int64_t LlamaConfig::num_parameters() const {
  const int64_t embedding = vocab_size * hidden_size;
  // + two RMSNorm weights (and the q, k, v biases of a Qwen2, the QK-norm weights of a Qwen3)
  const int64_t per_layer = matmul_parameters_per_layer() + 2 * hidden_size + bias_parameters_per_layer();
  const int64_t lm_head = tie_word_embeddings ? 0 : vocab_size * hidden_size;
  return embedding + num_hidden_layers * per_layer + hidden_size + lm_head;
}

int64_t LlamaConfig::memory_bytes(bool training, bool bf16_shadow) const {
  // Per parameter: fp32 weight, bf16 copy, fp32 gradient, AdamW's fp32 first and second moments.
  const int64_t per_parameter = 4 + (bf16_shadow ? 2 : 0) + (training ? 4 + 8 : 0);
  const int64_t rope_tables = 2 * max_position_embeddings * (head_dim / 2) * 4;  // cos and sin, fp32
  return num_parameters() * per_parameter + rope_tables;
}

void LlamaConfig::check_fits_in_memory(bool training, bool bf16_shadow, int64_t available_bytes,
                                       std::string_view source) const {
  const int64_t needed = memory_bytes(training, bf16_shadow);
  if (needed <= available_bytes) return;
  fail("{}: the model needs {} for its {} ({:.3g} parameters: {}); this machine has {}", source,
       human_bytes(needed), training ? "weights, gradients and optimizer state" : "weights",
       static_cast<double>(num_parameters()), size_summary(*this), human_bytes(available_bytes));
}

double LlamaConfig::matmul_flops_per_token() const {
  return 2.0 * (static_cast<double>(num_hidden_layers) * static_cast<double>(matmul_parameters_per_layer()) +
                static_cast<double>(vocab_size) * static_cast<double>(hidden_size));
}

double LlamaConfig::flops_per_token(int64_t seq_len) const {
  const double attention = 12.0 * static_cast<double>(num_hidden_layers) * static_cast<double>(seq_len) *
                           static_cast<double>(q_size());
  return 3.0 * matmul_flops_per_token() + attention;
}

}  // namespace forge::models

namespace forge::models {

ModelShape LlamaConfig::shape() const {
  ModelShape s;
  s.hidden = hidden_size, s.heads = num_attention_heads, s.kv_heads = num_key_value_heads,
  s.head_dim = head_dim;
  s.ffn = intermediate_size, s.vocab = vocab_size, s.layers = num_hidden_layers;
  s.max_positions = max_position_embeddings;
  return s;
}

// The Hugging Face state_dict of LlamaForCausalLM: forge registers its parameters under these very names, so
// import and export map each tensor to itself.
std::vector<std::pair<std::string, Shape>> LlamaConfig::tensor_shapes() const {
  const int64_t h = hidden_size, v = vocab_size, ffn = intermediate_size;
  std::vector<std::pair<std::string, Shape>> shapes = {{"model.embed_tokens.weight", {v, h}}};
  for (int64_t i = 0; i < num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    shapes.push_back({p + "input_layernorm.weight", {h}});
    shapes.push_back({p + "self_attn.q_proj.weight", {q_size(), h}});
    shapes.push_back({p + "self_attn.k_proj.weight", {kv_size(), h}});
    shapes.push_back({p + "self_attn.v_proj.weight", {kv_size(), h}});
    if (qkv_bias) {
      shapes.push_back({p + "self_attn.q_proj.bias", {q_size()}});
      shapes.push_back({p + "self_attn.k_proj.bias", {kv_size()}});
      shapes.push_back({p + "self_attn.v_proj.bias", {kv_size()}});
    }
    shapes.push_back({p + "self_attn.o_proj.weight", {h, q_size()}});
    if (qk_norm) {
      shapes.push_back({p + "self_attn.q_norm.weight", {head_dim}});
      shapes.push_back({p + "self_attn.k_norm.weight", {head_dim}});
    }
    shapes.push_back({p + "post_attention_layernorm.weight", {h}});
    shapes.push_back({p + "mlp.gate_proj.weight", {ffn, h}});
    shapes.push_back({p + "mlp.up_proj.weight", {ffn, h}});
    shapes.push_back({p + "mlp.down_proj.weight", {h, ffn}});
  }
  shapes.push_back({"model.norm.weight", {h}});
  if (!tie_word_embeddings) shapes.push_back({"lm_head.weight", {v, h}});
  return shapes;
}

}  // namespace forge::models
