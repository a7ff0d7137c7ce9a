// The MoE router (ops::moe_router_forward / moe_router_backward) and the auxiliary-loss-free bias update
// (ops::moe_bias_update), written once for every backend (op_harness.h): on the CPU against a
// double-precision reference (selection, weights, the sequence-wise and the micro-batch balance losses) and
// finite differences of the gradient, elsewhere against the CPU kernel on the same inputs; and hand-made
// scores for group masking, ties, the bias and both balance losses.
//
// Random logits are drawn so that no two choices of a token lie within float rounding of each other, so every
// backend and the double reference select the same experts (tests below check ties on purpose).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "forge/kernels/ops.h"
#include "kernels/op_tests/moe_router_reference.h"
#include "op_harness.h"

namespace forge::op_tests::moe_router {

using testing::DeviceArray;

inline const std::vector<Case> kCases = {
    {12, 8, 2, 1, 1, ops::MoeScore::sigmoid, true, 2.5f, true, 6, 0.7f, false, 0.0f},
    {10, 16, 4, 4, 2, ops::MoeScore::sigmoid, true, 1.0f, true, 5, 0.3f, false, 0.0f},
    {9, 6, 3, 1, 1, ops::MoeScore::softmax, false, 1.0f, false, 3, 0.5f, false, 0.0f},
    {7, 12, 2, 3, 1, ops::MoeScore::sigmoid, false, 2.0f, true, 0, 0.0f, false, 0.0f},
    {6, 10, 3, 5, 3, ops::MoeScore::softmax, true, 1.5f, true, 2, 0.2f, false, 0.0f},
    {300, 64, 8, 8, 4, ops::MoeScore::sigmoid, true, 2.5f, true, 100, 0.01f, false, 0.0f},
    {0, 8, 2, 2, 1, ops::MoeScore::sigmoid, true, 1.0f, false, 0, 0.0f, false, 0.0f},
    // The micro-batch balance loss alone, and beside the sequence-wise one.
    {8, 6, 2, 1, 1, ops::MoeScore::softmax, true, 1.0f, false, 0, 0.0f, true, 0.6f},
    {12, 8, 2, 2, 1, ops::MoeScore::sigmoid, true, 2.5f, true, 4, 0.7f, true, 0.4f},
    {9, 6, 3, 1, 1, ops::MoeScore::softmax, false, 1.0f, true, 3, 0.5f, true, 0.9f},
    {300, 64, 8, 8, 4, ops::MoeScore::sigmoid, true, 2.5f, true, 100, 0.01f, true, 0.02f},
    {0, 8, 2, 2, 1, ops::MoeScore::sigmoid, true, 1.0f, false, 0, 0.0f, true, 0.5f},
};

struct Problem {
  Case c;
  std::vector<float> logits, bias, dweights;
  explicit Problem(const Case& c_, uint32_t seed) : c(c_) {
    logits = testing::random_floats(c.tokens * c.experts, seed, -4, 4);
    bias = testing::random_floats(c.experts, seed + 1, -0.2f, 0.2f);
    dweights = testing::random_floats(c.tokens * c.top_k, seed + 2);
  }
  std::vector<double> bias_double() const { return testing::to_double(bias); }
};

struct Result {
  std::vector<int32_t> ids;
  std::vector<float> weights, scores, sums, fractions, losses, dlogits, aux_fractions, aux_loss;
};

class MoeRouterOp : public testing::OpTest<Case> {
 protected:
  Result run(Device on, const Problem& pr) {
    const Case& c = pr.c;
    const int64_t sequences = c.seq_len > 0 ? c.tokens / c.seq_len : 0;
    DeviceArray<float> logits(on, pr.logits), bias(on, pr.bias), dweights(on, pr.dweights);
    DeviceArray<int32_t> ids(on, c.tokens * c.top_k);
    DeviceArray<float> weights(on, c.tokens * c.top_k), scores(on, c.tokens * c.experts);
    DeviceArray<float> sums(on, c.seq_len > 0 || c.aux ? c.tokens : 0), fractions(on, sequences * c.experts);
    DeviceArray<float> losses(on, sequences), dlogits(on, c.tokens * c.experts);
    // aux_fraction starts as garbage (as reused device memory would): with no tokens the op must zero it.
    DeviceArray<float> aux_fractions(on, std::vector<float>(c.aux ? c.experts : 0, 7.0f)),
        aux_loss(on, c.aux ? 1 : 0);
    ops::MoeRouterParams p;
    p.tokens = c.tokens, p.experts = c.experts, p.top_k = c.top_k, p.groups = c.groups;
    p.topk_groups = c.topk_groups, p.score = c.score, p.normalize = c.normalize, p.scaling = c.scaling;
    p.logits = logits.data(), p.bias = c.bias ? bias.data() : nullptr, p.expert_ids = ids.data();
    p.weights = weights.data(), p.scores = scores.data(), p.seq_len = c.seq_len;
    if (c.seq_len > 0)
      p.score_sums = sums.data(), p.expert_fraction = fractions.data(), p.balance_loss = losses.data();
    if (c.aux)
      p.score_sums = sums.data(), p.aux_fraction = aux_fractions.data(), p.aux_loss = aux_loss.data();
    FORGE_TEST_OP(moe_router_forward, on, p);
    p.dweights = dweights.data(), p.balance_scale = c.balance_scale, p.dlogits = dlogits.data();
    p.aux_scale = c.aux_scale;
    FORGE_TEST_OP(moe_router_backward, on, p);
    return {ids.download(),
            weights.download(),
            scores.download(),
            sums.download(),
            fractions.download(),
            losses.download(),
            dlogits.download(),
            aux_fractions.download(),
            c.aux && c.tokens > 0 ? aux_loss.download() : std::vector<float>{}};
  }
};

TEST_P(MoeRouterOp, ForwardAndBackward) {
  const Case& c = test_case();
  const Problem pr(c, 300);
  const Result cpu = run(Device::cpu, pr);
  if (on_cpu()) {
    const Reference want = reference(c, testing::to_double(pr.logits), pr.bias_double());
    EXPECT_EQ(cpu.ids, want.ids);
    EXPECT_LT(testing::relative_error(cpu.weights, want.weights), 1e-6);
    EXPECT_LT(testing::relative_error(cpu.scores, want.scores), 1e-6);
    if (c.seq_len > 0 || c.aux) {
      EXPECT_LT(testing::relative_error(cpu.sums, want.sums), 1e-6);
    }
    if (c.seq_len > 0) {
      EXPECT_LT(testing::relative_error(cpu.fractions, want.fractions), 1e-6);
      EXPECT_LT(testing::relative_error(cpu.losses, want.losses), 1e-6);
    }
    if (c.aux && c.tokens == 0) {
      EXPECT_EQ(cpu.aux_fractions, std::vector<float>(c.experts, 0.0f));
    }
    if (c.aux && c.tokens > 0) {
      EXPECT_LT(testing::relative_error(cpu.aux_fractions, want.aux_fractions), 1e-6);
      EXPECT_NEAR(cpu.aux_loss[0], want.aux_loss, 1e-6 * want.aux_loss);
    }
    if (!c.finite_differences()) return;
    const std::vector<double> dw = testing::to_double(pr.dweights);
    const auto fd = testing::finite_difference(
        [&](const std::vector<double>& z) {
          const Reference r = reference(c, z, pr.bias_double(), &want.ids);
          double loss = testing::dot(dw, r.weights);
          for (double l : r.losses) loss += c.balance_scale * l;
          return loss + c.aux_scale * r.aux_loss;
        },
        testing::to_double(pr.logits));
    EXPECT_LT(testing::relative_error(cpu.dlogits, fd), 1e-5);
    return;
  }
  const Result got = run(device(), pr);
  EXPECT_EQ(got.ids, cpu.ids);
  // Sums over at most `experts` terms in the same order, with each backend's exp (a few ulp apart).
  const double bound = 64 * testing::kU;
  const auto close = [&](const std::vector<float>& g, const std::vector<float>& w, const char* what) {
    double scale = 0;
    for (float x : w) scale = std::max(scale, double{std::abs(x)});
    testing::expect_close(g, w, c.name() + " " + what, [&](size_t) { return bound * (scale + 1e-30); });
  };
  close(got.weights, cpu.weights, "weights");
  close(got.scores, cpu.scores, "scores");
  close(got.sums, cpu.sums, "score_sums");
  close(got.fractions, cpu.fractions, "expert_fraction");
  close(got.losses, cpu.losses, "balance_loss");
  close(got.aux_fractions, cpu.aux_fractions, "aux_fraction");
  close(got.aux_loss, cpu.aux_loss, "aux_loss");
  close(got.dlogits, cpu.dlogits, "dlogits");
}

// Hand-made scores: logits z give scores sigmoid(z); these helpers pick z for wanted scores.
inline float logit_of(double s) { return static_cast<float>(std::log(s / (1 - s))); }

struct Routed {
  std::vector<int32_t> ids;
  std::vector<float> weights, losses;
  float aux_loss = 0;  // with_aux
};

inline Routed route(Device on, ops::MoeRouterParams p, const std::vector<float>& logits,
                    const std::vector<float>& bias, bool with_aux = false) {
  DeviceArray<float> z(on, logits), b(on, bias);
  DeviceArray<int32_t> ids(on, p.tokens * p.top_k);
  DeviceArray<float> weights(on, p.tokens * p.top_k), scores(on, p.tokens * p.experts);
  const int64_t sequences = p.seq_len > 0 ? p.tokens / p.seq_len : 0;
  DeviceArray<float> sums(on, p.seq_len > 0 || with_aux ? p.tokens : 0), fractions(on, sequences * p.experts);
  DeviceArray<float> losses(on, sequences), aux_fractions(on, p.experts), aux_loss(on, 1);
  p.logits = z.data(), p.bias = bias.empty() ? nullptr : b.data(), p.expert_ids = ids.data();
  p.weights = weights.data(), p.scores = scores.data();
  if (p.seq_len > 0)
    p.score_sums = sums.data(), p.expert_fraction = fractions.data(), p.balance_loss = losses.data();
  if (with_aux)
    p.score_sums = sums.data(), p.aux_fraction = aux_fractions.data(), p.aux_loss = aux_loss.data();
  FORGE_TEST_OP(moe_router_forward, on, p);
  return {ids.download(), weights.download(), losses.download(), with_aux ? aux_loss.download()[0] : 0.0f};
}

class MoeRouterHandMade : public testing::OpTest<testing::FixedCase> {};

// Eight experts in four groups of two, two groups kept: the best expert (0.9) sits in a group whose sum
// (0.9 + 0.1) loses to groups 1 (0.6 + 0.6) and 2 (0.55 + 0.5), so it is masked; the top-2 of the kept groups
// are the tied experts 2 and 3 (lower index first).
TEST_P(MoeRouterHandMade, GroupMaskingAndTies) {
  ops::MoeRouterParams p;
  p.tokens = 1, p.experts = 8, p.top_k = 2, p.groups = 4, p.topk_groups = 2, p.normalize = false;
  const std::vector<float> z = {logit_of(0.9),  logit_of(0.1), logit_of(0.6), logit_of(0.6),
                                logit_of(0.55), logit_of(0.5), logit_of(0.2), logit_of(0.2)};
  const Routed r = route(device(), p, z, {});
  EXPECT_EQ(r.ids, (std::vector<int32_t>{2, 3}));
  EXPECT_NEAR(r.weights[0], 0.6f, 1e-6f);
  // Without groups the best expert wins.
  p.groups = 1, p.topk_groups = 1;
  EXPECT_EQ(route(device(), p, z, {}).ids, (std::vector<int32_t>{0, 2}));
  // Every score equal: the lowest indices.
  p.top_k = 3;
  EXPECT_EQ(route(device(), p, std::vector<float>(8, 0.3f), {}).ids, (std::vector<int32_t>{0, 1, 2}));
}

// The bias picks the experts; the weights are the unbiased scores, normalised and scaled.
TEST_P(MoeRouterHandMade, BiasSelectsButDoesNotWeigh) {
  ops::MoeRouterParams p;
  p.tokens = 1, p.experts = 4, p.top_k = 2, p.normalize = true, p.scaling = 2.5f;
  const std::vector<float> z = {logit_of(0.8), logit_of(0.7), logit_of(0.3), logit_of(0.2)};
  const Routed plain = route(device(), p, z, {});
  EXPECT_EQ(plain.ids, (std::vector<int32_t>{0, 1}));
  const Routed biased = route(device(), p, z, {0.0f, 0.0f, 0.0f, 0.65f});  // expert 3: 0.2 + 0.65 = 0.85
  EXPECT_EQ(biased.ids, (std::vector<int32_t>{3, 0}));
  EXPECT_NEAR(biased.weights[0], 2.5 * 0.2 / (0.2 + 0.8), 1e-6);
  EXPECT_NEAR(biased.weights[1], 2.5 * 0.8 / (0.2 + 0.8), 1e-6);
}

// Equal scores make every P_i = 1/E, and then sum_i f_i P_i = (1 / (K T)) sum_i count_i = 1 whichever experts
// are chosen: the balance loss of uniform routing is exactly its coefficient.
TEST_P(MoeRouterHandMade, UniformRoutingBalanceLossIsOne) {
  ops::MoeRouterParams p;
  p.tokens = 12, p.experts = 6, p.top_k = 2, p.seq_len = 4;
  const Routed r = route(device(), p, std::vector<float>(12 * 6, 0.7f), {});
  ASSERT_EQ(r.losses.size(), 3u);
  for (float loss : r.losses) EXPECT_NEAR(loss, 1.0f, 1e-6f);
}

// The micro-batch (classic auxiliary) loss of uniform routing is 1 too, computed beside the sequence-wise
// one.
TEST_P(MoeRouterHandMade, UniformRoutingAuxLossIsOne) {
  ops::MoeRouterParams p;
  p.tokens = 12, p.experts = 6, p.top_k = 2, p.seq_len = 4;
  const Routed r = route(device(), p, std::vector<float>(12 * 6, 0.7f), {}, true);
  EXPECT_NEAR(r.aux_loss, 1.0f, 1e-6f);
  for (float loss : r.losses) EXPECT_NEAR(loss, 1.0f, 1e-6f);
  p.seq_len = 0;  // alone
  EXPECT_NEAR(route(device(), p, std::vector<float>(12 * 6, 0.7f), {}, true).aux_loss, 1.0f, 1e-6f);
}

// Scores 0.9 for one expert and 0.1 for the three others (n = 1.2, so P of the favourite is 0.75 per token),
// top-1. Two sequences of two tokens, the first favouring expert 0, the second expert 1: each sequence sends
// everything to one expert (f = 4, loss 4 x 0.75 = 3), while the micro-batch is split over two (f = 2, 2;
// P = (0.75 + 0.75 + 1/12 + 1/12) / 4 each: loss 5/3). The micro-batch loss forgives what the sequence-wise
// one punishes.
TEST_P(MoeRouterHandMade, MicroBatchLossSeesTheWholeBatch) {
  ops::MoeRouterParams p;
  p.tokens = 4, p.experts = 4, p.top_k = 1, p.normalize = false, p.seq_len = 2;
  const float hi = logit_of(0.9), lo = logit_of(0.1);
  const std::vector<float> z = {hi, lo, lo, lo, hi, lo, lo, lo, lo, hi, lo, lo, lo, hi, lo, lo};
  const Routed r = route(device(), p, z, {}, true);
  EXPECT_EQ(r.ids, (std::vector<int32_t>{0, 0, 1, 1}));
  ASSERT_EQ(r.losses.size(), 2u);
  for (float loss : r.losses) EXPECT_NEAR(loss, 3.0f, 1e-5f);
  EXPECT_NEAR(r.aux_loss, 5.0f / 3.0f, 1e-5f);
}

// bias += rate * sign(mean - load): underloaded experts up, overloaded down, exactly by the rate; the
// zero-mean variant subtracts the updates' mean.
TEST_P(MoeRouterHandMade, BiasUpdateMovesByExactlyTheRate) {
  const float rate = 0.001f;
  const std::vector<float> start = {0.5f, -0.25f, 0.0f, 0.125f};
  DeviceArray<float> bias(device(), start);
  DeviceArray<double> load(device(), std::vector<double>{5, 1, 3, 3});  // mean 3
  FORGE_TEST_OP(moe_bias_update, device(), bias.data(), load.data(), 4, rate, false);
  const std::vector<float> after = bias.download();
  EXPECT_EQ(after[0], start[0] - rate);
  EXPECT_EQ(after[1], start[1] + rate);
  EXPECT_EQ(after[2], start[2]);
  EXPECT_EQ(after[3], start[3]);
  DeviceArray<float> zero(device(), std::vector<float>(4, 0.0f));
  load.upload({5, 1, 1, 1});  // mean 2: updates (-r, r, r, r), their mean r / 2
  FORGE_TEST_OP(moe_bias_update, device(), zero.data(), load.data(), 4, rate, true);
  const std::vector<float> centred = zero.download();
  EXPECT_FLOAT_EQ(centred[0], -1.5f * rate);
  for (int e = 1; e < 4; ++e) EXPECT_FLOAT_EQ(centred[e], 0.5f * rate);
}

}  // namespace forge::op_tests::moe_router
