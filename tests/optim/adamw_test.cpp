#include "forge/optim/adamw.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/kernels/ops.h"

namespace forge::adamw_test {
using namespace forge::optim;
namespace {

// Three parameters of odd sizes (10 + 7 + 33 = 50 elements), the middle one without weight decay.
void build(ParameterStore& store, bool bf16) {
  store.add("a", {2, 5}, true, Init::normal, 0.5f);
  store.add("b", {7}, false, Init::ones);
  store.add("c", {3, 11}, true, Init::normal, 0.5f);
  store.allocate(bf16);
  store.initialize(7);
}

void fill_grads(ParameterStore& store, int step) {
  float* g = store.grads().f32();
  for (int64_t i = 0; i < store.trained_numel(); ++i)
    g[i] = std::sin(0.37f * static_cast<float>(i + 13 * step));
}

bool bitwise_equal(const float* a, const float* b, int64_t n) {
  return std::memcmp(a, b, static_cast<size_t>(n) * sizeof(float)) == 0;
}

TEST(ForEachParamInRange, SplitsRangesAtParameterBoundaries) {
  ParameterStore store;
  build(store, false);
  std::vector<std::tuple<std::string, int64_t, int64_t>> pieces;
  auto collect = [&](const ParamInfo& p, int64_t lo, int64_t hi) { pieces.emplace_back(p.name, lo, hi); };
  for_each_param_in_range(store, 4, 20, collect);
  using Piece = std::tuple<std::string, int64_t, int64_t>;
  EXPECT_EQ(pieces, (std::vector<Piece>{{"a", 4, 10}, {"b", 10, 17}, {"c", 17, 20}}));
  pieces.clear();
  for_each_param_in_range(store, 11, 13, collect);  // inside one parameter
  EXPECT_EQ(pieces, (std::vector<Piece>{{"b", 11, 13}}));
  pieces.clear();
  for_each_param_in_range(store, 10, 50, collect);  // from a boundary to the end
  EXPECT_EQ(pieces, (std::vector<Piece>{{"b", 10, 17}, {"c", 17, 50}}));
  pieces.clear();
  for_each_param_in_range(store, 30, 30, collect);  // empty
  EXPECT_TRUE(pieces.empty());
}

// AdamW::step is one ops::adamw call per parameter with that parameter's weight decay: pinned here so that
// the shared range update keeps the single-process optimizer bitwise as it was.
TEST(AdamW, StepIsTheFusedKernelPerParameter) {
  ParameterStore store, manual;
  build(store, true);
  build(manual, true);
  AdamWConfig config{0.9f, 0.95f, 1e-8f, 0.1f};
  AdamW optimizer(&store, config);
  std::vector<float> m(manual.numel(), 0), v(manual.numel(), 0);
  for (int step = 1; step <= 3; ++step) {
    fill_grads(store, step);
    fill_grads(manual, step);
    optimizer.step(1e-2f, 0.7f);
    for (const auto& info : manual.infos()) {
      ops::AdamWParams p;
      p.n = shape_numel(info.shape);
      p.param = manual.params().f32() + info.offset;
      p.grad = manual.grads().f32() + info.offset;
      p.exp_avg = m.data() + info.offset, p.exp_avg_sq = v.data() + info.offset;
      p.param_bf16 = manual.params_bf16().bf16() + info.offset;
      p.lr = 1e-2f, p.beta1 = config.beta1, p.beta2 = config.beta2, p.eps = config.eps;
      p.weight_decay = info.weight_decay ? config.weight_decay : 0.0f;
      p.step = step, p.grad_scale = 0.7f;
      ops::adamw(p);
    }
    ASSERT_TRUE(bitwise_equal(store.params().f32(), manual.params().f32(), store.numel())) << "step " << step;
    ASSERT_TRUE(bitwise_equal(optimizer.exp_avg().f32(), m.data(), store.numel()));
    ASSERT_TRUE(bitwise_equal(optimizer.exp_avg_sq().f32(), v.data(), store.numel()));
    ASSERT_EQ(std::memcmp(store.params_bf16().bf16(), manual.params_bf16().bf16(), store.numel() * 2), 0);
  }
  EXPECT_EQ(optimizer.steps_taken(), 3);
}

// A range updated in pieces cut anywhere (inside parameters) equals the whole update: the kernel is
// elementwise and the weight decay follows the parameter.
// A frozen parameter keeps its weights through steps (weight decay included) and AdamW holds no state for it.
TEST(AdamW, FrozenParametersStayAsTheyAre) {
  ParameterStore store;
  store.add("a", {2, 5}, true, Init::normal, 0.5f);
  const int frozen = store.add("b", {3, 4}, true, Init::normal, 0.5f);
  store.add("c", {7}, false, Init::ones);
  store.freeze(frozen);
  store.allocate(false);
  store.initialize(7);
  const std::vector<float> before(store.param(frozen).f32(), store.param(frozen).f32() + 12);
  AdamW optimizer(&store, AdamWConfig{0.9f, 0.95f, 1e-8f, 0.1f});
  EXPECT_EQ(optimizer.exp_avg().numel(), 17);
  for (int step = 0; step < 3; ++step) {
    fill_grads(store, step);
    optimizer.step(1e-2f, 1.0f);
  }
  EXPECT_TRUE(bitwise_equal(store.param(frozen).f32(), before.data(), 12));
  EXPECT_GT(global_grad_norm(store), 0.0);
}

TEST(AdamWUpdateRange, PiecesEqualTheWholeRange) {
  ParameterStore whole, pieces;
  build(whole, true);
  build(pieces, true);
  const int64_t n = whole.numel();
  std::vector<float> m1(n, 0), v1(n, 0), m2(n, 0), v2(n, 0);
  const AdamWConfig config;
  const std::vector<int64_t> cuts = {0, 3, 12, 13, 31, 50};
  for (int step = 1; step <= 3; ++step) {
    fill_grads(whole, step);
    fill_grads(pieces, step);
    adamw_update_range(whole, 0, n, m1.data(), v1.data(), config, 3e-3f, 1.0f, step, true);
    for (size_t k = 0; k + 1 < cuts.size(); ++k)
      adamw_update_range(pieces, cuts[k], cuts[k + 1], m2.data() + cuts[k], v2.data() + cuts[k], config,
                         3e-3f, 1.0f, step, true);
    ASSERT_TRUE(bitwise_equal(whole.params().f32(), pieces.params().f32(), n)) << "step " << step;
    ASSERT_TRUE(bitwise_equal(m1.data(), m2.data(), n));
    ASSERT_TRUE(bitwise_equal(v1.data(), v2.data(), n));
  }
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(pieces.params_bf16().bf16()[i], f32_to_bf16_bits(pieces.params().f32()[i]));
}

TEST(AdamWUpdateRange, WithoutShadowLeavesTheShadowAlone) {
  ParameterStore store;
  build(store, true);
  const std::vector<uint16_t> before(store.params_bf16().bf16(), store.params_bf16().bf16() + store.numel());
  std::vector<float> m(store.numel(), 0), v(store.numel(), 0);
  fill_grads(store, 1);
  adamw_update_range(store, 0, store.numel(), m.data(), v.data(), AdamWConfig{}, 1e-2f, 1.0f, 1, false);
  EXPECT_EQ(std::memcmp(before.data(), store.params_bf16().bf16(), before.size() * 2), 0);
}

TEST(AdamWUpdateRange, RejectsARangeOutsideTheStore) {
  ParameterStore store;
  build(store, false);
  std::vector<float> m(60, 0), v(60, 0);
  EXPECT_THROW(adamw_update_range(store, 40, 60, m.data(), v.data(), AdamWConfig{}, 1e-2f, 1.0f, 1, false),
               Error);
}

TEST(GlobalGradNorm, IsTheNormOfTheWholeBuffer) {
  ParameterStore store;
  build(store, false);
  fill_grads(store, 2);
  double sum = 0;
  for (int64_t i = 0; i < store.numel(); ++i) sum += double(store.grads().f32()[i]) * store.grads().f32()[i];
  EXPECT_NEAR(global_grad_norm(store), std::sqrt(sum), 1e-12 * std::sqrt(sum));
  EXPECT_FLOAT_EQ(clip_coefficient(10.0, 1.0f), 1.0f / (10.0f + 1e-6f));
  EXPECT_EQ(clip_coefficient(0.5, 1.0f), 1.0f);
  EXPECT_EQ(clip_coefficient(10.0, 0.0f), 1.0f);
}

}  // namespace
}  // namespace forge::adamw_test
