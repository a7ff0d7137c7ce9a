#include "forge/models/starcoder2/starcoder2.h"

#include <nlohmann/json.hpp>

#include "forge/core/error.h"
#include "forge/models/config_json.h"
#include "forge/models/llama/llama_model.h"

namespace forge::models {
namespace {
using nlohmann::json;
using namespace config_json;

// Hugging Face's Starcoder2Config defaults (StarCoder2-3B's shape) for the keys a file may leave out;
// rope_theta (1e4) defaults as in LlamaConfig's reader.
const json kDefaults = {{"vocab_size", 49152},
                        {"hidden_size", 3072},
                        {"intermediate_size", 12288},
                        {"num_hidden_layers", 30},
                        {"num_attention_heads", 24},
                        {"num_key_value_heads", 2},
                        {"max_position_embeddings", 4096},
                        {"tie_word_embeddings", true}};
const std::vector<std::string_view> kOwnKeys = {"hidden_act",        "norm_epsilon",     "use_bias",
                                                "attention_dropout", "residual_dropout", "embedding_dropout",
                                                "sliding_window"};

double read_dropout(const json& j, const char* key, std::string_view source) {
  const double p = read_number(j, key, source).value_or(0.0);
  if (!(p >= 0.0 && p < 1.0)) fail("{}: key '{}' must be in [0, 1), got {}", source, key, p);
  return p;
}

}  // namespace

Starcoder2Config Starcoder2Config::from_json(const json& j, std::string_view source) {
  if (j.is_object() && j.contains("rms_norm_eps"))
    fail(
        "{}: key 'rms_norm_eps' is not a Starcoder2ForCausalLM key (its LayerNorms' epsilon is norm_epsilon)",
        source);
  Starcoder2Config c;
  static_cast<LlamaConfig&>(c) = LlamaConfig::from_family_json(j, source, "starcoder2", kOwnKeys, kDefaults);
  if (auto act = read_string(j, "hidden_act", source)) {
    const auto kind = ops::gelu_kind_from_name(*act);
    if (!kind)
      fail("{}: key 'hidden_act' is \"{}\", but forge's StarCoder2 MLP implements the GELUs ({})", source,
           *act, ops::kGeluKindNames);
    c.hidden_act = *kind;
  }
  c.use_bias = read_bool(j, "use_bias", source).value_or(true);
  c.qkv_bias = c.use_bias;
  c.rms_norm_eps = read_number(j, "norm_epsilon", source).value_or(1e-5);
  require_positive_finite(c.rms_norm_eps, "norm_epsilon", source);
  c.attention_dropout = read_dropout(j, "attention_dropout", source);
  c.residual_dropout = read_dropout(j, "residual_dropout", source);
  c.embedding_dropout = read_dropout(j, "embedding_dropout", source);
  // Absent or null: full causal attention (Starcoder2Config's default).
  if (auto window = read_integer(j, "sliding_window", source)) {
    if (*window <= 0) fail("{}: key 'sliding_window' must be positive or null, got {}", source, *window);
    c.attention_window = *window;
  }
  c.validate(source);
  return c;
}

json Starcoder2Config::to_json() const {
  json j = family_json("Starcoder2ForCausalLM", "starcoder2");
  j.erase("rms_norm_eps");
  j["norm_epsilon"] = rms_norm_eps;
  j["hidden_act"] = ops::gelu_kind_name(hidden_act);
  j["use_bias"] = use_bias;
  j["attention_dropout"] = attention_dropout;
  j["residual_dropout"] = residual_dropout;
  j["embedding_dropout"] = embedding_dropout;
  j["sliding_window"] = attention_window > 0 ? json(attention_window) : json(nullptr);
  return j;
}

int64_t Starcoder2Config::matmul_parameters_per_layer() const {
  const int64_t attention = 2 * hidden_size * q_size() + 2 * hidden_size * kv_size();
  return attention + 2 * hidden_size * intermediate_size;
}

int64_t Starcoder2Config::bias_parameters_per_layer() const {
  return use_bias ? q_size() + 2 * kv_size() + hidden_size + intermediate_size + hidden_size : 0;
}

int64_t Starcoder2Config::num_parameters() const {
  return LlamaConfig::num_parameters() + (2 * num_hidden_layers + 1) * hidden_size;  // LayerNorm biases
}

// Hugging Face's state_dict names, in the order the stack registers them (weights, then q|k|v's biases).
std::vector<std::pair<std::string, Shape>> Starcoder2Config::tensor_shapes() const {
  const int64_t h = hidden_size, v = vocab_size, ffn = intermediate_size;
  std::vector<std::pair<std::string, Shape>> shapes = {{"model.embed_tokens.weight", {v, h}}};
  auto add = [&](const std::string& name, Shape shape) { shapes.push_back({name, std::move(shape)}); };
  auto norm = [&](const std::string& name) { add(name + ".weight", {h}), add(name + ".bias", {h}); };
  for (int64_t i = 0; i < num_hidden_layers; ++i) {
    const std::string p = "model.layers." + std::to_string(i) + ".";
    norm(p + "input_layernorm");
    add(p + "self_attn.q_proj.weight", {q_size(), h});
    add(p + "self_attn.k_proj.weight", {kv_size(), h});
    add(p + "self_attn.v_proj.weight", {kv_size(), h});
    if (use_bias) {
      add(p + "self_attn.q_proj.bias", {q_size()});
      add(p + "self_attn.k_proj.bias", {kv_size()});
      add(p + "self_attn.v_proj.bias", {kv_size()});
    }
    add(p + "self_attn.o_proj.weight", {h, q_size()});
    if (use_bias) add(p + "self_attn.o_proj.bias", {h});
    norm(p + "post_attention_layernorm");
    add(p + "mlp.c_fc.weight", {ffn, h});
    if (use_bias) add(p + "mlp.c_fc.bias", {ffn});
    add(p + "mlp.c_proj.weight", {h, ffn});
    if (use_bias) add(p + "mlp.c_proj.bias", {h});
  }
  norm("model.norm");
  if (!tie_word_embeddings) add("lm_head.weight", {v, h});
  return shapes;
}

DecoderSpec starcoder2_spec(const Starcoder2Config& config) {
  DecoderSpec s = llama_spec(config);  // validates; sizes, RoPE, the window, q|k|v biases, the cache
  for (LayerSpec& layer : s.layer_specs) {
    layer.feed_forward = FeedForwardKind::gelu_mlp;
    layer.dense_bias = config.use_bias;
  }
  s.norm = nn::NormKind::layer;
  s.norm_bias = true;
  s.gelu = config.hidden_act;
  return s;
}

Starcoder2Model::Starcoder2Model(const Starcoder2Config& config, nn::ComputeOptions options, float init_std,
                                 bool with_grads, StageSpec stage, ParameterStore* into)
    : DecoderStack(config, starcoder2_spec(config), options, init_std, with_grads, stage, into) {}

ModelFamily starcoder2_family() {
  return family_entry<Starcoder2Config, Starcoder2Model>("Starcoder2ForCausalLM", "starcoder2");
}

}  // namespace forge::models
