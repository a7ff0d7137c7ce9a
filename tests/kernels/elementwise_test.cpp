#include <gtest/gtest.h>
#include <omp.h>

#include <string>

#include "forge/core/error.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge {
namespace {

// Large enough to take the parallel path and span many reduction blocks, with a ragged tail.
constexpr int64_t kN = 100003;

TEST(Elementwise, AddInplace) {
  auto y = testing::random_floats(kN, 81), x = testing::random_floats(kN, 82);
  auto want = y;
  for (int64_t i = 0; i < kN; ++i) want[i] += x[i];
  ops::add_inplace(y.data(), x.data(), kN);
  EXPECT_EQ(y, want);
}

TEST(Elementwise, ScaleInplace) {
  auto x = testing::random_floats(kN, 83);
  auto want = x;
  for (auto& w : want) w *= 0.37f;
  ops::scale_inplace(x.data(), 0.37f, kN);
  EXPECT_EQ(x, want);
}

TEST(Elementwise, SumSquaresMatchesDoubleReference) {
  auto x = testing::random_floats(kN, 84, -100, 100);
  double want = 0;
  for (float v : x) want += double{v} * v;
  EXPECT_NEAR(ops::sum_squares(x.data(), kN), want, 1e-13 * want);
  EXPECT_EQ(ops::sum_squares(x.data(), 0), 0.0);
  EXPECT_EQ(ops::sum_squares(x.data(), 1), double{x[0]} * x[0]);
}

// Accumulating over ranges adds each range's sum to the total in call order: bitwise the host's additions.
TEST(Elementwise, SumSquaresAccumulateAddsEachRangeInOrder) {
  auto x = testing::random_floats(kN, 86, -100, 100);
  const int64_t cut = kN / 3;
  double total = 1.5;
  ops::sum_squares_accumulate(x.data(), cut, &total);
  ops::sum_squares_accumulate(x.data() + cut, kN - cut, &total);
  ops::sum_squares_accumulate(x.data(), 0, &total);
  double want = 1.5;
  want += ops::sum_squares(x.data(), cut);
  want += ops::sum_squares(x.data() + cut, kN - cut);
  EXPECT_EQ(total, want);
  try {
    ops::sum_squares_accumulate(x.data(), kN, nullptr);
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("sum_squares_accumulate: total is null"), std::string::npos) << e.what();
  }
}

TEST(Elementwise, SumSquaresDoesNotDependOnThreadCount) {
  auto x = testing::random_floats(kN, 85, -100, 100);
  const int saved = omp_get_max_threads();
  omp_set_num_threads(1);
  const double one = ops::sum_squares(x.data(), kN);
  omp_set_num_threads(2);
  const double two = ops::sum_squares(x.data(), kN);
  omp_set_num_threads(3);
  const double three = ops::sum_squares(x.data(), kN);
  omp_set_num_threads(saved);
  EXPECT_EQ(one, two);
  EXPECT_EQ(one, three);
}

}  // namespace
}  // namespace forge
