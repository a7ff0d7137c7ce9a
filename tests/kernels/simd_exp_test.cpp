#include "forge/kernels/cpu/simd_exp.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

namespace forge::simd_exp_test {
namespace {

TEST(SimdExp, MatchesDoubleExpWithinTwoUlp) {
  const int n = 1 << 18;
  std::vector<float> x(n), y(n);
  for (int i = 0; i < n; ++i) x[i] = -87.0f + 175.0f * static_cast<float>(i) / n;
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] = cpu::simd_exp(x[i]);
  double worst = 0;
  for (int i = 0; i < n; ++i) {
    const double want = std::exp(double{x[i]});
    worst = std::max(worst, std::abs(y[i] - want) / want);
  }
  EXPECT_LT(worst, 2 * std::numeric_limits<float>::epsilon());
}

TEST(SimdExp, NeverReturnsDenormalsOrInfinity) {
  for (float x : {-87.0f, -87.5f, -100.0f, -1e30f, -std::numeric_limits<float>::infinity()}) {
    const float y = cpu::simd_exp(x);
    EXPECT_TRUE(y == 0.0f || std::fpclassify(y) == FP_NORMAL) << x;
  }
  EXPECT_EQ(cpu::simd_exp(-88.0f), 0.0f);
  EXPECT_TRUE(std::isfinite(cpu::simd_exp(1000.0f)));
  EXPECT_TRUE(std::isnan(cpu::simd_exp(std::numeric_limits<float>::quiet_NaN())));
}

// Against double tanh over [-12, 12] (both formulas, the switch at 0.3 and the clamp at 10), relative where
// |tanh| is not tiny; odd; +-1 at the ends; NaN through.
TEST(SimdTanh, MatchesDoubleTanhWithinOneMillionth) {
  const int n = 1 << 18;
  std::vector<float> x(n), y(n);
  for (int i = 0; i < n; ++i) x[i] = -12.0f + 24.0f * static_cast<float>(i) / n;
#pragma omp simd
  for (int i = 0; i < n; ++i) y[i] = cpu::simd_tanh(x[i]);
  double worst = 0;
  for (int i = 0; i < n; ++i) {
    const double want = std::tanh(double{x[i]});
    worst = std::max(worst, std::abs(y[i] - want) / std::max(std::abs(want), 1e-30));
    ASSERT_EQ(cpu::simd_tanh(-x[i]), -y[i]) << x[i];
  }
  EXPECT_LT(worst, 1e-6);
  for (float tiny : {1e-30f, 1e-8f, 0.0f, -0.0f}) EXPECT_EQ(cpu::simd_tanh(tiny), tiny);
  EXPECT_EQ(cpu::simd_tanh(50.0f), 1.0f);
  EXPECT_EQ(cpu::simd_tanh(-std::numeric_limits<float>::infinity()), -1.0f);
  EXPECT_TRUE(std::isnan(cpu::simd_tanh(std::numeric_limits<float>::quiet_NaN())));
}

}  // namespace
}  // namespace forge::simd_exp_test
