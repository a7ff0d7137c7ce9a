#include "forge/fp8/scaling.h"

#include <gtest/gtest.h>

#include <cfloat>
#include <cmath>
#include <limits>

#include "forge/core/error.h"

namespace forge::fp8::scaling_test {
namespace {

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();

TEST(Fp8Scaling, ComputeScaleFormula) {
  EXPECT_EQ(compute_scale(1.0f, 448.0f, 0, 1.0f), 448.0f);
  EXPECT_EQ(compute_scale(2.0f, 448.0f, 0, 1.0f), 224.0f);
  EXPECT_EQ(compute_scale(3.0f, 448.0f, 0, 1.0f), 448.0f / 3.0f);
  EXPECT_EQ(compute_scale(2.0f, 57344.0f, 0, 1.0f), 28672.0f);
  // margin m divides by 2^m.
  EXPECT_EQ(compute_scale(1.0f, 448.0f, 1, 1.0f), 224.0f);
  EXPECT_EQ(compute_scale(1.0f, 448.0f, 3, 1.0f), 56.0f);
  EXPECT_EQ(compute_scale(3.0f, 448.0f, 2, 1.0f), 112.0f / 3.0f);
}

TEST(Fp8Scaling, UnusableAmaxKeepsThePreviousScale) {
  EXPECT_EQ(compute_scale(0.0f, 448.0f, 0, 7.0f), 7.0f);
  EXPECT_EQ(compute_scale(kInf, 448.0f, 0, 7.0f), 7.0f);
  EXPECT_EQ(compute_scale(kNaN, 448.0f, 0, 7.0f), 7.0f);
  EXPECT_EQ(compute_scale(-kNaN, 448.0f, 0, 7.0f), 7.0f);
  // The previous scale is returned as is, even with power_of_two.
  EXPECT_EQ(compute_scale(0.0f, 448.0f, 0, 7.0f, true), 7.0f);
}

TEST(Fp8Scaling, OverflowingScaleBecomesFltMax) {
  const float tiny = std::numeric_limits<float>::denorm_min();
  EXPECT_EQ(compute_scale(tiny, 448.0f, 0, 7.0f), FLT_MAX);
  EXPECT_EQ(compute_scale(1e-38f, 448.0f, 0, 7.0f), FLT_MAX);
  EXPECT_EQ(compute_scale(tiny, 448.0f, 0, 7.0f, true), std::ldexp(1.0f, 127));
  // Large amax: a small but normal scale.
  EXPECT_EQ(compute_scale(FLT_MAX, 448.0f, 0, 7.0f), 448.0f / FLT_MAX);
  EXPECT_EQ(compute_scale(FLT_MAX, 448.0f, 0, 7.0f, true), std::ldexp(1.0f, -120));
}

TEST(Fp8Scaling, PowerOfTwoRoundsDown) {
  EXPECT_EQ(compute_scale(1.0f, 448.0f, 0, 1.0f, true), 256.0f);
  EXPECT_EQ(compute_scale(3.0f, 448.0f, 0, 1.0f, true), 128.0f);      // 149.3
  EXPECT_EQ(compute_scale(0.875f, 448.0f, 0, 1.0f, true), 512.0f);    // exactly 512
  EXPECT_EQ(compute_scale(1000.0f, 448.0f, 0, 1.0f, true), 0.25f);    // 0.448
  EXPECT_EQ(compute_scale(1.0f, 57344.0f, 1, 1.0f, true), 16384.0f);  // 28672
  EXPECT_EQ(round_down_to_power_of_two(1.0f), 1.0f);
  EXPECT_EQ(round_down_to_power_of_two(std::nextafter(2.0f, 0.0f)), 1.0f);
  EXPECT_EQ(round_down_to_power_of_two(FLT_MAX), std::ldexp(1.0f, 127));
  // Subnormals keep their power of two (masking the mantissa bits would give 0).
  EXPECT_EQ(round_down_to_power_of_two(std::ldexp(3.0f, -149)), std::ldexp(1.0f, -148));
  EXPECT_EQ(round_down_to_power_of_two(std::numeric_limits<float>::denorm_min()),
            std::numeric_limits<float>::denorm_min());
}

RecipeConfig delayed(int64_t history_len, AmaxCompute compute, int margin = 0) {
  RecipeConfig config;
  config.amax_history_len = history_len;
  config.amax_compute = compute;
  config.margin = margin;
  return config;
}

// One step: record amax, update, return the new scale.
float step(DelayedScaling& state, float amax) {
  state.record(amax);
  state.update();
  return state.scale();
}

TEST(Fp8DelayedScaling, MaxOfHistoryOverSeveralSteps) {
  DelayedScaling state(DType::e4m3, delayed(3, AmaxCompute::max));
  EXPECT_EQ(state.scale(), 1.0f);  // TE's initial scale
  EXPECT_EQ(state.scale_inv(), 1.0f);
  EXPECT_EQ(step(state, 2.0f), 224.0f);  // history {2}
  EXPECT_EQ(state.scale_inv(), 1.0f / 224.0f);
  EXPECT_EQ(step(state, 4.0f), 112.0f);  // {2, 4}
  EXPECT_EQ(step(state, 1.0f), 112.0f);  // {2, 4, 1}
  EXPECT_EQ(step(state, 1.0f), 112.0f);  // {4, 1, 1}: the window is the last 3 steps
  EXPECT_EQ(step(state, 0.5f), 448.0f);  // {1, 1, 0.5}: 4 has left
  EXPECT_EQ(step(state, 0.0f), 448.0f);  // {1, 0.5, 0}
  EXPECT_EQ(step(state, 0.0f), 896.0f);  // {0.5, 0, 0}
  EXPECT_EQ(step(state, 0.0f), 896.0f);  // {0, 0, 0}: amax 0 keeps the scale
  EXPECT_EQ(state.scale_inv(), 1.0f / 896.0f);
}

TEST(Fp8DelayedScaling, MostRecent) {
  DelayedScaling state(DType::e4m3, delayed(3, AmaxCompute::most_recent));
  EXPECT_EQ(step(state, 2.0f), 224.0f);
  EXPECT_EQ(step(state, 4.0f), 112.0f);
  EXPECT_EQ(step(state, 1.0f), 448.0f);
  EXPECT_EQ(step(state, 0.5f), 896.0f);
  EXPECT_EQ(step(state, 0.0f), 896.0f);  // nothing recorded: previous scale
}

TEST(Fp8DelayedScaling, HistoryLayoutAndMargin) {
  DelayedScaling state(DType::e5m2, delayed(4, AmaxCompute::max, /*margin=*/1));
  state.record(1.0f);
  state.record(3.0f);  // several casts in one step: their max
  state.record(2.0f);
  EXPECT_EQ(state.amax_history(0), 3.0f);
  state.update();
  EXPECT_EQ(state.scale(), 57344.0f / 2.0f / 3.0f);
  EXPECT_EQ(state.amax_history(0), 0.0f);  // the new step starts empty
  EXPECT_EQ(state.amax_history(1), 3.0f);
  state.record(5.0f);
  state.update();
  EXPECT_EQ(state.amax_history(1), 5.0f);
  EXPECT_EQ(state.amax_history(2), 3.0f);
  EXPECT_EQ(state.amax_history(3), 0.0f);
  EXPECT_EQ(state.scale(), 28672.0f / 5.0f);
  EXPECT_THROW(state.amax_history(4), Error);
  EXPECT_THROW(state.record(-1.0f), Error);
}

TEST(Fp8DelayedScaling, HistoryLengthOneIsCurrentAmaxOfLastStep) {
  DelayedScaling state(DType::e4m3, delayed(1, AmaxCompute::max));
  EXPECT_EQ(step(state, 4.0f), 112.0f);
  EXPECT_EQ(step(state, 1.0f), 448.0f);
  EXPECT_EQ(step(state, 0.0f), 448.0f);
}

TEST(Fp8DelayedScaling, NanFreezesTheScaleWhileInHistory) {
  DelayedScaling state(DType::e4m3, delayed(2, AmaxCompute::max));
  EXPECT_EQ(step(state, 1.0f), 448.0f);
  state.record(kNaN);
  state.record(1.0f);  // a NaN is not forgotten by later records in the same step
  EXPECT_TRUE(std::isnan(state.amax_history(0)));
  state.update();
  EXPECT_EQ(state.scale(), 448.0f);
  EXPECT_EQ(step(state, 2.0f), 448.0f);  // {NaN, 2}
  EXPECT_EQ(step(state, 2.0f), 224.0f);  // {2, 2}
  EXPECT_EQ(step(state, kInf), 224.0f);  // inf keeps the scale as well
}

TEST(Fp8DelayedScalingGroup, ContiguousAmaxesForOneReduction) {
  DelayedScalingGroup group({DType::e4m3, DType::e4m3, DType::e5m2}, delayed(2, AmaxCompute::max));
  EXPECT_EQ(group.size(), 3);
  group.record(0, 1.0f);
  group.record(2, 2.0f);
  std::span<float> amaxes = group.current_amaxes();
  ASSERT_EQ(amaxes.size(), 3u);
  EXPECT_EQ(amaxes[0], 1.0f);
  EXPECT_EQ(amaxes[1], 0.0f);
  EXPECT_EQ(amaxes[2], 2.0f);
  // What an all-reduce (max) with another rank would leave in the buffer.
  const float other_rank[3] = {0.5f, 4.0f, 8.0f};
  for (size_t i = 0; i < 3; ++i) amaxes[i] = std::max(amaxes[i], other_rank[i]);
  group.update();
  EXPECT_EQ(group.scale(0), 448.0f);
  EXPECT_EQ(group.scale(1), 112.0f);
  EXPECT_EQ(group.scale(2), 57344.0f / 8.0f);  // E5M2's max for the gradient
  EXPECT_EQ(group.scale_inv(2), 8.0f / 57344.0f);
  for (float a : group.current_amaxes()) EXPECT_EQ(a, 0.0f);
  // Next step: tensor 1 records less; the history still remembers 4.
  group.record(1, 1.0f);
  group.update();
  EXPECT_EQ(group.scale(1), 112.0f);
  EXPECT_EQ(group.scale(0), 448.0f);
  group.update();  // {1, 0}
  EXPECT_EQ(group.scale(1), 448.0f);
  EXPECT_EQ(group.scales().size(), 3u);
  EXPECT_THROW(group.record(3, 1.0f), Error);
  EXPECT_THROW(DelayedScalingGroup({DType::bf16}, RecipeConfig{}), Error);
}

}  // namespace
}  // namespace forge::fp8::scaling_test
