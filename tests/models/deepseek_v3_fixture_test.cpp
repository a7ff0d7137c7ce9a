// The DeepSeek-V3 golden fixtures (tests/reference/deepseek_v3_twin.py) agree with DeepseekV3Config and with
// themselves: every checkpoint tensor in tensor_shapes order and shape, a gradient for each parameter (none
// for the correction biases), the MTP logits' shapes, the loss sum, the routing, the RoPE tables and the bias
// updates of the AdamW run. Comparing a forge model against them is the model's own test.
#include <gtest/gtest.h>

#include <cmath>
#include <set>
#include <string>

#include "forge/ckpt/safetensors.h"
#include "forge/models/deepseek_v3/deepseek_v3_config.h"
#include "test_files.h"

namespace forge::deepseek_v3_fixture_test {
using namespace forge::models;
using namespace forge::ckpt;
namespace {

using testing::fixture;

class DeepseekV3Fixture : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    file_ = std::make_unique<SafetensorsFile>(SafetensorsFile::open(fixture(GetParam() + ".safetensors")));
    config_ = DeepseekV3Config::from_json_file(fixture(GetParam() + ".config.json"));
  }
  double meta(const std::string& key) const { return std::stod(file_->metadata().at(key)); }
  float scalar(const std::string& name) const {
    Tensor t = file_->read(name);
    EXPECT_EQ(t.numel(), 1) << name;
    return t.f32()[0];
  }
  std::unique_ptr<SafetensorsFile> file_;
  DeepseekV3Config config_;
};

TEST_P(DeepseekV3Fixture, ConfigRoundTrips) {
  EXPECT_EQ(DeepseekV3Config::from_json(config_.to_json(), "round trip"), config_);
  EXPECT_EQ(config_.num_hidden_layers, 3);
  EXPECT_EQ(config_.first_k_dense_replace, 1);
}

TEST_P(DeepseekV3Fixture, TensorsFollowTensorShapes) {
  const auto shapes = config_.tensor_shapes();
  const auto& entries = file_->entries();
  ASSERT_GE(entries.size(), shapes.size());
  std::set<std::string> expected;
  for (size_t i = 0; i < shapes.size(); ++i) {
    const auto& [name, shape] = shapes[i];
    expected.insert(name);
    EXPECT_EQ(entries[i].name, name) << "position " << i;  // the file starts with them, in this order
    EXPECT_EQ(entries[i].dtype, DType::f32) << name;
    EXPECT_EQ(entries[i].shape, shape) << name;
    EXPECT_FALSE(config_.is_ignored_duplicate(name)) << name;
    const bool bias = name.ends_with(".mlp.gate.e_score_correction_bias");
    const SafetensorsEntry* grad = file_->find("grad." + name);
    if (bias) {
      EXPECT_EQ(grad, nullptr) << name << " is a buffer: no gradient";
      // Non-zero, so that biased and unbiased selection differ.
      Tensor b = file_->read(name);
      double max_abs = 0;
      for (int64_t e = 0; e < b.numel(); ++e) max_abs = std::max(max_abs, std::abs(double(b.f32()[e])));
      EXPECT_GT(max_abs, 0.01) << name;
    } else {
      ASSERT_NE(grad, nullptr) << name;
      EXPECT_EQ(grad->shape, shape) << name;
    }
    const SafetensorsEntry* final = file_->find("final." + name);
    ASSERT_NE(final, nullptr) << name;
    EXPECT_EQ(final->shape, shape) << name;
  }
  // Nothing else carries a model tensor's name.
  for (const auto& entry : entries) {
    std::string_view name = entry.name;
    for (std::string_view prefix : {"grad.", "final."})
      if (name.starts_with(prefix)) name.remove_prefix(prefix.size());
    if (name.starts_with("model.") || name.starts_with("lm_head.")) {
      EXPECT_TRUE(expected.count(std::string(name))) << entry.name;
    }
  }
}

TEST_P(DeepseekV3Fixture, LogitsLossesAndRouting) {
  const DeepseekV3Config& c = config_;
  Tensor ids = file_->read("input_ids"), labels = file_->read("labels");
  ASSERT_EQ(ids.dtype(), DType::i32);
  ASSERT_EQ(ids.shape(), labels.shape());
  const int64_t batch = ids.dim(0), seq = ids.dim(1), depth = c.num_nextn_predict_layers;
  for (int64_t i = 0; i < ids.numel(); ++i) {
    EXPECT_GE(ids.i32()[i], 0);
    EXPECT_LT(ids.i32()[i], c.vocab_size);
  }
  EXPECT_EQ(file_->find("logits")->shape, (Shape{batch, seq, c.vocab_size}));
  for (int64_t k = 1; k <= depth; ++k) {
    const SafetensorsEntry* mtp = file_->find("mtp" + std::to_string(k) + ".logits");
    ASSERT_NE(mtp, nullptr) << k;
    EXPECT_EQ(mtp->shape, (Shape{batch, seq - k, c.vocab_size}));  // depth k has no input beyond T - k
  }
  EXPECT_EQ(file_->find("mtp" + std::to_string(depth + 1) + ".logits"), nullptr);

  // total = main + mtp_weight / D * sum_k mtp_k + balance, balance = sum over the MoE layers.
  double mtp = 0;
  for (int64_t k = 1; k <= depth; ++k) mtp += scalar("loss.mtp" + std::to_string(k));
  const double weight = depth ? meta("mtp_weight") / static_cast<double>(depth) : 0.0;
  EXPECT_NEAR(scalar("loss.total"), scalar("loss.main") + weight * mtp + scalar("loss.balance"), 1e-6);
  double balance = 0;
  int moe_layers = 0;
  for (int64_t layer = 0; layer < c.num_layers_with_mtp(); ++layer) {
    const std::string tag = "layer" + std::to_string(layer);
    if (!c.is_moe_layer(layer)) {
      EXPECT_EQ(file_->find("route." + tag + ".experts"), nullptr) << tag;
      continue;
    }
    ++moe_layers;
    balance += scalar("loss.balance." + tag);
    const int64_t length = seq - std::max<int64_t>(0, layer - c.num_hidden_layers + 1);
    const int64_t tokens = batch * length;
    Tensor experts = file_->read("route." + tag + ".experts"),
           weights = file_->read("route." + tag + ".weights");
    ASSERT_EQ(experts.shape(), (Shape{batch, length, c.num_experts_per_tok})) << tag;
    ASSERT_EQ(weights.shape(), experts.shape()) << tag;
    for (int64_t t = 0; t < tokens; ++t) {
      std::set<int64_t> groups;
      double sum = 0;
      for (int64_t j = 0; j < c.num_experts_per_tok; ++j) {
        const int32_t e = experts.i32()[t * c.num_experts_per_tok + j];
        ASSERT_GE(e, 0);
        ASSERT_LT(e, c.n_routed_experts);
        if (j > 0) {
          EXPECT_LT(experts.i32()[t * c.num_experts_per_tok + j - 1], e) << "sorted, distinct";
        }
        groups.insert(e / c.experts_per_group());
        const float w = weights.f32()[t * c.num_experts_per_tok + j];
        EXPECT_GT(w, 0.0f);
        sum += w;
      }
      EXPECT_LE(static_cast<int64_t>(groups.size()), c.topk_group) << tag << " token " << t;
      if (c.norm_topk_prob) {
        EXPECT_NEAR(sum, c.routed_scaling_factor, 1e-5) << tag << " token " << t;
      }
    }
  }
  EXPECT_GT(moe_layers, 0);
  EXPECT_NEAR(scalar("loss.balance"), balance, 1e-7);
}

TEST_P(DeepseekV3Fixture, RopeTablesMatchTheConfig) {
  const std::vector<double> want = config_.rope_inv_freq();
  Tensor inv_freq = file_->read("rope.inv_freq");
  ASSERT_EQ(inv_freq.numel(), static_cast<int64_t>(want.size()));
  for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(inv_freq.f32()[i], want[i], 1e-7 * want[i]) << i;
  EXPECT_NEAR(scalar("rope.attention_factor"), config_.rope_attention_factor(), 1e-7);
  EXPECT_NEAR(scalar("attention.softmax_scale"), config_.softmax_scale(), 1e-7);
}

// After each of the AdamW steps every MoE layer's bias moved by rate * sign(mean load - load) of that step.
TEST_P(DeepseekV3Fixture, BiasUpdatesFollowTheLoads) {
  const DeepseekV3Config& c = config_;
  const double rate = meta("bias_update_rate");
  const int steps = std::stoi(file_->metadata().at("steps"));
  EXPECT_EQ(file_->read("adamw.losses").numel(), steps);
  EXPECT_EQ(file_->read("adamw.grad_norms").numel(), steps);
  int64_t moved = 0;
  for (int64_t layer = c.first_k_dense_replace; layer < c.num_layers_with_mtp(); ++layer) {
    const std::string tag = "layer" + std::to_string(layer);
    const std::string bias = "model.layers." + std::to_string(layer) + ".mlp.gate.e_score_correction_bias";
    Tensor initial = file_->read(bias), final = file_->read("final." + bias);
    std::vector<double> expected(initial.f32(), initial.f32() + initial.numel());
    const int64_t seq = file_->read("step0.input_ids").dim(1), batch = file_->read("step0.input_ids").dim(0);
    const int64_t tokens = batch * (seq - std::max<int64_t>(0, layer - c.num_hidden_layers + 1));
    for (int s = 0; s < steps; ++s) {
      Tensor load = file_->read("step" + std::to_string(s) + ".load." + tag);
      ASSERT_EQ(load.numel(), c.n_routed_experts);
      int64_t total = 0;
      for (int64_t e = 0; e < load.numel(); ++e) total += load.i32()[e];
      EXPECT_EQ(total, tokens * c.num_experts_per_tok) << tag;
      const double mean = static_cast<double>(total) / static_cast<double>(c.n_routed_experts);
      for (int64_t e = 0; e < load.numel(); ++e) {
        const double gap = mean - load.i32()[e];
        expected[static_cast<size_t>(e)] += rate * (gap > 0 ? 1 : gap < 0 ? -1 : 0);
      }
    }
    for (int64_t e = 0; e < final.numel(); ++e) {
      EXPECT_NEAR(final.f32()[e], expected[static_cast<size_t>(e)], 1e-6) << bias << "[" << e << "]";
      moved += final.f32()[e] != initial.f32()[e];
    }
  }
  EXPECT_GT(moved, 0);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, DeepseekV3Fixture,
                         ::testing::Values("deepseek_v3_tiny", "deepseek_v3_yarn_mtp", "deepseek_v3_mtp2"));

}  // namespace
}  // namespace forge::deepseek_v3_fixture_test
