// Qwen2: the config reader (Hugging Face's Qwen2Config defaults, the keys only Qwen2 has, transformers 5's
// rope_parameters, a faithful round trip, one line for what forge's Qwen2 does not implement), the q/k/v
// biases on the decoder stack, and Hugging Face folders in and out. The golden test against transformers is
// in llama_golden_test.cpp (the Qwen2 instantiation).
#include "forge/models/qwen2/qwen2.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <vector>

#include "family_model_checks.h"
#include "forge/ckpt/safetensors.h"
#include "forge/models/llama/llama_model.h"
#include "forge/models/pretrained.h"
#include "op_harness.h"

namespace forge::qwen2_test {
using namespace forge::models;
namespace {

using nlohmann::json;

json tiny() {
  return json{{"architectures", {"Qwen2ForCausalLM"}},
              {"model_type", "qwen2"},
              {"hidden_size", 32},
              {"intermediate_size", 88},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"vocab_size", 64},
              {"max_position_embeddings", 64},
              {"use_sliding_window", false},
              {"sliding_window", nullptr},
              {"max_window_layers", 28},
              {"attention_dropout", 0.0},
              {"hidden_act", "silu"},
              {"bos_token_id", 1},
              {"torch_dtype", "bfloat16"},
              {"use_cache", true},
              {"initializer_range", 0.02}};
}

TEST(Qwen2Config, EmptyConfigTakesHuggingFacesDefaults) {
  const Qwen2Config c = Qwen2Config::from_json(json::object(), "empty.json");
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
  EXPECT_FALSE(c.tie_word_embeddings);
  EXPECT_TRUE(c.qkv_bias);
  EXPECT_EQ(c.sliding_window, 4096);
  EXPECT_EQ(c.max_window_layers, 28);
}

TEST(Qwen2Config, ReadsAndRoundTrips) {
  const Qwen2Config c = Qwen2Config::from_json(tiny(), "tiny.json");
  EXPECT_EQ(c.architecture(), "Qwen2ForCausalLM");
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.num_key_value_heads, 2);
  const json out = c.to_json();
  EXPECT_EQ(out["model_type"], "qwen2");
  EXPECT_EQ(out["architectures"], json::array({"Qwen2ForCausalLM"}));
  EXPECT_FALSE(out.contains("attention_bias"));  // a Qwen2's biases are not a key
  EXPECT_EQ(out["use_sliding_window"], false);
  const Qwen2Config back = Qwen2Config::from_json(out, "round trip");
  EXPECT_EQ(back, c);
  EXPECT_EQ(back.to_json(), out);
  // Through the registry, by `architectures`.
  const auto parsed = parse_model_config(out, "registry");
  EXPECT_EQ(parsed->architecture(), "Qwen2ForCausalLM");
  EXPECT_TRUE(parsed->same_as(c));
  // A LLaMA of the same sizes is another architecture (no biases).
  LlamaConfig llama = static_cast<const LlamaConfig&>(c);
  llama.qkv_bias = false;
  EXPECT_FALSE(llama.same_as(c));
  EXPECT_EQ(c.num_parameters() - llama.num_parameters(), 2 * (4 * 8 + 2 * 2 * 8));
}

// transformers 5 writes rope_theta (and any scaling) inside rope_parameters; LLaMA configs too.
TEST(Qwen2Config, ReadsRopeParameters) {
  json j = tiny();
  j["rope_parameters"] = {{"rope_theta", 1000000.0}, {"rope_type", "default"}};
  EXPECT_DOUBLE_EQ(Qwen2Config::from_json(j, "v5.json").rope_theta, 1e6);
  j["rope_theta"] = 1000000.0;
  EXPECT_DOUBLE_EQ(Qwen2Config::from_json(j, "both.json").rope_theta, 1e6);
  j["rope_theta"] = 10000.0;
  testing::expect_error_containing(
      [&] { Qwen2Config::from_json(j, "both.json"); },
      {"both.json: keys 'rope_theta' (10000.0) and 'rope_parameters.rope_theta'", "disagree"});
  json llama3 = {{"hidden_size", 32},
                 {"intermediate_size", 88},
                 {"num_hidden_layers", 2},
                 {"num_attention_heads", 4},
                 {"vocab_size", 64}};
  llama3["rope_parameters"] = {{"rope_theta", 500000.0},  {"rope_type", "llama3"},
                               {"factor", 8.0},           {"low_freq_factor", 1.0},
                               {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 8192}};
  const LlamaConfig l = LlamaConfig::from_json(llama3, "llama3.json");
  EXPECT_DOUBLE_EQ(l.rope_theta, 5e5);
  EXPECT_EQ(l.rope_scaling.kind, RopeScaling::Kind::llama3);
  EXPECT_DOUBLE_EQ(l.rope_scaling.factor, 8.0);
}

TEST(Qwen2Config, RefusesWhatItDoesNotImplementInOneLine) {
  auto expect_error = [](json j, std::initializer_list<std::string_view> fragments) {
    testing::expect_error_containing([&] { Qwen2Config::from_json(j, "bad.json"); }, fragments);
  };
  json window = tiny();
  window["use_sliding_window"] = true;
  expect_error(window, {"bad.json: key 'use_sliding_window' is true", "full attention only"});
  json types = tiny();
  types["layer_types"] = {"full_attention", "sliding_attention"};
  expect_error(types, {"bad.json: key 'layer_types' holds \"sliding_attention\""});
  json other = tiny();
  other["model_type"] = "llama";
  expect_error(other, {"bad.json: key 'model_type' is \"llama\", not \"qwen2\""});
  json typo = tiny();
  typo["num_hiden_layers"] = 2;
  expect_error(typo, {"bad.json: unknown key 'num_hiden_layers'", "num_hidden_layers"});
  json act = tiny();
  act["hidden_act"] = "gelu";
  expect_error(act, {"bad.json: key 'hidden_act' is \"gelu\""});
  json heads = tiny();
  heads["num_attention_heads"] = 5;
  expect_error(heads, {"bad.json", "num_attention_heads"});
}

// The model is the one decoder stack with q/k/v biases: they change the output, get gradients, and the
// split backward (B then W) gives the fused order's gradients bit for bit.
TEST(Qwen2Model, BiasesTrainAndSplitBackwardIsBitwise) {
  const Qwen2Config config = Qwen2Config::from_json(tiny(), "tiny.json");
  auto model = build_model(config, {DType::f32, nn::Recompute::none});
  model->initialize(3);
  std::vector<int32_t> ids(24), targets(24);
  for (int i = 0; i < 24; ++i) ids[i] = (i * 7 + 3) % 64, targets[i] = (i * 5 + 1) % 64;
  const Tensor before = model->logits(ids.data(), 2, 12);
  ParameterStore& params = model->params();
  const int q_bias = params.find("model.layers.0.self_attn.q_proj.bias");
  ASSERT_GE(q_bias, 0);
  EXPECT_FALSE(params.info(q_bias).weight_decay);
  params.param(q_bias).f32()[0] = 0.5f;
  params.refresh_bf16();
  const Tensor after = model->logits(ids.data(), 2, 12);
  double moved = 0;
  for (int64_t i = 0; i < before.numel(); ++i)
    moved = std::max<double>(moved, std::abs(after.f32()[i] - before.f32()[i]));
  EXPECT_GT(moved, 1e-4);

  for (nn::Recompute recompute : {nn::Recompute::none, nn::Recompute::selective, nn::Recompute::full}) {
    auto fused = build_model(config, {DType::f32, recompute}),
         split = build_model(config, {DType::f32, recompute});
    fused->initialize(3), split->initialize(3);
    fused->params().zero_grads(), split->params().zero_grads();
    fused->forward_backward(ids.data(), targets.data(), 2, 12, 0.1f);
    split->params().begin_grad_step(1);
    std::unique_ptr<StageActivations> saved;
    split->forward({ids.data(), targets.data(), 2, 12, 0.1f}, Tensor(), &saved);
    split->backward_input(Tensor(), *saved);
    split->backward_weight(*saved);
    const Tensor a = fused->params().grads(), b = split->params().grads();
    EXPECT_EQ(0, std::memcmp(a.raw(), b.raw(), a.bytes())) << nn::recompute_name(recompute);
    const int id = fused->params().find("model.layers.1.self_attn.k_proj.bias");
    double norm = 0;
    for (int64_t i = 0; i < fused->params().grad(id).numel(); ++i)
      norm += std::abs(fused->params().grad(id).f32()[i]);
    EXPECT_GT(norm, 0.0) << "the k bias gets a gradient";
  }
}

// A Hugging Face Qwen2 folder (the fixture's weights from transformers) loads, gives the fixture's logits,
// and exports back to a folder that transformers would read as Qwen2 and forge reloads bit for bit.
TEST(Qwen2Model, HuggingFaceFolderInAndOut) {
  // A folder missing a bias is refused, naming it (a LLaMA's weights under a Qwen2 config).
  testing::expect_hugging_face_round_trip("qwen2_tiny", "Qwen2ForCausalLM", "qwen2",
                                          "model.layers.1.self_attn.v_proj.bias",
                                          "model.layers.0.self_attn.k_proj.bias");
}

}  // namespace
}  // namespace forge::qwen2_test
