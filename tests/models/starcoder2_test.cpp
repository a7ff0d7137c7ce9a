// StarCoder2: the config reader (Hugging Face's Starcoder2Config defaults, a faithful round trip, one line
// naming the key for what forge's StarCoder2 does not implement) and its parts on the decoder stack
// (LayerNorms with biases, the ungated GELU MLP, biases on every projection). The golden tests against
// transformers are in llama_golden_test.cpp (the StarCoder2 instantiation); KV-cache decoding in
// kv_cache_test.cpp; the parallel layouts in trainer_mpi_test.cpp.
#include "forge/models/starcoder2/starcoder2.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "family_model_checks.h"
#include "op_harness.h"

namespace forge::starcoder2_test {
using namespace forge::models;
namespace {

using nlohmann::json;

json tiny() {
  return json{{"architectures", {"Starcoder2ForCausalLM"}},
              {"model_type", "starcoder2"},
              {"hidden_size", 32},
              {"intermediate_size", 88},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"vocab_size", 64},
              {"max_position_embeddings", 64},
              {"norm_epsilon", 1e-5},
              {"hidden_act", "gelu_pytorch_tanh"},
              {"use_bias", true},
              {"sliding_window", nullptr},
              {"residual_dropout", 0.1},
              {"embedding_dropout", 0.1},
              {"attention_dropout", 0.1},
              {"tie_word_embeddings", false},
              {"bos_token_id", 0},
              {"torch_dtype", "bfloat16"}};
}

TEST(Starcoder2Config, EmptyConfigTakesHuggingFacesDefaults) {
  const Starcoder2Config c = Starcoder2Config::from_json(json::object(), "empty.json");
  EXPECT_EQ(c.vocab_size, 49152);
  EXPECT_EQ(c.hidden_size, 3072);
  EXPECT_EQ(c.intermediate_size, 12288);
  EXPECT_EQ(c.num_hidden_layers, 30);
  EXPECT_EQ(c.num_attention_heads, 24);
  EXPECT_EQ(c.num_key_value_heads, 2);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.max_position_embeddings, 4096);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_TRUE(c.tie_word_embeddings);
  EXPECT_TRUE(c.use_bias);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_EQ(c.hidden_act, ops::GeluKind::tanh);
  EXPECT_EQ(c.attention_window, 0);
  // What transformers counts for Starcoder2ForCausalLM(Starcoder2Config()) (StarCoder2-3B's shape, tied).
  EXPECT_EQ(c.num_parameters(), 3030371328);
}

TEST(Starcoder2Config, ReadsAndRoundTrips) {
  for (bool bias : {true, false})
    for (const json& window : {json(nullptr), json(5)}) {
      json j = tiny();
      j["use_bias"] = bias, j["sliding_window"] = window,
      j["hidden_act"] = bias ? "gelu" : "gelu_pytorch_tanh";
      const Starcoder2Config c = Starcoder2Config::from_json(j, "tiny.json");
      EXPECT_EQ(c.use_bias, bias);
      EXPECT_EQ(c.attention_window, window.is_null() ? 0 : 5);
      EXPECT_EQ(c.hidden_act, bias ? ops::GeluKind::erf : ops::GeluKind::tanh);
      EXPECT_DOUBLE_EQ(c.residual_dropout, 0.1);
      const json out = c.to_json();
      EXPECT_EQ(out["model_type"], "starcoder2");
      EXPECT_EQ(out["architectures"], json::array({"Starcoder2ForCausalLM"}));
      EXPECT_EQ(out["sliding_window"], window);
      EXPECT_EQ(out["use_bias"], bias);
      EXPECT_FALSE(out.contains("rms_norm_eps"));
      const Starcoder2Config back = Starcoder2Config::from_json(out, "round trip");
      EXPECT_EQ(back, c);
      const auto parsed = parse_model_config(out, "registry");
      EXPECT_EQ(parsed->architecture(), "Starcoder2ForCausalLM");
      EXPECT_TRUE(parsed->same_as(c));
      // Parameters: every tensor name's shape, summed, is the count (biases and LayerNorm biases included).
      int64_t total = 0;
      for (const auto& [name, shape] : c.tensor_shapes()) total += shape_numel(shape);
      EXPECT_EQ(total, c.num_parameters());
    }
  EXPECT_NE(family_names().find("Starcoder2ForCausalLM"), std::string::npos);
}

TEST(Starcoder2Config, RefusesWhatItDoesNotImplementInOneLine) {
  auto expect_error = [](json j, std::initializer_list<std::string_view> fragments) {
    testing::expect_error_containing([&] { Starcoder2Config::from_json(j, "bad.json"); }, fragments);
  };
  json j = tiny();
  j["hidden_act"] = "silu";
  expect_error(j, {"bad.json: key 'hidden_act' is \"silu\"", "gelu_pytorch_tanh"});
  j = tiny(), j["rms_norm_eps"] = 1e-5;
  expect_error(j, {"bad.json: key 'rms_norm_eps' is not a Starcoder2ForCausalLM key", "norm_epsilon"});
  j = tiny(), j["norm_epsilon"] = 0;
  expect_error(j, {"bad.json", "'norm_epsilon'"});
  j = tiny(), j["residual_dropout"] = 1.5;
  expect_error(j, {"bad.json: key 'residual_dropout' must be in [0, 1), got 1.5"});
  j = tiny(), j["sliding_window"] = 0;
  expect_error(j, {"bad.json: key 'sliding_window' must be positive or null, got 0"});
  j = tiny(), j["use_bias"] = "yes";
  expect_error(j, {"bad.json", "'use_bias'"});
  j = tiny(), j["model_type"] = "llama";
  expect_error(j, {"bad.json: key 'model_type' is \"llama\", not \"starcoder2\""});
  j = tiny(), j["use_biases"] = true;
  expect_error(j, {"bad.json: unknown key 'use_biases'"});
}

std::unique_ptr<Model> model_of(const json& j,
                                nn::ComputeOptions options = {DType::f32, nn::Recompute::none}) {
  auto model = build_model(Starcoder2Config::from_json(j, "tiny.json"), options);
  model->initialize(3);
  // Biases start at zero: give them values, so that they take part.
  ParameterStore& params = model->params();
  for (int i = 0; i < params.count(); ++i)
    if (params.info(i).name.ends_with(".bias"))
      for (int64_t k = 0; k < params.param(i).numel(); ++k)
        params.param(i).f32()[k] = 0.05f * static_cast<float>((k * 37 + i * 11) % 17 - 8);
  params.refresh_bf16();
  return model;
}

// The window and the GELU's form move the logits; a window as long as the sequence changes nothing, bitwise.
// (The biases' effect, and every value, are the golden tests'.)
TEST(Starcoder2Model, EveryOptionIsWiredIn) {
  const Tensor base = testing::family_logits(*model_of(tiny()), 12);
  json j = tiny();
  j["sliding_window"] = 5;
  EXPECT_GT(testing::max_difference(testing::family_logits(*model_of(j), 12), base), 1e-4) << "window";
  j = tiny(), j["hidden_act"] = "gelu";
  EXPECT_GT(testing::max_difference(testing::family_logits(*model_of(j), 12), base), 0.0) << "GELU form";
  j = tiny(), j["sliding_window"] = 12;
  EXPECT_EQ(testing::max_difference(testing::family_logits(*model_of(j), 12), base), 0.0);
}

// B then W equals the fused backward bitwise under every recompute policy, and every LayerNorm weight and
// bias and every projection's bias gets a gradient.
TEST(Starcoder2Model, SplitBackwardIsBitwiseAndEveryBiasLearns) {
  testing::expect_split_backward_bitwise(
      Starcoder2Config::from_json(tiny(), "tiny.json"), 12, [&](const ParameterStore& params) {
        int vectors = 0;
        for (int i = 0; i < params.count(); ++i) {
          if (params.info(i).shape.size() != 1) continue;
          double sum = 0;
          for (int64_t k = 0; k < params.grad(i).numel(); ++k) sum += std::abs(params.grad(i).f32()[k]);
          EXPECT_GT(sum, 0.0) << params.info(i).name;
          ++vectors;
        }
        EXPECT_EQ(vectors, 2 * 10 + 2);  // per layer 4 norm vectors and 6 biases; the final norm's 2
      });
}

// bf16 activations and residual stream (what train.dtype = bf16 runs): the norms write bf16 operands, the
// MLP keeps c_fc's output in bf16, and the logits stay close to the fp32 model's.
TEST(Starcoder2Model, Bf16ActivationsStayCloseToFp32) {
  nn::ComputeOptions bf16{DType::bf16, nn::Recompute::none};
  bf16.activation_dtype = DType::bf16, bf16.residual_dtype = DType::bf16;
  const Tensor want = testing::family_logits(*model_of(tiny()), 12);
  const Tensor got = testing::family_logits(*model_of(tiny(), bf16), 12);
  std::vector<double> ref(want.f32(), want.f32() + want.numel());
  EXPECT_LT(testing::dissimilarity(got.f32(), ref.data(), ref.size()), 1e-3);
}

TEST(Starcoder2Model, HuggingFaceFolderInAndOut) {
  testing::expect_hugging_face_round_trip("starcoder2_tiny", "Starcoder2ForCausalLM", "starcoder2",
                                          "model.layers.1.mlp.c_fc.bias", "model.norm.bias");
  testing::expect_hugging_face_round_trip("starcoder2_tiny_tied_window", "Starcoder2ForCausalLM",
                                          "starcoder2", "model.layers.0.mlp.c_proj.weight",
                                          "model.layers.1.post_attention_layernorm.bias");
}

}  // namespace
}  // namespace forge::starcoder2_test
