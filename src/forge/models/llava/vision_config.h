// VisionConfig: the image encoder of a multimodal model, a Vision Transformer read from a Hugging Face
// `CLIPVisionConfig` (model_type "clip_vision_model") or `SiglipVisionConfig` ("siglip_vision_model").
//
// Both are pre-norm ViTs over non-overlapping patches (a patch embedding is a GEMM over flattened patches),
// with learned position embeddings, bidirectional multi-head attention with biases, LayerNorm and a
// GELU-family MLP with biases. They differ in what forge must reproduce exactly:
//   CLIP:   a class token before the patches (positions = patches + 1), a LayerNorm before the encoder
//           (`pre_layrnorm`, sic), a patch embedding without bias, quick_gelu by default, eps 1e-5;
//   SigLIP: no class token, no pre-encoder norm, a patch embedding with bias, gelu_pytorch_tanh, eps 1e-6,
//   and
//           an attention-pooling head (`vision_use_head`) that LLaVA-style models never read.
// Reading is strict as for the language models (models/llama/llama_config.h): unknown keys are errors,
// bookkeeping keys are ignored, keys that would change the computation are accepted only with the value
// forge implements (dropouts 0).
#pragma once

#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "forge/core/tensor.h"
#include "forge/kernels/ops.h"

namespace forge::models {

enum class VisionKind { clip, siglip };
// A GELU form by its Hugging Face name (hidden_act, projector_hidden_act); anything else fails with one line
// "<source>: key '<key>' is ...".
ops::GeluKind gelu_from_hf_name(std::string_view hf_name, std::string_view source, std::string_view key);

struct VisionConfig {
  VisionKind kind = VisionKind::clip;
  int64_t hidden_size = 0;
  int64_t intermediate_size = 0;
  int64_t num_hidden_layers = 0;
  int64_t num_attention_heads = 0;
  int64_t num_channels = 3;
  int64_t image_size = 0;
  int64_t patch_size = 0;
  ops::GeluKind hidden_act = ops::GeluKind::quick;
  double layer_norm_eps = 1e-5;
  // SigLIP: whether the checkpoint holds the attention-pooling head (`head.*`). forge carries its tensors
  // through import and export unchanged but never computes it (LLaVA reads the encoder's hidden states).
  bool use_head = false;
  // CLIP: projection_dim of CLIPVisionModelWithProjection, kept for a faithful round trip (0 = absent).
  int64_t projection_dim = 0;

  bool operator==(const VisionConfig& o) const;

  int64_t head_dim() const { return hidden_size / num_attention_heads; }
  int64_t patches_per_side() const { return image_size / patch_size; }
  int64_t num_patches() const { return patches_per_side() * patches_per_side(); }
  bool has_class_token() const { return kind == VisionKind::clip; }
  int64_t num_positions() const { return num_patches() + (has_class_token() ? 1 : 0); }
  int64_t patch_dim() const { return num_channels * patch_size * patch_size; }  // one flattened patch

  // Errors: one line "<source>: key '<prefix><key>' ...". prefix: where the object sits ("vision_config.").
  static VisionConfig from_json(const nlohmann::json& json, std::string_view source,
                                std::string_view prefix = "");
  nlohmann::json to_json() const;
  void validate(std::string_view source, std::string_view prefix = "") const;

  // The encoder's tensors under their Hugging Face names below `prefix` (e.g. "vision_tower.vision_model."),
  // in registration order; with_head: SigLIP's pooling head too.
  std::vector<std::pair<std::string, Shape>> tensor_shapes(const std::string& prefix, bool with_head) const;
  int64_t num_parameters(bool with_head) const;
  // Matmul FLOPs of one image through `layers` encoder layers (forward only): patch embedding, the layers'
  // projections and MLPs, and attention's two products over num_positions() (bidirectional: not halved).
  double forward_flops_per_image(int64_t layers) const;
};

}  // namespace forge::models
