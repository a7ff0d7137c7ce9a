// Gemma 2 and Gemma 3: the config readers (Hugging Face's defaults, layer_types and its patterns, both RoPE
// spellings, a faithful round trip, one line naming the key for what forge's Gemma does not implement) and
// the stack's Gemma options, each wired in (it moves the logits), the split backward bitwise under every
// recompute policy, and Hugging Face folders in and out. The golden tests against transformers are in
// llama_golden_test.cpp (the Gemma instantiation).
#include "forge/models/gemma/gemma.h"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>

#include "family_model_checks.h"
#include "op_harness.h"

namespace forge::gemma_test {
using namespace forge::models;
namespace {

using nlohmann::json;

json tiny(int generation) {
  json j = {{"architectures", {generation == 2 ? "Gemma2ForCausalLM" : "Gemma3ForCausalLM"}},
            {"model_type", generation == 2 ? "gemma2" : "gemma3_text"},
            {"hidden_size", 32},
            {"intermediate_size", 88},
            {"num_hidden_layers", 3},
            {"num_attention_heads", 4},
            {"num_key_value_heads", 2},
            {"head_dim", 8},
            {"vocab_size", 64},
            {"max_position_embeddings", 64},
            {"query_pre_attn_scalar", 4},
            {"sliding_window", 5},
            {"hidden_activation", "gelu_pytorch_tanh"},
            {"dtype", "bfloat16"},
            {"bos_token_id", 2}};
  if (generation == 2) j["attn_logit_softcapping"] = 1.0, j["final_logit_softcapping"] = 1.5;
  return j;
}

std::unique_ptr<ModelConfig> parse(const json& j) { return parse_model_config(j, "tiny.json"); }

TEST(GemmaConfig, EmptyConfigsTakeHuggingFacesDefaults) {
  const Gemma2Config two = Gemma2Config::from_json(json::object(), "empty.json");
  EXPECT_EQ(two.vocab_size, 256000);
  EXPECT_EQ(two.hidden_size, 2304);
  EXPECT_EQ(two.num_hidden_layers, 26);
  EXPECT_EQ(two.head_dim, 256);
  EXPECT_EQ(two.max_position_embeddings, 8192);
  EXPECT_TRUE(two.tie_word_embeddings);
  EXPECT_DOUBLE_EQ(two.query_pre_attn_scalar, 256);
  EXPECT_DOUBLE_EQ(two.attn_logit_softcapping, 50.0);
  EXPECT_DOUBLE_EQ(two.final_logit_softcapping, 30.0);
  EXPECT_EQ(two.sliding_window, 4096);
  EXPECT_DOUBLE_EQ(two.rope_theta, 10000.0);
  EXPECT_FALSE(two.qk_norm);
  ASSERT_EQ(two.sliding_layers.size(), 26u);
  EXPECT_TRUE(two.sliding_layers[0]);  // sliding first, then alternating
  EXPECT_FALSE(two.sliding_layers[1]);

  const Gemma3Config three = Gemma3Config::from_json(json::object(), "empty.json");
  EXPECT_EQ(three.vocab_size, 262208);
  EXPECT_EQ(three.max_position_embeddings, 131072);
  EXPECT_DOUBLE_EQ(three.attn_logit_softcapping, 0.0);
  EXPECT_DOUBLE_EQ(three.final_logit_softcapping, 0.0);
  EXPECT_DOUBLE_EQ(three.rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(three.local_rope_theta, 1e4);
  EXPECT_TRUE(three.qk_norm);
  for (size_t i = 0; i < three.sliding_layers.size(); ++i)
    EXPECT_EQ(three.sliding_layers[i], (i + 1) % 6 != 0) << i;  // every sixth layer global
}

TEST(GemmaConfig, ReadsBothRopeSpellingsAndThePattern) {
  json old = tiny(3);
  old["rope_theta"] = 5e5, old["rope_local_base_freq"] = 50.0;
  old["rope_scaling"] = {{"rope_type", "linear"}, {"factor", 8.0}};
  old["sliding_window_pattern"] = 2;
  const Gemma3Config a = Gemma3Config::from_json(old, "old.json");
  EXPECT_DOUBLE_EQ(a.rope_theta, 5e5);
  EXPECT_DOUBLE_EQ(a.local_rope_theta, 50.0);
  EXPECT_EQ(a.rope_scaling.kind, RopeScaling::Kind::linear);
  EXPECT_DOUBLE_EQ(a.rope_scaling.factor, 8.0);
  EXPECT_EQ(a.sliding_layers, (std::vector<bool>{true, false, true}));
  // transformers 5 writes it back as rope_parameters per layer type and layer_types: the same config.
  const json out = a.to_json();
  EXPECT_EQ(out["model_type"], "gemma3_text");
  EXPECT_EQ(out["rope_parameters"]["full_attention"]["rope_type"], "linear");
  EXPECT_EQ(out["rope_parameters"]["sliding_attention"]["rope_theta"], 50.0);
  const Gemma3Config back = Gemma3Config::from_json(out, "round trip");
  EXPECT_EQ(back.to_json(), out);
  EXPECT_TRUE(parse(out)->same_as(a));

  json two = tiny(2);
  two["rope_parameters"] = {{"rope_type", "default"}, {"rope_theta", 20000.0}};
  two["layer_types"] = {"full_attention", "sliding_attention", "full_attention"};
  two["final_logit_softcapping"] = nullptr;  // null: none
  const Gemma2Config b = Gemma2Config::from_json(two, "two.json");
  EXPECT_DOUBLE_EQ(b.rope_theta, 20000.0);
  EXPECT_EQ(b.sliding_layers, (std::vector<bool>{false, true, false}));
  EXPECT_DOUBLE_EQ(b.final_logit_softcapping, 0.0);
  EXPECT_DOUBLE_EQ(b.attn_logit_softcapping, 1.0);
  EXPECT_EQ(Gemma2Config::from_json(b.to_json(), "round trip").to_json(), b.to_json());
  EXPECT_EQ(parse(b.to_json())->architecture(), "Gemma2ForCausalLM");
  // Four norms per layer: the parameter count is the tensors' sizes summed.
  int64_t total = 0;
  for (const auto& [name, shape] : b.tensor_shapes()) {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    total += n;
  }
  EXPECT_EQ(total, b.num_parameters());
  EXPECT_NE(family_names().find("Gemma3ForCausalLM"), std::string::npos);
}

TEST(GemmaConfig, RefusesWhatItDoesNotImplementInOneLine) {
  auto expect_error = [](int generation, const char* key, json value,
                         std::initializer_list<std::string_view> fragments) {
    json j = tiny(generation);
    j[key] = value;
    testing::expect_error_containing([&] { parse(j); }, fragments);
  };
  expect_error(2, "hidden_activation", "gelu",
               {"tiny.json: key 'hidden_activation' is \"gelu\"", "tanh GELU"});
  expect_error(2, "attention_bias", true, {"tiny.json: key 'attention_bias' is true"});
  expect_error(3, "use_bidirectional_attention", true,
               {"tiny.json: key 'use_bidirectional_attention' is true"});
  expect_error(2, "layer_types", json::array({"full_attention"}),
               {"tiny.json: key 'layer_types' must be a list of"});
  expect_error(3, "layer_types", json::array({"full_attention", "chunked_attention", "full_attention"}),
               {"tiny.json: key 'layer_types' holds \"chunked_attention\""});
  expect_error(2, "attn_logit_softcapping", -1.0, {"tiny.json", "'attn_logit_softcapping'"});
  expect_error(2, "sliding_window", 0, {"tiny.json", "'sliding_window'"});
  expect_error(2, "rope_parameters", json{{"rope_type", "yarn"}, {"factor", 4.0}},
               {"tiny.json: key 'rope_parameters.rope_type' is \"yarn\""});
  expect_error(3, "rope_parameters", json{{"global", json::object()}},
               {"tiny.json: unknown key 'rope_parameters.global'"});
  expect_error(2, "rope_local_base_freq", 10.0, {"tiny.json: key 'rope_local_base_freq' is a Gemma 3 key"});
  expect_error(3, "query_pre_attn_scaler", 4, {"tiny.json: unknown key 'query_pre_attn_scaler'"});
  json other = tiny(3);
  other["model_type"] = "gemma3";  // the multimodal Gemma3ForConditionalGeneration's
  testing::expect_error_containing([&] { Gemma3Config::from_json(other, "tiny.json"); },
                                   {"tiny.json: key 'model_type' is \"gemma3\", not \"gemma3_text\""});
}

Tensor logits_of(json j, int64_t seq = 12) {
  auto model = build_model(*parse(j), {DType::f32, nn::Recompute::none});
  model->initialize(3);
  // Norm weights start at zero (scale 1): give them values, so that 1 + w and w differ visibly; matrices
  // 5x their initialisation, so that scores and logits reach the soft caps.
  ParameterStore& params = model->params();
  for (int i = 0; i < params.count(); ++i)
    for (int64_t k = 0; k < params.param(i).numel(); ++k) {
      float& w = params.param(i).f32()[k];
      w = params.info(i).shape.size() == 1 ? 0.05f * float(k % 7) - 0.1f : 5.0f * w;
    }
  return testing::family_logits(*model, seq);
}

// Every Gemma option moves the logits: the soft caps, the window, the attention scale, the local RoPE base.
// (Their values against transformers are the golden tests'.)
TEST(GemmaModel, EveryOptionIsWiredIn) {
  const Tensor two = logits_of(tiny(2)), three = logits_of(tiny(3));
  auto moved = [](const Tensor& base, json j, const char* what) {
    EXPECT_GT(testing::max_difference(logits_of(j), base), 1e-3) << what;
  };
  json j = tiny(2);
  j["attn_logit_softcapping"] = nullptr;
  moved(two, j, "attention soft cap");
  j = tiny(2), j["final_logit_softcapping"] = nullptr;
  moved(two, j, "final soft cap");
  j = tiny(2), j["sliding_window"] = nullptr;
  moved(two, j, "window");
  j = tiny(2), j["query_pre_attn_scalar"] = 8;
  moved(two, j, "attention scale");
  j = tiny(3), j["rope_local_base_freq"] = 1e6;
  moved(three, j, "local RoPE base");
  // A window at least as long as the sequence changes nothing, bitwise.
  j = tiny(3), j["sliding_window"] = 12;
  json none = tiny(3);
  none["sliding_window"] = nullptr;
  EXPECT_EQ(testing::max_difference(logits_of(j), logits_of(none)), 0.0);
}

TEST(GemmaModel, SplitBackwardIsBitwiseAndEveryNormLearns) {
  for (int generation : {2, 3})
    testing::expect_split_backward_bitwise(*parse(tiny(generation)), 12, [&](const ParameterStore& params) {
      for (int i = 0; i < params.count(); ++i) {
        const std::string& name = params.info(i).name;
        if (params.info(i).shape.size() != 1) continue;
        double sum = 0;
        for (int64_t k = 0; k < params.grad(i).numel(); ++k) sum += std::abs(params.grad(i).f32()[k]);
        EXPECT_GT(sum, 0.0) << name << " of Gemma " << generation;
      }
    });
}

TEST(GemmaModel, HuggingFaceFolderInAndOut) {
  testing::expect_hugging_face_round_trip("gemma2_tiny", "Gemma2ForCausalLM", "gemma2",
                                          "model.layers.2.post_feedforward_layernorm.weight",
                                          "model.layers.1.pre_feedforward_layernorm.weight");
  testing::expect_hugging_face_round_trip("gemma3_tiny", "Gemma3ForCausalLM", "gemma3_text",
                                          "model.layers.0.self_attn.q_norm.weight",
                                          "model.layers.2.self_attn.k_norm.weight");
}

}  // namespace
}  // namespace forge::gemma_test
