// Mixtral and Qwen3-MoE, the MoE families on the LLaMA-family readers: Mixtral's parts on the decoder stack
// (the router and the experts under the released checkpoints' names, no correction bias) and a Hugging Face
// folder in and out. The config reader and the golden tests against transformers are in llama_golden_test.cpp
// (the Mixtral instantiation and MixtralGolden); KV-cache decoding in kv_cache_test.cpp; the parallel
// layouts, expert parallelism included, in trainer_mpi_test.cpp.
#include "forge/models/mixtral/mixtral.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <memory>
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
// Every layer's router learns from it, under every recompute policy alike.
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
}

struct StagedRun {
  std::vector<std::unique_ptr<MixtralModel>> stages;
  std::vector<double> losses;
  double aux_loss = 0;  // summed over the stages
};

// Two micro-batches through `count` stages of a three-layer Mixtral with the load-balancing loss, both
// forwards before either backward (as a pipeline schedule holds them), the routing handed on by hand as the
// hidden states are.
StagedRun run_stages(const MixtralConfig& config, int count) {
  StagedRun run;
  for (int s = 0; s < count; ++s) {
    run.stages.push_back(std::make_unique<MixtralModel>(config,
                                                        nn::ComputeOptions{DType::f32, nn::Recompute::none},
                                                        0.02f, true, StageSpec::split(3, count, s)));
    run.stages.back()->initialize(7);
    run.stages.back()->params().zero_grads();
    run.stages.back()->params().begin_grad_step(2);
    run.stages.back()->begin_train_step(TrainStepSettings{});
  }
  std::vector<std::vector<int32_t>> ids(2, std::vector<int32_t>(2 * 12));
  for (size_t m = 0; m < 2; ++m)
    for (size_t t = 0; t < ids[m].size(); ++t) ids[m][t] = static_cast<int32_t>((t * 7 + m * 13) % 64);
  std::vector<std::vector<std::unique_ptr<StageActivations>>> saved(2);
  for (size_t m = 0; m < 2; ++m) {
    MicroBatch mb{ids[m].data(), ids[m].data(), 2, 12, 1.0f / 48};
    mb.first_sample = static_cast<int64_t>(2 * m);
    saved[m].resize(count);
    Tensor hidden;
    std::vector<double> routing;
    for (int s = 0; s < count; ++s) {
      mb.routing_before = s > 0 ? routing.data() : nullptr;
      const StageOutput out = run.stages[s]->forward(mb, hidden, &saved[m][s]);
      hidden = out.hidden, routing = out.routing;
      if (s == count - 1) run.losses.push_back(out.loss.sum);
    }
  }
  for (size_t m = 0; m < 2; ++m) {
    Tensor d;
    std::vector<double> total;
    for (int s = count; s-- > 0;) {
      if (s < count - 1) saved[m][s]->routing_total = total;
      d = run.stages[s]->backward(d, *saved[m][s]);
      total = saved[m][s]->routing_total;
      EXPECT_EQ(total.size(), 4u);
    }
  }
  for (const auto& stage : run.stages) run.aux_loss += stage->aux_loss(1.0);
  return run;
}

// Under pipeline parallelism each stage holds some of the layers the loss couples: the earlier stages' f
// travels forward with the hidden states, the total over every layer back with their gradient. Cut into two
// and three stages, with two micro-batches in flight at once, a Mixtral gives the whole model's losses, loss
// value and gradients bit for bit; a stage given no routing refuses in one line.
TEST(MixtralModel, RouterLoadBalancingLossAcrossPipelineStages) {
  json j = tiny();
  j["num_hidden_layers"] = 3, j["output_router_logits"] = true, j["router_aux_loss_coef"] = 0.3;
  const MixtralConfig config = MixtralConfig::from_json(j, "aux.json");
  const StagedRun whole = run_stages(config, 1);
  EXPECT_GT(whole.aux_loss, 0.0);
  for (int count : {2, 3}) {
    SCOPED_TRACE(::testing::Message() << count << " stages");
    const StagedRun cut = run_stages(config, count);
    EXPECT_EQ(cut.losses, whole.losses);
    EXPECT_NEAR(cut.aux_loss, whole.aux_loss, 1e-12 * whole.aux_loss);
    const ParameterStore& reference = whole.stages[0]->params();
    for (const auto& stage : cut.stages) {
      const ParameterStore& p = stage->params();
      for (int id = 0; id < p.count(); ++id) {
        const int ref = reference.find(p.info(id).name);
        ASSERT_GE(ref, 0) << p.info(id).name;
        const Tensor got = p.grad(id), want = reference.grad(ref);
        ASSERT_EQ(got.numel(), want.numel());
        EXPECT_EQ(std::memcmp(got.raw(), want.raw(), got.bytes()), 0) << p.info(id).name;
      }
    }
  }
  // A later stage's training forward needs the earlier stages' routing, an earlier stage's backward the
  // total from the later ones.
  MixtralModel first(config, {DType::f32, nn::Recompute::none}, 0.02f, true, StageSpec::split(3, 2, 0));
  MixtralModel last(config, {DType::f32, nn::Recompute::none}, 0.02f, true, StageSpec::split(3, 2, 1));
  first.initialize(7), last.initialize(7);
  first.begin_train_step(TrainStepSettings{}), last.begin_train_step(TrainStepSettings{});
  std::vector<int32_t> ids(2 * 12, 5);
  const MicroBatch mb{ids.data(), ids.data(), 2, 12, 1.0f / 24};
  std::unique_ptr<StageActivations> kept, kept_last;
  const StageOutput out = first.forward(mb, Tensor(), &kept);
  ASSERT_EQ(out.routing.size(), 4u);
  testing::expect_error_containing([&] { last.forward(mb, out.hidden, &kept_last); },
                                   {"layers 2..3", "without the earlier stages' routing"});
  testing::expect_error_containing([&] { first.backward(out.hidden, *kept); },
                                   {"layers 0..2", "without the later stages' routing"});
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
