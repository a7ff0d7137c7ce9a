#include "forge/models/llava/vision_config.h"

#include <array>
#include <nlohmann/json.hpp>
#include <optional>

#include "forge/core/error.h"
#include "forge/core/suggest.h"
#include "forge/models/config_json.h"

namespace forge::models {
namespace {

using nlohmann::json;
using namespace config_json;

constexpr std::array<std::string_view, 12> kKnownKeys = {
    "hidden_size",    "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_channels",   "image_size",        "patch_size",        "hidden_act",
    "layer_norm_eps", "vision_use_head",   "projection_dim",    "model_type"};

// Sizes far above any published encoder (ViT-22B: hidden 6144, 48 layers; images of a few thousand pixels).
constexpr int64_t kMaxHidden = int64_t{1} << 16, kMaxLayers = int64_t{1} << 10, kMaxImage = int64_t{1} << 14;

}  // namespace

ops::GeluKind gelu_from_hf_name(std::string_view name, std::string_view source, std::string_view key) {
  if (const std::optional<ops::GeluKind> kind = ops::gelu_kind_from_name(name)) return *kind;
  fail("{}: key '{}' is \"{}\"; forge implements {}", source, key, name, ops::kGeluKindNames);
}

bool VisionConfig::operator==(const VisionConfig& o) const { return to_json() == o.to_json(); }

VisionConfig VisionConfig::from_json(const json& j, std::string_view source, std::string_view prefix) {
  if (!j.is_object()) fail("{}: key '{}' must be an object, got {}", source, prefix, j.type_name());
  const std::string model_type = read_string(j, "model_type", source, prefix).value_or("clip_vision_model");
  VisionConfig c;
  if (model_type == "clip_vision_model") {
    c.kind = VisionKind::clip;
  } else if (model_type == "siglip_vision_model") {
    c.kind = VisionKind::siglip;
  } else {
    fail(
        "{}: key '{}model_type' is \"{}\"; forge's vision encoders are clip_vision_model and "
        "siglip_vision_model",
        source, prefix, model_type);
  }
  const bool clip = c.kind == VisionKind::clip;
  for (const auto& [key, value] : j.items()) {
    if (contains(kKnownKeys, key)) continue;
    if (is_generic_hf_key(key)) continue;
    if (key == "attention_dropout" || key == "dropout") {
      if (!(value.is_number() && value.get<double>() == 0.0))
        fail("{}: key '{}{}' is {}, but forge does not implement dropout (must be 0)", source, prefix, key,
             value.dump());
      continue;
    }
    // HF's initialiser settings, and the vocabulary size old CLIP vision configs carry: no effect on the
    // encoder's computation.
    if (key == "initializer_range" || key == "initializer_factor" || key == "vocab_size") continue;
    fail("{}: unknown key '{}{}'{}", source, prefix, key,
         did_you_mean(key, std::vector<std::string_view>(kKnownKeys.begin(), kKnownKeys.end())));
  }
  // Hugging Face's class defaults fill what a file leaves out (LLaVA configs list only what differs).
  auto integer = [&](const char* key, int64_t fallback) {
    return read_integer(j, key, source, prefix).value_or(fallback);
  };
  c.hidden_size = integer("hidden_size", 768);
  c.intermediate_size = integer("intermediate_size", 3072);
  c.num_hidden_layers = integer("num_hidden_layers", 12);
  c.num_attention_heads = integer("num_attention_heads", 12);
  c.num_channels = integer("num_channels", 3);
  c.image_size = integer("image_size", 224);
  c.patch_size = integer("patch_size", clip ? 32 : 16);
  const std::string act =
      read_string(j, "hidden_act", source, prefix).value_or(clip ? "quick_gelu" : "gelu_pytorch_tanh");
  c.hidden_act = gelu_from_hf_name(act, source, std::string(prefix) + "hidden_act");
  c.layer_norm_eps = read_number(j, "layer_norm_eps", source, prefix).value_or(clip ? 1e-5 : 1e-6);
  c.use_head = !clip && read_bool(j, "vision_use_head", source, prefix).value_or(true);
  if (clip) {
    c.projection_dim = integer("projection_dim", 0);
  } else if (j.contains("projection_dim")) {
    fail("{}: key '{}projection_dim' is CLIP's; a siglip_vision_model has none", source, prefix);
  }
  c.validate(source, prefix);
  return c;
}

void VisionConfig::validate(std::string_view source, std::string_view prefix) const {
  const std::string p(prefix);
  auto positive = [&](int64_t v, const char* key, int64_t max) {
    require_positive(v, (p + key).c_str(), source);
    if (v > max) fail("{}: key '{}{}' is {}, above forge's limit of {}", source, p, key, v, max);
  };
  positive(hidden_size, "hidden_size", kMaxHidden);
  positive(intermediate_size, "intermediate_size", kMaxHidden * 8);
  positive(num_hidden_layers, "num_hidden_layers", kMaxLayers);
  positive(num_attention_heads, "num_attention_heads", kMaxHidden);
  positive(num_channels, "num_channels", 16);
  positive(image_size, "image_size", kMaxImage);
  positive(patch_size, "patch_size", kMaxImage);
  if (hidden_size % num_attention_heads != 0)
    fail("{}: key '{}hidden_size' ({}) must be divisible by '{}num_attention_heads' ({})", source, p,
         hidden_size, p, num_attention_heads);
  if (image_size % patch_size != 0)
    fail("{}: key '{}image_size' ({}) must be a multiple of '{}patch_size' ({})", source, p, image_size, p,
         patch_size);
  if (num_positions() > (int64_t{1} << 20))
    fail("{}: {} patches per image is above forge's limit of 2^20", source, num_patches());
  require_positive_finite(layer_norm_eps, (p + "layer_norm_eps").c_str(), source);
  if (projection_dim < 0) fail("{}: key '{}projection_dim' must be >= 0, got {}", source, p, projection_dim);
}

json VisionConfig::to_json() const {
  const bool clip = kind == VisionKind::clip;
  json j;
  j["model_type"] = clip ? "clip_vision_model" : "siglip_vision_model";
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_channels"] = num_channels;
  j["image_size"] = image_size;
  j["patch_size"] = patch_size;
  j["hidden_act"] = ops::gelu_kind_name(hidden_act);
  j["layer_norm_eps"] = layer_norm_eps;
  j["attention_dropout"] = 0.0;
  if (clip && projection_dim > 0) j["projection_dim"] = projection_dim;
  if (!clip) j["vision_use_head"] = use_head;
  return j;
}

std::vector<std::pair<std::string, Shape>> VisionConfig::tensor_shapes(const std::string& prefix,
                                                                       bool with_head) const {
  const int64_t h = hidden_size, f = intermediate_size;
  std::vector<std::pair<std::string, Shape>> s;
  const std::string e = prefix + "embeddings.";
  if (has_class_token()) s.push_back({e + "class_embedding", {h}});
  // Stored as the convolution Hugging Face runs: [hidden, channels, patch, patch].
  s.push_back({e + "patch_embedding.weight", {h, num_channels, patch_size, patch_size}});
  if (kind == VisionKind::siglip) s.push_back({e + "patch_embedding.bias", {h}});
  s.push_back({e + "position_embedding.weight", {num_positions(), h}});
  if (kind == VisionKind::clip) {
    s.push_back({prefix + "pre_layrnorm.weight", {h}});
    s.push_back({prefix + "pre_layrnorm.bias", {h}});
  }
  for (int64_t i = 0; i < num_hidden_layers; ++i) {
    const std::string l = prefix + "encoder.layers." + std::to_string(i) + ".";
    s.push_back({l + "layer_norm1.weight", {h}});
    s.push_back({l + "layer_norm1.bias", {h}});
    for (const char* proj : {"k_proj", "v_proj", "q_proj", "out_proj"}) {
      s.push_back({l + "self_attn." + proj + ".weight", {h, h}});
      s.push_back({l + "self_attn." + proj + ".bias", {h}});
    }
    s.push_back({l + "layer_norm2.weight", {h}});
    s.push_back({l + "layer_norm2.bias", {h}});
    s.push_back({l + "mlp.fc1.weight", {f, h}});
    s.push_back({l + "mlp.fc1.bias", {f}});
    s.push_back({l + "mlp.fc2.weight", {h, f}});
    s.push_back({l + "mlp.fc2.bias", {h}});
  }
  s.push_back({prefix + "post_layernorm.weight", {h}});
  s.push_back({prefix + "post_layernorm.bias", {h}});
  if (with_head && kind == VisionKind::siglip && use_head) {
    // SigLIP's multihead attention pooling: a probe, torch's MultiheadAttention (packed in_proj), a norm
    // and an MLP.
    const std::string hd = prefix + "head.";
    s.push_back({hd + "probe", {1, 1, h}});
    s.push_back({hd + "attention.in_proj_weight", {3 * h, h}});
    s.push_back({hd + "attention.in_proj_bias", {3 * h}});
    s.push_back({hd + "attention.out_proj.weight", {h, h}});
    s.push_back({hd + "attention.out_proj.bias", {h}});
    s.push_back({hd + "layernorm.weight", {h}});
    s.push_back({hd + "layernorm.bias", {h}});
    s.push_back({hd + "mlp.fc1.weight", {f, h}});
    s.push_back({hd + "mlp.fc1.bias", {f}});
    s.push_back({hd + "mlp.fc2.weight", {h, f}});
    s.push_back({hd + "mlp.fc2.bias", {h}});
  }
  return s;
}

int64_t VisionConfig::num_parameters(bool with_head) const {
  int64_t n = 0;
  for (const auto& [name, shape] : tensor_shapes("", with_head)) n += shape_numel(shape);
  return n;
}

double VisionConfig::forward_flops_per_image(int64_t layers) const {
  const double h = static_cast<double>(hidden_size), f = static_cast<double>(intermediate_size);
  const double tokens = static_cast<double>(num_positions());
  const double patch_embedding =
      2.0 * static_cast<double>(num_patches()) * static_cast<double>(patch_dim()) * h;
  const double per_layer = 2.0 * tokens * (4 * h * h + 2 * h * f) + 4.0 * tokens * tokens * h;
  return patch_embedding + static_cast<double>(layers) * per_layer;
}

}  // namespace forge::models
