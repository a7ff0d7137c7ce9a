// Mistral: the config reader (Hugging Face's MistralConfig defaults, sliding_window absent, null or a size,
// a faithful round trip, one line naming the key for what forge's Mistral does not implement) and the
// sliding window on the decoder stack. The golden test against transformers is in llama_golden_test.cpp (the
// Mistral instantiation); KV-cache decoding over the window in kv_cache_test.cpp.
#include "forge/models/mistral/mistral.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "family_model_checks.h"
#include "forge/models/llama/llama_model.h"
#include "op_harness.h"

namespace forge::mistral_test {
using namespace forge::models;
namespace {

using nlohmann::json;

json tiny(json window = 5) {
  return json{{"architectures", {"MistralForCausalLM"}},
              {"model_type", "mistral"},
              {"hidden_size", 32},
              {"intermediate_size", 88},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"vocab_size", 64},
              {"max_position_embeddings", 64},
              {"sliding_window", window},
              {"attention_dropout", 0.0},
              {"hidden_act", "silu"},
              {"bos_token_id", 1},
              {"torch_dtype", "bfloat16"}};
}

TEST(MistralConfig, EmptyConfigTakesHuggingFacesDefaults) {
  const MistralConfig c = MistralConfig::from_json(json::object(), "empty.json");
  EXPECT_EQ(c.vocab_size, 32000);
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.intermediate_size, 14336);
  EXPECT_EQ(c.num_hidden_layers, 32);
  EXPECT_EQ(c.num_attention_heads, 32);
  EXPECT_EQ(c.num_key_value_heads, 8);
  EXPECT_EQ(c.head_dim, 128);
  EXPECT_EQ(c.max_position_embeddings, 131072);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-6);
  EXPECT_DOUBLE_EQ(c.rope_theta, 10000.0);
  EXPECT_EQ(c.attention_window, 4096);  // absent: HF's default window
  EXPECT_FALSE(c.qkv_bias);
  EXPECT_FALSE(c.qk_norm);
}

TEST(MistralConfig, ReadsAndRoundTripsWithAndWithoutAWindow) {
  for (const json& window : {json(5), json(nullptr)}) {
    const MistralConfig c = MistralConfig::from_json(tiny(window), "tiny.json");
    EXPECT_EQ(c.attention_window, window.is_null() ? 0 : 5);
    const json out = c.to_json();
    EXPECT_EQ(out["model_type"], "mistral");
    EXPECT_EQ(out["architectures"], json::array({"MistralForCausalLM"}));
    EXPECT_EQ(out["sliding_window"], window);
    const MistralConfig back = MistralConfig::from_json(out, "round trip");
    EXPECT_EQ(back, c);
    const auto parsed = parse_model_config(out, "registry");
    EXPECT_EQ(parsed->architecture(), "MistralForCausalLM");
    EXPECT_TRUE(parsed->same_as(c));
  }
  // The window is part of the architecture, but not of the parameters.
  const MistralConfig a = MistralConfig::from_json(tiny(5), "a"), b = MistralConfig::from_json(tiny(6), "b");
  EXPECT_FALSE(a.same_as(b));
  EXPECT_EQ(a.num_parameters(), b.num_parameters());
  EXPECT_NE(family_names().find("MistralForCausalLM"), std::string::npos);
}

TEST(MistralConfig, RefusesWhatItDoesNotImplementInOneLine) {
  auto expect_error = [](json j, std::initializer_list<std::string_view> fragments) {
    testing::expect_error_containing([&] { MistralConfig::from_json(j, "bad.json"); }, fragments);
  };
  expect_error(tiny(0), {"bad.json: key 'sliding_window' must be positive or null, got 0"});
  expect_error(tiny(-4), {"bad.json: key 'sliding_window' must be positive or null, got -4"});
  expect_error(tiny("4096"), {"bad.json", "'sliding_window'"});
  expect_error(tiny(2.5), {"bad.json", "'sliding_window'"});
  json types = tiny();
  types["layer_types"] = {"sliding_attention", "full_attention"};
  expect_error(types, {"bad.json: key 'layer_types'", "Ministral"});
  json other = tiny();
  other["model_type"] = "llama";
  expect_error(other, {"bad.json: key 'model_type' is \"llama\", not \"mistral\""});
  json typo = tiny();
  typo["sliding_windows"] = 4;
  expect_error(typo, {"bad.json: unknown key 'sliding_windows'"});
  json bias = tiny();
  bias["attention_bias"] = true;
  expect_error(bias, {"bad.json: key 'attention_bias' is true"});
}

// With sequences longer than the window the window changes the logits (and with a window as long as the
// sequence it changes nothing, bitwise); B then W equals the fused backward bitwise.
TEST(MistralModel, WindowMattersAndSplitBackwardIsBitwise) {
  auto logits_with = [](json window, int64_t seq) {
    auto model =
        build_model(MistralConfig::from_json(tiny(window), "tiny.json"), {DType::f32, nn::Recompute::none});
    model->initialize(3);
    return testing::family_logits(*model, seq);
  };
  EXPECT_GT(testing::max_difference(logits_with(5, 12), logits_with(nullptr, 12)), 1e-4);
  EXPECT_EQ(testing::max_difference(logits_with(12, 12), logits_with(nullptr, 12)), 0.0);
  testing::expect_split_backward_bitwise(MistralConfig::from_json(tiny(5), "tiny.json"), 12,
                                         [](const ParameterStore&) {});
}

// A Hugging Face Mistral folder with its window in and out (the window survives the trip: the logits are
// bitwise the fixture model's); one missing a weight is refused, naming it.
TEST(MistralModel, HuggingFaceFolderInAndOut) {
  testing::expect_hugging_face_round_trip("mistral_tiny_window", "MistralForCausalLM", "mistral",
                                          "model.layers.1.self_attn.o_proj.weight",
                                          "model.layers.0.mlp.up_proj.weight");
}

}  // namespace
}  // namespace forge::mistral_test
