// LlavaConfig: a vision encoder, a projector and a LLaMA language model, read from a Hugging Face
// `LlavaForConditionalGeneration` config.json (model_type "llava").
//
// The image's encoder features (the hidden states after layer `vision_feature_layer`, without the class
// token under the "default" strategy) go through the projector into the language model's hidden size and
// replace, in order, the embeddings of the `image_token_index` tokens of the text: one image token per
// projected patch.
//
// What the file leaves out takes Hugging Face's class defaults (LLaVA configs list only what differs from
// them: llava-1.5-7b's text_config names no hidden size). Keys outside HF's LlavaConfig are errors, with
// one forge extension: `mm_projector_type` ("mlp2x_gelu", HF's and the default; or "linear", the first
// LLaVA's single matrix, which Hugging Face's LLaVA cannot load).
#pragma once

#include <cstdint>
#include <filesystem>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "forge/models/llama/llama_config.h"
#include "forge/models/llava/vision_config.h"
#include "forge/models/model.h"

namespace forge::models {

enum class ProjectorType { mlp2x_gelu, linear };

struct LlavaConfig final : ModelConfig {
  VisionConfig vision;
  LlamaConfig text;
  int64_t image_token_index = 32000;
  ProjectorType projector = ProjectorType::mlp2x_gelu;
  ops::GeluKind projector_hidden_act = ops::GeluKind::erf;
  bool projector_bias = true;  // multimodal_projector_bias
  // Encoder layers whose outputs are the features, as Python indices into hidden_states (the embeddings'
  // output is 0, layer i's is i + 1; negative from the end): several are concatenated along channels.
  std::vector<int64_t> vision_feature_layers = {-2};
  bool vision_feature_layer_is_list = false;  // how the file wrote it (for the round trip)
  bool full_features = false;  // vision_feature_select_strategy: "full" keeps every position, "default" drops
                               // the first (tokens_per_image)
  int64_t image_seq_length = 576;  // HF's processor setting, kept for the round trip
  std::string origin;

  bool operator==(const LlavaConfig& o) const { return to_json() == o.to_json(); }

  // ModelConfig: the shape and the sizes layouts check are the language model's.
  std::unique_ptr<ModelConfig> clone() const override { return std::make_unique<LlavaConfig>(*this); }
  std::string architecture() const override { return "LlavaForConditionalGeneration"; }
  ModelShape shape() const override { return text.shape(); }
  nlohmann::json to_json() const override;
  const std::string& source() const override { return origin; }
  int64_t num_parameters() const override;
  // The language model's FLOPs per token (Megatron's accounting); the encoder's and projector's per image
  // are trained_flops_per_image(), which a step adds for its images.
  double flops_per_token(int64_t seq_len) const override { return text.flops_per_token(seq_len); }
  // A frozen language model runs its forward and the input gradients (to reach the projector): its weight
  // matmuls count 4 FLOPs per parameter instead of 6, attention as much as trained.
  double trained_flops_per_token(int64_t seq_len, const std::vector<std::string>& frozen) const override;
  // Encoder and projector: 3x the forward for a trained part; a frozen projector 2x under a trained encoder
  // (its input gradient), else 1x; a frozen encoder 1x.
  double trained_flops_per_image(const std::vector<std::string>& frozen) const override;
  void check_fits_in_memory(bool training, bool bf16_shadow, int64_t available_bytes,
                            std::string_view source_name) const override;
  std::vector<std::pair<std::string, Shape>> tensor_shapes() const override;

  static LlavaConfig from_json_file(const std::filesystem::path& path);
  static LlavaConfig from_json(const nlohmann::json& json, std::string_view source);
  void validate(std::string_view source) const;

  // The encoder layers an image must run through: the deepest feature layer (layers past it are never
  // computed, as in Hugging Face, whose outputs there feed nothing).
  int64_t encoder_layers_used() const;
  // vision_feature_layers as hidden_states indices 0 .. num_hidden_layers (negatives resolved).
  std::vector<int64_t> feature_layer_indices() const;
  std::optional<ImageInput> image_input() const override {
    return ImageInput{vision.num_channels, vision.image_size, vision.image_size,
                      static_cast<int32_t>(image_token_index), tokens_per_image()};
  }
  // Image tokens per image in the text: every encoder position under "full"; under "default" all but the
  // first, whatever the tower, as Hugging Face selects them (features[:, 1:]): a CLIP's class token, or a
  // SigLIP's first patch.
  int64_t tokens_per_image() const { return vision.num_positions() - (full_features ? 0 : 1); }
  // Columns of the projector's input: the encoder's hidden size times the feature layers.
  int64_t projector_input() const {
    return vision.hidden_size * static_cast<int64_t>(vision_feature_layers.size());
  }
  int64_t vision_parameters() const;     // every encoder tensor of the checkpoint (SigLIP's head included)
  int64_t projector_parameters() const;  // linear_1 (+ linear_2), with biases
  // Matmul FLOPs of one image's forward through the encoder layers used, and through the projector (a
  // step adds twice each again for the backward of what trains).
  double encoder_forward_flops_per_image() const;
  double projector_forward_flops_per_image() const;
};

}  // namespace forge::models
