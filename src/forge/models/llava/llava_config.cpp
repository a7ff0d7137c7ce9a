#include "forge/models/llava/llava_config.h"

#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>

#include "forge/core/error.h"
#include "forge/core/file_io.h"
#include "forge/core/suggest.h"
#include "forge/models/config_json.h"

namespace forge::models {
namespace {

using nlohmann::json;
using namespace config_json;

constexpr std::array<std::string_view, 13> kKnownKeys = {"vision_config",
                                                         "text_config",
                                                         "image_token_index",
                                                         "image_token_id",
                                                         "projector_hidden_act",
                                                         "vision_feature_select_strategy",
                                                         "vision_feature_layer",
                                                         "image_seq_length",
                                                         "multimodal_projector_bias",
                                                         "mm_projector_type",
                                                         "model_type",
                                                         "tie_word_embeddings",
                                                         "vocab_size"};

// Hugging Face's LlamaConfig defaults, for what a LLaVA's text_config leaves out.
json text_config_with_defaults(const json& text, std::optional<int64_t> top_vocab, std::string_view source) {
  if (!text.is_object()) fail("{}: key 'text_config' must be an object, got {}", source, text.type_name());
  if (auto t = read_string(text, "model_type", source, "text_config."); t && *t != "llama")
    fail("{}: key 'text_config.model_type' is \"{}\"; forge's LLaVA language model is a LLaMA (\"llama\")",
         source, *t);
  json out = json::object();
  for (const auto& [key, value] : text.items())
    if (!is_generic_hf_key(key) || key == "architectures") out[key] = value;
  const std::pair<const char*, json> defaults[] = {
      {"hidden_size", 4096},       {"intermediate_size", 11008},      {"num_hidden_layers", 32},
      {"num_attention_heads", 32}, {"max_position_embeddings", 2048}, {"rms_norm_eps", 1e-6}};
  for (const auto& [key, value] : defaults)
    if (!out.contains(key) || out[key].is_null()) out[key] = value;
  if (!out.contains("vocab_size") || out["vocab_size"].is_null())
    out["vocab_size"] = top_vocab.value_or(32000);
  if (top_vocab && out["vocab_size"] != json(*top_vocab))
    fail("{}: key 'vocab_size' ({}) differs from 'text_config.vocab_size' ({})", source, *top_vocab,
         out["vocab_size"].dump());
  return out;
}

}  // namespace

LlavaConfig LlavaConfig::from_json_file(const std::filesystem::path& path) {
  const std::string source = path.string();
  return from_json(parse_json_strict(read_file(path, "model config"), source), source);
}

LlavaConfig LlavaConfig::from_json(const json& j, std::string_view source) {
  if (!j.is_object()) fail("{}: expected a JSON object at the top level, got {}", source, j.type_name());
  for (const auto& [key, value] : j.items()) {
    if (contains(kKnownKeys, key) || is_generic_hf_key(key)) continue;
    if (key == "ignore_index") continue;  // HF's label padding value; forge's targets use -1 alike
    fail("{}: unknown key '{}'{}", source, key,
         did_you_mean(key, std::vector<std::string_view>(kKnownKeys.begin(), kKnownKeys.end())));
  }
  if (auto t = read_string(j, "model_type", source); t && *t != "llava")
    fail("{}: key 'model_type' is \"{}\", not \"llava\"", source, *t);
  LlavaConfig c;
  c.origin = std::string(source);
  // HF's LlavaConfig default encoder: CLIP ViT-L/14 at 336 pixels.
  json vision = j.contains("vision_config") && !j["vision_config"].is_null()
                    ? j["vision_config"]
                    : json{{"model_type", "clip_vision_model"},
                           {"hidden_size", 1024},
                           {"image_size", 336},
                           {"intermediate_size", 4096},
                           {"num_attention_heads", 16},
                           {"num_hidden_layers", 24},
                           {"patch_size", 14},
                           {"projection_dim", 768}};
  c.vision = VisionConfig::from_json(vision, source, "vision_config.");
  const json text =
      j.contains("text_config") && !j["text_config"].is_null() ? j["text_config"] : json::object();
  const json filled = text_config_with_defaults(text, read_integer(j, "vocab_size", source), source);
  c.text = LlamaConfig::from_json(filled, fmt::format("{} (text_config)", source));
  if (auto tie = read_bool(j, "tie_word_embeddings", source)) {
    if (text.contains("tie_word_embeddings") && c.text.tie_word_embeddings != *tie)
      fail("{}: keys 'tie_word_embeddings' and 'text_config.tie_word_embeddings' disagree", source);
    c.text.tie_word_embeddings = *tie;
  }

  const auto index = read_integer(j, "image_token_index", source);
  const auto id = read_integer(j, "image_token_id", source);
  if (index && id && *index != *id)
    fail("{}: keys 'image_token_index' ({}) and 'image_token_id' ({}) disagree", source, *index, *id);
  c.image_token_index = index ? *index : id.value_or(32000);
  c.projector_hidden_act = gelu_from_hf_name(read_string(j, "projector_hidden_act", source).value_or("gelu"),
                                             source, "projector_hidden_act");
  c.projector_bias = read_bool(j, "multimodal_projector_bias", source).value_or(true);
  const std::string projector = read_string(j, "mm_projector_type", source).value_or("mlp2x_gelu");
  if (projector == "linear") {
    c.projector = ProjectorType::linear;
  } else if (projector != "mlp2x_gelu") {
    fail("{}: key 'mm_projector_type' is \"{}\"; forge implements mlp2x_gelu and linear", source, projector);
  }
  const std::string strategy = read_string(j, "vision_feature_select_strategy", source).value_or("default");
  if (strategy != "default" && strategy != "full")
    fail("{}: key 'vision_feature_select_strategy' is \"{}\"; it must be \"default\" or \"full\"", source,
         strategy);
  c.full_features = strategy == "full";
  if (auto it = j.find("vision_feature_layer"); it != j.end() && !it->is_null()) {
    auto layer = [&](const json& v) {
      if (!v.is_number_integer())
        fail("{}: key 'vision_feature_layer' must be an integer or a list of integers, got {}", source,
             v.dump());
      return v.get<int64_t>();
    };
    c.vision_feature_layers.clear();
    if (it->is_array()) {
      c.vision_feature_layer_is_list = true;
      for (const json& v : *it) c.vision_feature_layers.push_back(layer(v));
    } else {
      c.vision_feature_layers.push_back(layer(*it));
    }
  }
  c.image_seq_length = read_integer(j, "image_seq_length", source).value_or(576);
  c.validate(source);
  return c;
}

void LlavaConfig::validate(std::string_view source) const {
  vision.validate(source, "vision_config.");
  text.validate(fmt::format("{} (text_config)", source));
  if (image_token_index < 0 || image_token_index >= text.vocab_size)
    fail("{}: key 'image_token_index' ({}) must be a token id of the language model's vocabulary [0, {})",
         source, image_token_index, text.vocab_size);
  if (vision_feature_layers.empty()) fail("{}: key 'vision_feature_layer' lists no layer", source);
  const int64_t states = vision.num_hidden_layers + 1;  // hidden_states: the embeddings', then each layer's
  for (int64_t l : vision_feature_layers)
    if (l < -states || l >= states)
      fail("{}: key 'vision_feature_layer' ({}) is outside the encoder's {} hidden states [{}, {}]", source,
           l, states, -states, states - 1);
  if (image_seq_length < 0) fail("{}: key 'image_seq_length' must be >= 0, got {}", source, image_seq_length);
}

json LlavaConfig::to_json() const {
  json j;
  j["architectures"] = json::array({"LlavaForConditionalGeneration"});
  j["model_type"] = "llava";
  j["vision_config"] = vision.to_json();
  j["text_config"] = text.to_json();
  j["image_token_index"] = image_token_index;
  j["projector_hidden_act"] = ops::gelu_kind_name(projector_hidden_act);
  j["multimodal_projector_bias"] = projector_bias;
  if (projector == ProjectorType::linear) j["mm_projector_type"] = "linear";
  j["vision_feature_select_strategy"] = full_features ? "full" : "default";
  if (vision_feature_layer_is_list)
    j["vision_feature_layer"] = vision_feature_layers;
  else
    j["vision_feature_layer"] = vision_feature_layers.front();
  j["image_seq_length"] = image_seq_length;
  j["tie_word_embeddings"] = text.tie_word_embeddings;
  return j;
}

std::vector<int64_t> LlavaConfig::feature_layer_indices() const {
  std::vector<int64_t> out;
  const int64_t states = vision.num_hidden_layers + 1;
  for (int64_t l : vision_feature_layers) out.push_back(l < 0 ? l + states : l);
  return out;
}

int64_t LlavaConfig::encoder_layers_used() const {
  const std::vector<int64_t> indices = feature_layer_indices();
  return *std::max_element(indices.begin(), indices.end());
}

int64_t LlavaConfig::vision_parameters() const { return vision.num_parameters(/*with_head=*/true); }

int64_t LlavaConfig::projector_parameters() const {
  const int64_t in = projector_input(), h = text.hidden_size, b = projector_bias ? 1 : 0;
  if (projector == ProjectorType::linear) return h * in + b * h;
  return h * in + b * h + h * h + b * h;
}

int64_t LlavaConfig::num_parameters() const {
  return vision_parameters() + projector_parameters() + text.num_parameters();
}

double LlavaConfig::encoder_forward_flops_per_image() const {
  return vision.forward_flops_per_image(encoder_layers_used());
}

double LlavaConfig::projector_forward_flops_per_image() const {
  const double rows = static_cast<double>(tokens_per_image()), h = static_cast<double>(text.hidden_size);
  const double first = 2.0 * rows * static_cast<double>(projector_input()) * h;
  return projector == ProjectorType::linear ? first : first + 2.0 * rows * h * h;
}

namespace {
bool has_part(const std::vector<std::string>& parts, std::string_view part) {
  return std::find(parts.begin(), parts.end(), part) != parts.end();
}
}  // namespace

double LlavaConfig::trained_flops_per_token(int64_t seq_len, const std::vector<std::string>& frozen) const {
  const double all = text.flops_per_token(seq_len);
  if (!has_part(frozen, "language")) return all;
  return all - text.matmul_flops_per_token();  // no weight-gradient GEMMs (a forward's worth)
}

double LlavaConfig::trained_flops_per_image(const std::vector<std::string>& frozen) const {
  const bool vision = !has_part(frozen, "vision"), projector = !has_part(frozen, "projector");
  return (vision ? 3.0 : 1.0) * encoder_forward_flops_per_image() + (projector ? 3.0
                                                                     : vision  ? 2.0
                                                                               : 1.0) *
                                                                        projector_forward_flops_per_image();
}

void LlavaConfig::check_fits_in_memory(bool training, bool bf16_shadow, int64_t available_bytes,
                                       std::string_view source_name) const {
  const int64_t per_parameter = 4 + (bf16_shadow ? 2 : 0) + (training ? 4 + 8 : 0);
  const int64_t others = (vision_parameters() + projector_parameters()) * per_parameter;
  const int64_t needed = text.memory_bytes(training, bf16_shadow) + others;
  if (needed <= available_bytes) return;
  fail(
      "{}: the model needs {} for its {} ({:.3g} parameters: encoder {:.3g}, projector {:.3g}, language "
      "model "
      "{:.3g}); this machine has {}",
      source_name, human_bytes(needed), training ? "weights, gradients and optimizer state" : "weights",
      static_cast<double>(num_parameters()), static_cast<double>(vision_parameters()),
      static_cast<double>(projector_parameters()), static_cast<double>(text.num_parameters()),
      human_bytes(available_bytes));
}

// Hugging Face's LlavaForConditionalGeneration names (the layout of the llava-hf checkpoints; newer
// transformers reads them through its key mapping).
std::vector<std::pair<std::string, Shape>> LlavaConfig::tensor_shapes() const {
  std::vector<std::pair<std::string, Shape>> s = vision.tensor_shapes("vision_tower.vision_model.", true);
  const int64_t h = text.hidden_size;
  s.push_back({"multi_modal_projector.linear_1.weight", {h, projector_input()}});
  if (projector_bias) s.push_back({"multi_modal_projector.linear_1.bias", {h}});
  if (projector == ProjectorType::mlp2x_gelu) {
    s.push_back({"multi_modal_projector.linear_2.weight", {h, h}});
    if (projector_bias) s.push_back({"multi_modal_projector.linear_2.bias", {h}});
  }
  for (auto& [name, shape] : text.tensor_shapes()) {
    // LlamaForCausalLM's "model.*" and "lm_head.weight" sit under "language_model.".
    s.push_back({"language_model." + name, shape});
  }
  return s;
}

}  // namespace forge::models
