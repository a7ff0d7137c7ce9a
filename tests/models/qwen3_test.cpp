// Qwen3: the config reader (Hugging Face's Qwen3Config defaults, a faithful round trip, one line naming the
// key for what forge's Qwen3 does not implement) and the QK-norm on the decoder stack. The golden test
// against transformers is in llama_golden_test.cpp (the Qwen3 instantiation).
#include "forge/models/qwen3/qwen3.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "family_model_checks.h"
#include "forge/models/llama/llama_model.h"
#include "op_harness.h"

namespace forge::qwen3_test {
using namespace forge::models;
namespace {

using nlohmann::json;

json tiny() {
  return json{{"architectures", {"Qwen3ForCausalLM"}},
              {"model_type", "qwen3"},
              {"hidden_size", 32},
              {"intermediate_size", 88},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"head_dim", 12},
              {"vocab_size", 64},
              {"max_position_embeddings", 64},
              {"attention_bias", false},
              {"use_sliding_window", false},
              {"sliding_window", nullptr},
              {"max_window_layers", 28},
              {"layer_types", {"full_attention", "full_attention"}},
              {"attention_dropout", 0.0},
              {"hidden_act", "silu"},
              {"torch_dtype", "bfloat16"}};
}

TEST(Qwen3Config, EmptyConfigTakesHuggingFacesDefaults) {
  const Qwen3Config c = Qwen3Config::from_json(json::object(), "empty.json");
  EXPECT_EQ(c.vocab_size, 151936);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 22016);
  EXPECT_EQ(c.num_hidden_layers, 32);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 32);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.max_position_embeddings, 32768);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_TRUE(c.qk_norm);
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_EQ(c.attention_window, 0);
  // head_dim is 128 whatever hidden_size / num_attention_heads is (unlike LLaMA's default).
  EXPECT_EQ(Qwen3Config::from_json(
                json{{"hidden_size", 64}, {"num_attention_heads", 4}, {"num_key_value_heads", 4}}, "x")
                .head_dim,
            128);
}

TEST(Qwen3Config, ReadsAndRoundTrips) {
  const Qwen3Config c = Qwen3Config::from_json(tiny(), "tiny.json");
  EXPECT_EQ(c.architecture(), "Qwen3ForCausalLM");
  EXPECT_EQ(c.head_dim, 12);
  const json out = c.to_json();
  EXPECT_EQ(out["model_type"], "qwen3");
  EXPECT_EQ(out["attention_bias"], false);
  EXPECT_EQ(out["use_sliding_window"], false);
  const Qwen3Config back = Qwen3Config::from_json(out, "round trip");
  EXPECT_EQ(back, c);
  EXPECT_EQ(back.to_json(), out);
  const auto parsed = parse_model_config(out, "registry");
  EXPECT_EQ(parsed->architecture(), "Qwen3ForCausalLM");
  EXPECT_TRUE(parsed->same_as(c));
  // The QK-norm weights are the only parameters a LLaMA of the same sizes lacks: 2 x head_dim per layer.
  LlamaConfig llama = static_cast<const LlamaConfig&>(c);
  llama.qk_norm = false;
  EXPECT_FALSE(llama.same_as(c));
  EXPECT_EQ(c.num_parameters() - llama.num_parameters(), 2 * 2 * 12);
  EXPECT_NE(family_names().find("Qwen3ForCausalLM"), std::string::npos);
}

TEST(Qwen3Config, RefusesWhatItDoesNotImplementInOneLine) {
  auto expect_error = [](json j, std::initializer_list<std::string_view> fragments) {
    testing::expect_error_containing([&] { Qwen3Config::from_json(j, "bad.json"); }, fragments);
  };
  json window = tiny();
  window["use_sliding_window"] = true;
  expect_error(window, {"bad.json: key 'use_sliding_window' is true", "Qwen3", "full attention only"});
  json types = tiny();
  types["layer_types"] = {"full_attention", "sliding_attention"};
  expect_error(types, {"bad.json: key 'layer_types' holds \"sliding_attention\""});
  json bias = tiny();
  bias["attention_bias"] = true;
  expect_error(bias, {"bad.json: key 'attention_bias' is true", "no attention biases"});
  json size = tiny();
  size["sliding_window"] = -3;
  expect_error(size, {"bad.json", "'sliding_window'"});
  json other = tiny();
  other["model_type"] = "qwen2";
  expect_error(other, {"bad.json: key 'model_type' is \"qwen2\", not \"qwen3\""});
  json typo = tiny();
  typo["q_norm_eps"] = 1e-6;
  expect_error(typo, {"bad.json: unknown key 'q_norm_eps'"});
  json head = tiny();
  head["head_dim"] = 7;
  expect_error(head, {"bad.json: key 'head_dim' must be even"});
}

// The QK-norm weights change the output and get gradients (each layer's q_norm and k_norm), without weight
// decay; B then W equals the fused backward bitwise.
TEST(Qwen3Model, QkNormTrainsAndSplitBackwardIsBitwise) {
  const Qwen3Config config = Qwen3Config::from_json(tiny(), "tiny.json");
  auto model = build_model(config, {DType::f32, nn::Recompute::none});
  model->initialize(3);
  const Tensor before = testing::family_logits(*model, 12);
  ParameterStore& params = model->params();
  const int q_norm = params.find("model.layers.0.self_attn.q_norm.weight");
  ASSERT_GE(q_norm, 0);
  EXPECT_FALSE(params.info(q_norm).weight_decay);
  EXPECT_EQ(params.info(q_norm).shape, (Shape{12}));
  params.param(q_norm).f32()[1] = 1.5f;
  params.refresh_bf16();
  EXPECT_GT(testing::max_difference(testing::family_logits(*model, 12), before), 1e-5);

  testing::expect_split_backward_bitwise(config, 12, [](const ParameterStore& p) {
    for (const char* name :
         {"model.layers.1.self_attn.q_norm.weight", "model.layers.1.self_attn.k_norm.weight"}) {
      const Tensor& g = p.grad(p.find(name));
      double norm = 0;
      for (int64_t i = 0; i < g.numel(); ++i) norm += std::abs(g.f32()[i]);
      EXPECT_GT(norm, 0.0) << name;
    }
  });
}

// A Hugging Face Qwen3 folder in and out; one missing a QK-norm weight is refused, naming it.
TEST(Qwen3Model, HuggingFaceFolderInAndOut) {
  testing::expect_hugging_face_round_trip("qwen3_tiny", "Qwen3ForCausalLM", "qwen3",
                                          "model.layers.1.self_attn.k_norm.weight",
                                          "model.layers.0.self_attn.q_norm.weight");
}

}  // namespace
}  // namespace forge::qwen3_test
