// A model cut into stages is the same model: LLaMA built as 2 and as 3 stages in one process, each
// micro-batch's hidden states handed from stage to stage by hand, gives bitwise the losses and every
// parameter gradient of the one-stage model, whatever order B and W run in: fused (each layer's W after its
// B), all B then all W, and W of every micro-batch deferred past the later micro-batches' forwards (the order
// a zero-bubble schedule creates). Gradients become final by count in every order.
#include <gtest/gtest.h>

#include <cstring>
#include <memory>
#include <vector>

#include "forge/core/memory.h"
#include "forge/core/philox.h"
#include "forge/models/llama/llama_model.h"
#include "forge/models/model.h"
#include "op_harness.h"

namespace forge::stages_test {
using namespace forge::models;
namespace {

LlamaConfig six_layers() {
  LlamaConfig c;
  c.hidden_size = 32, c.intermediate_size = 48, c.num_hidden_layers = 6;
  c.num_attention_heads = 4, c.num_key_value_heads = 2, c.head_dim = 8;
  c.vocab_size = 61, c.max_position_embeddings = 32, c.rms_norm_eps = 1e-5;
  c.validate("test config");
  return c;
}

constexpr int64_t kBatch = 2, kSeq = 12, kMicroBatches = 3;

struct Batch {
  std::vector<int32_t> ids, targets;
};

std::vector<Batch> micro_batches(int64_t vocab) {
  std::vector<Batch> out(kMicroBatches);
  for (int64_t m = 0; m < kMicroBatches; ++m)
    for (int64_t i = 0; i < kBatch * kSeq; ++i) {
      const auto bits = philox4x32_10({static_cast<uint32_t>(i), static_cast<uint32_t>(m), 0, 0}, {5, 0});
      out[m].ids.push_back(static_cast<int32_t>(bits[0] % vocab));
      out[m].targets.push_back(i % 5 == 2 ? -1 : static_cast<int32_t>(bits[1] % vocab));
    }
  return out;
}

enum class Order { fused, b_then_w, deferred_w };

struct Outcome {
  std::vector<double> losses;
  std::vector<std::unique_ptr<Model>> stages;
};

// Runs the micro-batches through `stage_count` stages in `order`, passing activations by hand.
Outcome run(int stage_count, Order order, nn::ComputeOptions options) {
  const LlamaConfig config = six_layers();
  const std::vector<Batch> batches = micro_batches(config.vocab_size);
  Outcome out;
  for (int s = 0; s < stage_count; ++s) {
    out.stages.push_back(
        build_model(config, options, StageSpec::split(config.num_hidden_layers, stage_count, s), 0.02f));
    out.stages.back()->initialize(11);
    out.stages.back()->params().zero_grads();
    out.stages.back()->params().begin_grad_step(kMicroBatches);
  }
  const float scale = 1.0f / (kMicroBatches * kBatch * kSeq);
  // saved[m][s]: micro-batch m's activations on stage s, owned here as a schedule owns them.
  std::vector<std::vector<std::unique_ptr<StageActivations>>> saved(kMicroBatches);
  auto backward_input = [&](int m) {
    Tensor d;
    for (int s = stage_count; s-- > 0;) {
      Model& stage = *out.stages[s];
      d = order == Order::fused ? stage.backward(d, *saved[m][s]) : stage.backward_input(d, *saved[m][s]);
    }
    EXPECT_FALSE(
        d.defined());  // the first stage returns nothing: its embedding's gradient is a weight gradient
  };
  auto backward_weight = [&](int m) {
    for (int s = 0; s < stage_count; ++s) out.stages[s]->backward_weight(*saved[m][s]);
  };
  for (int m = 0; m < kMicroBatches; ++m) {
    const MicroBatch mb{batches[m].ids.data(), batches[m].targets.data(), kBatch, kSeq, scale};
    saved[m].resize(stage_count);
    Tensor hidden;
    for (int s = 0; s < stage_count; ++s) {
      const StageOutput o = out.stages[s]->forward(mb, hidden, &saved[m][s]);
      hidden = o.hidden;
      if (s == stage_count - 1) out.losses.push_back(o.loss.sum);
    }
    backward_input(m);
    if (order == Order::b_then_w) backward_weight(m);
  }
  // Deferred W in micro-batch order: each gradient is a sum over micro-batches, which is bitwise the fused
  // order's only when added in the same order (every schedule keeps a stage's W in micro-batch order).
  if (order == Order::deferred_w)
    for (int m = 0; m < kMicroBatches; ++m) backward_weight(m);
  for (const auto& stage : out.stages)
    EXPECT_FALSE(stage->params().grad_step_active()) << "a gradient is not final";
  return out;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.raw(), b.raw(), a.bytes()) == 0;
}

class Stages : public ::testing::TestWithParam<DType> {};

TEST_P(Stages, CutModelMatchesTheWholeModelBitwiseInEveryOrder) {
  const nn::ComputeOptions options{GetParam(), nn::Recompute::none};
  const Outcome whole = run(1, Order::fused, options);
  const ParameterStore& reference = whole.stages[0]->params();
  for (int stages : {2, 3})
    for (Order order : {Order::fused, Order::b_then_w, Order::deferred_w}) {
      SCOPED_TRACE(::testing::Message() << stages << " stages, order " << static_cast<int>(order));
      const Outcome cut = run(stages, order, options);
      ASSERT_EQ(cut.losses.size(), whole.losses.size());
      for (size_t m = 0; m < whole.losses.size(); ++m)
        EXPECT_EQ(cut.losses[m], whole.losses[m]) << "micro-batch " << m;
      // Every parameter lives on exactly one stage, with the whole model's gradient, bitwise.
      int covered = 0;
      for (const auto& stage : cut.stages) {
        const ParameterStore& p = stage->params();
        for (int id = 0; id < p.count(); ++id) {
          const int ref = reference.find(p.info(id).name);
          ASSERT_GE(ref, 0) << p.info(id).name;
          EXPECT_TRUE(same_bits(p.param(id), reference.param(ref))) << p.info(id).name << " weights";
          EXPECT_TRUE(same_bits(p.grad(id), reference.grad(ref))) << p.info(id).name << " gradient";
          ++covered;
        }
      }
      EXPECT_EQ(covered, reference.count());
    }
}

TEST_P(Stages, SplitsLayersEvenlyAndRefusesWholeModelCallsOnAStage) {
  EXPECT_EQ(StageSpec::split(6, 3, 1).first_layer, 2);
  EXPECT_EQ(StageSpec::split(7, 3, 0).end_layer, 3);  // the first stages take the remainder
  EXPECT_EQ(StageSpec::split(7, 3, 2).first_layer, 5);
  EXPECT_TRUE(StageSpec::split(7, 3, 0).pre_process && !StageSpec::split(7, 3, 0).post_process);
  const LlamaConfig config = six_layers();
  auto middle = build_model(config, {GetParam(), nn::Recompute::none}, StageSpec::split(6, 3, 1));
  EXPECT_EQ(middle->num_local_layers(), 2);
  EXPECT_LT(middle->params().find("model.embed_tokens.weight"), 0);
  EXPECT_LT(middle->params().find("lm_head.weight"), 0);
  EXPECT_GE(middle->params().find("model.layers.2.mlp.down_proj.weight"), 0);
  std::vector<int32_t> ids(kSeq, 1);
  testing::expect_error_containing([&] { middle->logits(ids.data(), 1, kSeq); }, {"needs the whole model"});
  testing::expect_error_containing([&] { middle->forward_backward(ids.data(), ids.data(), 1, kSeq, 1.0f); },
                                   {"first and the last stage"});
  // A middle stage needs hidden states of the right shape.
  std::unique_ptr<StageActivations> saved;
  testing::expect_error_containing(
      [&] {
        middle->forward({nullptr, nullptr, 1, kSeq, 1.0f}, Tensor::zeros({kSeq, 7}, DType::f32), &saved);
      },
      {"stage input"});
}

INSTANTIATE_TEST_SUITE_P(GemmDtypes, Stages, ::testing::Values(DType::f32, DType::bf16));

// Block recompute (ComputeOptions::recompute_layers): only the first layers of each stage recompute. The
// losses and gradients stay bitwise those of no recompute (recomputation is exact), and what a stage's
// forward keeps for backward falls strictly between no recompute and full recompute of every layer.
TEST(StagesRecompute, OnlyTheFirstLayersOfEachStageRecomputeBitwise) {
  const nn::ComputeOptions none{DType::f32, nn::Recompute::none}, full{DType::f32, nn::Recompute::full};
  nn::ComputeOptions block = full;
  block.recompute_layers = 1;
  const Outcome kept_all = run(2, Order::b_then_w, none), first_only = run(2, Order::b_then_w, block);
  EXPECT_EQ(kept_all.losses, first_only.losses);
  for (int s = 0; s < 2; ++s)
    EXPECT_TRUE(same_bits(kept_all.stages[s]->params().grads(), first_only.stages[s]->params().grads()))
        << "stage " << s;
  // The bytes a forward leaves for backward on each stage (three layers each).
  const LlamaConfig config = six_layers();
  const Batch batch = micro_batches(config.vocab_size)[0];
  auto kept_bytes = [&](const nn::ComputeOptions& options, int stage) {
    auto model = build_model(config, options, StageSpec::split(6, 2, stage), 0.02f);
    model->initialize(11);
    const Tensor hidden = stage == 0 ? Tensor() : Tensor::zeros({kBatch * kSeq, 32}, DType::f32);
    const int64_t live = memory_stats().live_bytes;
    std::unique_ptr<StageActivations> saved;
    model->forward({batch.ids.data(), batch.targets.data(), kBatch, kSeq, 1.0f}, hidden, &saved);
    return memory_stats().live_bytes - live;
  };
  for (int stage = 0; stage < 2; ++stage) {
    const int64_t n = kept_bytes(none, stage), b = kept_bytes(block, stage), f = kept_bytes(full, stage);
    EXPECT_GT(n, b) << "stage " << stage;
    EXPECT_GT(b, f) << "stage " << stage;
    // Three layers, one recomputed: a third of the layers' savings (the head's share is the same in all).
    EXPECT_NEAR(static_cast<double>(n - b) / static_cast<double>(n - f), 1.0 / 3.0, 0.05)
        << "stage " << stage;
  }
  // Counting past the stage's layers recomputes them all: the same as full recompute.
  block.recompute_layers = 3;
  EXPECT_EQ(kept_bytes(block, 1), kept_bytes(full, 1));
}

}  // namespace
}  // namespace forge::stages_test
