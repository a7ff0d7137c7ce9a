// The element-wise ops: the op tests (op_tests/elementwise.h) on the CPU and the device emulation, and what
// only the CPU kernel promises (sum_squares independent of the OpenMP thread count).
#include "kernels/op_tests/elementwise.h"

#include <gtest/gtest.h>
#include <omp.h>

#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::elementwise::elementwise_test {
namespace {

FORGE_INSTANTIATE_OP_TEST(ElementwiseOp, kCases, testing::Backend::cpu, testing::Backend::emulated);

TEST(Elementwise, SumSquaresDoesNotDependOnThreadCount) {
  // Large enough to take the parallel path and span many reduction blocks, with a ragged tail.
  constexpr int64_t kN = 100003;
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
}  // namespace forge::op_tests::elementwise::elementwise_test
