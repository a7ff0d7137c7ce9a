#include "forge/models/llava/llava_config.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <nlohmann/json.hpp>
#include <vector>

#include "forge/core/error.h"
#include "forge/models/llava/llava_model.h"

namespace forge::llava_config_test {
using namespace forge::models;
namespace {

using nlohmann::json;

// The config.json of llava-hf/llava-1.5-7b-hf as published: only what differs from HF's class defaults.
json llava15_7b() {
  return json::parse(R"({
    "architectures": ["LlavaForConditionalGeneration"],
    "ignore_index": -100,
    "image_token_index": 32000,
    "model_type": "llava",
    "pad_token_id": 32001,
    "projector_hidden_act": "gelu",
    "text_config": {
      "_name_or_path": "lmsys/vicuna-7b-v1.5",
      "architectures": ["LlamaForCausalLM"],
      "max_position_embeddings": 4096,
      "model_type": "llama",
      "rms_norm_eps": 1e-05,
      "torch_dtype": "float16",
      "vocab_size": 32064
    },
    "tie_word_embeddings": false,
    "torch_dtype": "float16",
    "transformers_version": "4.36.0.dev0",
    "vision_config": {
      "hidden_size": 1024,
      "image_size": 336,
      "intermediate_size": 4096,
      "model_type": "clip_vision_model",
      "num_attention_heads": 16,
      "num_hidden_layers": 24,
      "patch_size": 14,
      "projection_dim": 768,
      "vocab_size": 32000
    },
    "vision_feature_layer": -2,
    "vision_feature_select_strategy": "default",
    "vocab_size": 32064
  })");
}

// A tiny SigLIP + LLaMA model of the kind forge's own multimodal job trains.
json tiny_siglip() {
  return json{{"architectures", {"LlavaForConditionalGeneration"}},
              {"model_type", "llava"},
              {"image_token_index", 3},
              {"vision_feature_layer", -1},
              {"vision_feature_select_strategy", "full"},
              {"vision_config",
               {{"model_type", "siglip_vision_model"},
                {"hidden_size", 32},
                {"intermediate_size", 64},
                {"num_hidden_layers", 2},
                {"num_attention_heads", 4},
                {"image_size", 32},
                {"patch_size", 8},
                {"vision_use_head", false}}},
              {"text_config",
               {{"model_type", "llama"},
                {"hidden_size", 48},
                {"intermediate_size", 96},
                {"num_hidden_layers", 2},
                {"num_attention_heads", 4},
                {"vocab_size", 300}}}};
}

void expect_error(const json& j, std::initializer_list<std::string> fragments) {
  try {
    LlavaConfig::from_json(j, "llava.json");
    ADD_FAILURE() << "expected an error containing " << *fragments.begin();
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    for (const std::string& f : fragments) EXPECT_NE(message.find(f), std::string::npos) << message;
  }
}

TEST(LlavaConfig, ReadsLlava15WithHuggingFaceDefaults) {
  const LlavaConfig c = LlavaConfig::from_json(llava15_7b(), "llava.json");
  EXPECT_EQ(c.vision.kind, VisionKind::clip);
  EXPECT_EQ(c.vision.hidden_size, 1024);
  EXPECT_EQ(c.vision.num_patches(), 576);
  EXPECT_EQ(c.vision.num_positions(), 577);
  EXPECT_EQ(c.vision.hidden_act, ops::GeluKind::quick);  // CLIP's default
  EXPECT_DOUBLE_EQ(c.vision.layer_norm_eps, 1e-5);
  // The text model takes LlamaConfig's defaults for what the file leaves out.
  EXPECT_EQ(c.text.hidden_size, 4096);
  EXPECT_EQ(c.text.intermediate_size, 11008);
  EXPECT_EQ(c.text.num_hidden_layers, 32);
  EXPECT_EQ(c.text.num_key_value_heads, 32);
  EXPECT_EQ(c.text.vocab_size, 32064);
  EXPECT_EQ(c.text.max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.text.rms_norm_eps, 1e-5);
  EXPECT_EQ(c.image_token_index, 32000);
  EXPECT_EQ(c.projector, ProjectorType::mlp2x_gelu);
  EXPECT_EQ(c.projector_hidden_act, ops::GeluKind::erf);
  EXPECT_EQ(c.feature_layer_indices(), std::vector<int64_t>{23});
  EXPECT_EQ(c.encoder_layers_used(), 23);  // the last layer's output feeds nothing
  EXPECT_EQ(c.tokens_per_image(), 576);    // "default" drops the class token
  EXPECT_EQ(c.projector_input(), 1024);
  // Published sizes: CLIP ViT-L/14-336 303.5M (with its unused post_layernorm), projector 21.0M, Vicuna-7B
  // with a 32064 vocabulary 6.74B.
  EXPECT_EQ(c.vision_parameters(), 303507456);
  EXPECT_EQ(c.projector_parameters(), 4096 * 1024 + 4096 + 4096 * 4096 + 4096);
  EXPECT_EQ(c.num_parameters(), c.vision_parameters() + c.projector_parameters() + c.text.num_parameters());
  EXPECT_EQ(c.shape().hidden, 4096);
}

TEST(LlavaConfig, RoundTripsThroughItsJson) {
  for (const json& j : {llava15_7b(), tiny_siglip()}) {
    const LlavaConfig c = LlavaConfig::from_json(j, "llava.json");
    const LlavaConfig back = LlavaConfig::from_json(c.to_json(), "back.json");
    EXPECT_EQ(back.to_json(), c.to_json());
    EXPECT_EQ(back.tensor_shapes(), c.tensor_shapes());
  }
}

// What a training step runs, by the parts that train, written out for the tiny model: 16 patches of
// 3x8x8 into width 32, two layers of 16 tokens (ffn 64); a projector 32 -> 48 -> 48 over 16 rows; a language
// model of width 48, ffn 96, 2 layers, vocabulary 300.
TEST(LlavaConfig, TrainedFlopsCountWhatTheStepRuns) {
  const LlavaConfig c = LlavaConfig::from_json(tiny_siglip(), "llava.json");
  const double encoder =
      2.0 * 16 * 192 * 32 + 2 * (2.0 * 16 * (4 * 32 * 32 + 2 * 32 * 64) + 4.0 * 16 * 16 * 32);
  const double projector = 2.0 * 16 * 32 * 48 + 2.0 * 16 * 48 * 48;
  EXPECT_DOUBLE_EQ(c.encoder_forward_flops_per_image(), encoder);
  EXPECT_DOUBLE_EQ(c.projector_forward_flops_per_image(), projector);
  using Parts = std::vector<std::string>;
  EXPECT_DOUBLE_EQ(c.trained_flops_per_image({}), 3 * encoder + 3 * projector);
  EXPECT_DOUBLE_EQ(c.trained_flops_per_image(Parts{"vision"}), encoder + 3 * projector);
  EXPECT_DOUBLE_EQ(c.trained_flops_per_image(Parts{"projector"}), 3 * encoder + 2 * projector);
  EXPECT_DOUBLE_EQ(c.trained_flops_per_image(Parts{"vision", "projector"}), encoder + projector);
  EXPECT_DOUBLE_EQ(c.trained_flops_per_image(Parts{"language"}), 3 * encoder + 3 * projector);
  // Per token: 6 FLOPs per matmul parameter (2 x (4 x 48 x 48 + 3 x 48 x 96) per layer, 300 x 48 for the
  // head) plus attention; a frozen language model skips its weight gradients (4 per parameter).
  const double parameters = 2 * (4 * 48 * 48 + 3 * 48 * 96) + 300 * 48, attention = 12.0 * 2 * 64 * 48;
  EXPECT_DOUBLE_EQ(c.trained_flops_per_token(64, {}), 6 * parameters + attention);
  EXPECT_DOUBLE_EQ(c.trained_flops_per_token(64, Parts{"vision"}), 6 * parameters + attention);
  EXPECT_DOUBLE_EQ(c.trained_flops_per_token(64, Parts{"language"}), 4 * parameters + attention);
  EXPECT_DOUBLE_EQ(c.flops_per_token(64), 6 * parameters + attention);
}

// "default" drops the first encoder position whatever the tower, as Hugging Face does (features[:, 1:]): for
// a SigLIP, which has no class token, its first patch. The image features are then the "full" ones without
// their first row, bit for bit.
TEST(LlavaConfig, DefaultSelectionDropsASiglipsFirstPatchAsHuggingFaceDoes) {
  json j = tiny_siglip();
  const LlavaConfig full = LlavaConfig::from_json(j, "llava.json");
  j["vision_feature_select_strategy"] = "default";
  const LlavaConfig dropped = LlavaConfig::from_json(j, "llava.json");
  EXPECT_EQ(dropped.tokens_per_image(), 15);
  EXPECT_EQ(dropped.to_json()["vision_feature_select_strategy"], "default");
  j.erase("vision_feature_select_strategy");  // Hugging Face's default when the key is missing
  EXPECT_EQ(LlavaConfig::from_json(j, "llava.json").tokens_per_image(), 15);

  LlavaModel a(full, nn::ComputeOptions{DType::f32, nn::Recompute::none}),
      b(dropped, nn::ComputeOptions{DType::f32, nn::Recompute::none});
  a.initialize(7), b.initialize(7);
  std::vector<float> pixels(3 * 32 * 32);
  for (size_t i = 0; i < pixels.size(); ++i) pixels[i] = std::sin(0.37f * static_cast<float>(i));
  const Tensor all = a.image_features(pixels.data(), 1), kept = b.image_features(pixels.data(), 1);
  ASSERT_EQ(all.shape()[0], 16);
  ASSERT_EQ(kept.shape()[0], 15);
  const int64_t width = all.shape()[1];
  EXPECT_EQ(0, std::memcmp(all.f32() + width, kept.f32(), sizeof(float) * 15 * width));
}

TEST(LlavaConfig, SiglipEncoderHasNoClassTokenAndABiasedPatchEmbedding) {
  const LlavaConfig c = LlavaConfig::from_json(tiny_siglip(), "llava.json");
  EXPECT_EQ(c.vision.kind, VisionKind::siglip);
  EXPECT_EQ(c.vision.hidden_act, ops::GeluKind::tanh);
  EXPECT_DOUBLE_EQ(c.vision.layer_norm_eps, 1e-6);
  EXPECT_EQ(c.vision.num_positions(), 16);
  EXPECT_EQ(c.tokens_per_image(), 16);  // no class token to keep under "full"
  EXPECT_EQ(c.encoder_layers_used(), 2);
  const auto shapes = c.tensor_shapes();
  auto has = [&](const std::string& name) {
    return std::any_of(shapes.begin(), shapes.end(), [&](const auto& s) { return s.first == name; });
  };
  EXPECT_TRUE(has("vision_tower.vision_model.embeddings.patch_embedding.bias"));
  EXPECT_FALSE(has("vision_tower.vision_model.embeddings.class_embedding"));
  EXPECT_FALSE(has("vision_tower.vision_model.pre_layrnorm.weight"));
  EXPECT_FALSE(has("vision_tower.vision_model.head.probe"));  // vision_use_head false
  EXPECT_TRUE(has("language_model.model.embed_tokens.weight"));
  EXPECT_TRUE(has("language_model.lm_head.weight"));
  EXPECT_TRUE(has("multi_modal_projector.linear_2.bias"));
  // With the head, its tensors are carried.
  json j = tiny_siglip();
  j["vision_config"]["vision_use_head"] = true;
  const LlavaConfig headed = LlavaConfig::from_json(j, "llava.json");
  EXPECT_EQ(headed.vision_parameters(),
            c.vision_parameters() + headed.vision.num_parameters(true) - headed.vision.num_parameters(false));
  EXPECT_GT(headed.vision.num_parameters(true), headed.vision.num_parameters(false));
}

TEST(LlavaConfig, FeatureLayerListsAndTheLinearProjector) {
  json j = tiny_siglip();
  j["vision_feature_layer"] = json::array({-2, 0});
  j["mm_projector_type"] = "linear";
  j["multimodal_projector_bias"] = false;
  const LlavaConfig c = LlavaConfig::from_json(j, "llava.json");
  EXPECT_EQ(c.feature_layer_indices(), (std::vector<int64_t>{1, 0}));
  EXPECT_EQ(c.encoder_layers_used(), 1);
  EXPECT_EQ(c.projector_input(), 64);
  EXPECT_EQ(c.projector_parameters(), 48 * 64);
  EXPECT_EQ(LlavaConfig::from_json(c.to_json(), "x").to_json()["vision_feature_layer"],
            j["vision_feature_layer"]);
}

TEST(LlavaConfig, BadInputIsRefusedWithOneLine) {
  auto with = [](const char* key, json value) {
    json j = tiny_siglip();
    j[key] = std::move(value);
    return j;
  };
  auto vision_with = [](const char* key, json value) {
    json j = tiny_siglip();
    j["vision_config"][key] = std::move(value);
    return j;
  };
  expect_error(with("image_token_indx", 3),
               {"llava.json", "unknown key 'image_token_indx'", "image_token_index"});
  expect_error(with("model_type", "llama"), {"model_type", "llava"});
  expect_error(with("image_token_index", 300), {"image_token_index", "300", "[0, 300)"});
  expect_error(with("image_token_id", 4), {"image_token_index", "image_token_id", "disagree"});
  expect_error(with("vision_feature_layer", 3), {"vision_feature_layer", "3", "[-3, 2]"});
  expect_error(with("vision_feature_layer", "last"), {"vision_feature_layer", "integer"});
  expect_error(with("vision_feature_select_strategy", "cls"), {"vision_feature_select_strategy", "cls"});
  expect_error(with("projector_hidden_act", "relu"), {"projector_hidden_act", "relu"});
  expect_error(with("mm_projector_type", "qformer"), {"mm_projector_type", "qformer"});
  expect_error(with("vocab_size", 301), {"vocab_size", "301", "text_config.vocab_size"});
  expect_error(vision_with("model_type", "vit"), {"vision_config.model_type", "vit"});
  expect_error(vision_with("patch_sise", 8), {"unknown key 'vision_config.patch_sise'", "patch_size"});
  expect_error(vision_with("patch_size", 7), {"vision_config.image_size", "multiple", "patch_size"});
  expect_error(vision_with("num_attention_heads", 5), {"vision_config.hidden_size", "num_attention_heads"});
  expect_error(vision_with("hidden_size", -4), {"vision_config.hidden_size"});
  expect_error(vision_with("hidden_size", int64_t{1} << 40), {"vision_config.hidden_size", "limit"});
  expect_error(vision_with("attention_dropout", 0.1), {"vision_config.attention_dropout", "dropout"});
  expect_error(vision_with("projection_dim", 8), {"projection_dim", "siglip"});
  expect_error(vision_with("layer_norm_eps", 0), {"vision_config.layer_norm_eps"});
  json text = tiny_siglip();
  text["text_config"]["model_type"] = "mistral";
  expect_error(text, {"text_config.model_type", "mistral", "llama"});
  text = tiny_siglip();
  text["text_config"]["hidden_act"] = "gelu";
  expect_error(text, {"text_config", "hidden_act"});
  expect_error(json::array(), {"llava.json", "object"});
}

}  // namespace
}  // namespace forge::llava_config_test
