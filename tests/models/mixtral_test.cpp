// Mixtral and Qwen3-MoE, the MoE families on the LLaMA-family readers: Mixtral's parts on the decoder stack
// (the router and the experts under the released checkpoints' names, no correction bias) and a Hugging Face
// folder in and out. The config reader and the golden tests against transformers are in llama_golden_test.cpp
// (the Mixtral instantiation and MixtralGolden); KV-cache decoding in kv_cache_test.cpp; the parallel
// layouts, expert parallelism included, in trainer_mpi_test.cpp.
#include "forge/models/mixtral/mixtral.h"

#include <gtest/gtest.h>

#include <cmath>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "family_model_checks.h"
#include "forge/models/qwen3_moe/qwen3_moe.h"
#include "op_harness.h"

namespace forge::mixtral_test {
using namespace forge::models;
namespace {

using nlohmann::json;

json tiny() {
  return json{{"architectures", {"MixtralForCausalLM"}},
              {"model_type", "mixtral"},
              {"hidden_size", 32},
              {"intermediate_size", 24},
              {"num_hidden_layers", 2},
              {"num_attention_heads", 4},
              {"num_key_value_heads", 2},
              {"vocab_size", 64},
              {"max_position_embeddings", 64},
              {"num_local_experts", 4},
              {"num_experts_per_tok", 2}};
}

// Hugging Face's MixtralConfig defaults fill what the file leaves out: Mixtral-8x7B, full attention.
TEST(MixtralConfig, HuggingFaceDefaults) {
  const MixtralConfig c = MixtralConfig::from_json(json{{"model_type", "mixtral"}}, "empty.json");
  EXPECT_EQ(c.hidden_size, 4096);
  EXPECT_EQ(c.num_local_experts, 8);
  EXPECT_EQ(c.num_experts_per_tok, 2);
  EXPECT_EQ(c.attention_window, 0);
  EXPECT_DOUBLE_EQ(c.rope_theta, 1e6);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, 1e-5);
  // Mixtral-8x7B: 46.7B parameters, of which a token runs 12.9B: 12.75B in matrix products (two experts,
  // the router, the attention, the head; the embedding's 0.13B are a lookup).
  EXPECT_NEAR(static_cast<double>(c.num_parameters()), 46.70e9, 0.01e9);
  EXPECT_NEAR(c.flops_per_token(1) / 6.0, 12.75e9, 0.01e9);
}

// B then W equals the fused backward bitwise under every recompute policy, the router and every expert
// learn, and there is no correction bias.
TEST(MixtralModel, SplitBackwardIsBitwiseAndEveryExpertLearns) {
  const MixtralConfig config = MixtralConfig::from_json(tiny(), "tiny.json");
  testing::expect_split_backward_bitwise(config, 12, [&](const ParameterStore& params) {
    int experts = 0;
    for (int i = 0; i < params.count(); ++i) {
      const std::string& name = params.info(i).name;
      EXPECT_EQ(name.find("e_score_correction_bias"), std::string::npos) << name;
      if (name.find("block_sparse_moe.") == std::string::npos) continue;
      double sum = 0;
      for (int64_t k = 0; k < params.grad(i).numel(); ++k) sum += std::abs(params.grad(i).f32()[k]);
      EXPECT_GT(sum, 0.0) << name;
      ++experts;
    }
    EXPECT_EQ(experts, 2 * (1 + 4 * 3));  // per layer the router and four experts' w1, w3, w2
  });
}

TEST(Qwen3MoeModel, HuggingFaceFolderInAndOut) {
  testing::expect_hugging_face_round_trip("qwen3_moe_tiny", "Qwen3MoeForCausalLM", "qwen3_moe",
                                          "model.layers.0.mlp.down_proj.weight",
                                          "model.layers.1.mlp.experts.3.down_proj.weight");
  testing::expect_hugging_face_round_trip("qwen3_moe_tiny_tied", "Qwen3MoeForCausalLM", "qwen3_moe",
                                          "model.layers.0.mlp.experts.1.up_proj.weight",
                                          "model.layers.1.mlp.gate.weight");
}

// Hugging Face's Qwen3MoeConfig defaults; Qwen3-30B-A3B's published shape: 30.5B parameters, 3.3B per token.
TEST(Qwen3MoeConfig, HuggingFaceDefaultsAndQwen3_30B_A3B) {
  const Qwen3MoeConfig d = Qwen3MoeConfig::from_json(json{{"model_type", "qwen3_moe"}}, "empty.json");
  EXPECT_EQ(d.num_experts, 128);
  EXPECT_EQ(d.num_experts_per_tok, 8);
  EXPECT_EQ(d.head_dim, 64);  // hidden_size / num_attention_heads when absent
  const Qwen3MoeConfig c = Qwen3MoeConfig::from_json(json{{"model_type", "qwen3_moe"},
                                                          {"hidden_size", 2048},
                                                          {"num_hidden_layers", 48},
                                                          {"head_dim", 128},
                                                          {"num_attention_heads", 32},
                                                          {"num_key_value_heads", 4},
                                                          {"moe_intermediate_size", 768},
                                                          {"num_experts", 128},
                                                          {"num_experts_per_tok", 8},
                                                          {"norm_topk_prob", true},
                                                          {"max_window_layers", 48}},
                                                     "qwen3-30b-a3b.json");
  EXPECT_NEAR(static_cast<double>(c.num_parameters()), 30.53e9, 0.01e9);
  EXPECT_EQ(c.to_json()["max_window_layers"], 48);
}

// output_router_logits: Hugging Face's load-balancing loss over both layers' routers. Zero router weights
// give every expert the probability 1/4 and send every token to experts 0 and 1 (ties go to the lower
// index): transformers' E x sum_e (assignments to e / (L T)) x P_e = 4 x (1/2 x 1/4 + 1/2 x 1/4) = 2.
// Every layer's router learns from it, under every recompute policy alike; a model cut into pipeline stages
// is refused in one line.
TEST(MixtralModel, RouterLoadBalancingLossOverEveryLayer) {
  json j = tiny();
  j["output_router_logits"] = true, j["router_aux_loss_coef"] = 0.5;
  const MixtralConfig config = MixtralConfig::from_json(j, "aux.json");
  EXPECT_DOUBLE_EQ(config.training_router_aux_loss_coef(), 0.5);
  EXPECT_EQ(config.to_json()["output_router_logits"], true);
  MixtralModel model(config, {DType::f32, nn::Recompute::none});
  EXPECT_DOUBLE_EQ(model.router_aux_loss_coef(), 0.5);
  model.initialize(3);
  ParameterStore& params = model.params();
  std::vector<int> routers;
  for (int i = 0; i < params.count(); ++i)
    if (params.info(i).name.find("block_sparse_moe.gate.") != std::string::npos) routers.push_back(i);
  ASSERT_EQ(routers.size(), 2u);
  for (int i : routers) params.param(i).fill_zero();
  std::vector<int32_t> ids(2 * 12), targets(2 * 12);
  for (size_t t = 0; t < ids.size(); ++t) ids[t] = static_cast<int32_t>(t * 7 % 64), targets[t] = ids[t];
  params.zero_grads();
  model.begin_train_step(TrainStepSettings{});
  model.forward_backward(ids.data(), targets.data(), 2, 12, 1.0f / 24);
  EXPECT_NEAR(model.aux_loss(1.0), 2.0, 1e-6);
  EXPECT_NEAR(model.aux_loss(0.5), 1.0, 1e-6);
  for (int i : routers) {
    double sum = 0;
    for (int64_t k = 0; k < params.grad(i).numel(); ++k) sum += std::abs(params.grad(i).f32()[k]);
    EXPECT_GT(sum, 0.0) << params.info(i).name;
  }
  // Every recompute policy (a layer's forward run again in backward records the same routing) and the split
  // backward give the gradients of none, bitwise.
  testing::expect_split_backward_bitwise(config, 12, [](const ParameterStore&) {});
  testing::expect_error_containing(
      [&] {
        MixtralModel stage(config, {DType::f32, nn::Recompute::none}, 0.02f, true, StageSpec::split(2, 2, 0));
      },
      {"aux.json", "output_router_logits = true", "every layer on one pipeline stage", "[0, 1)"});
}

TEST(MixtralModel, HuggingFaceFolderInAndOut) {
  testing::expect_hugging_face_round_trip("mixtral_tiny_window", "MixtralForCausalLM", "mixtral",
                                          "model.layers.1.block_sparse_moe.experts.3.w2.weight",
                                          "model.layers.0.block_sparse_moe.gate.weight");
  testing::expect_hugging_face_round_trip("mixtral_tiny_tied", "MixtralForCausalLM", "mixtral",
                                          "model.layers.0.block_sparse_moe.experts.0.w1.weight",
                                          "model.layers.1.block_sparse_moe.experts.2.w3.weight");
}

}  // namespace
}  // namespace forge::mixtral_test
