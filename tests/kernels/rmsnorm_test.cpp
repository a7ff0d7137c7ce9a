// RMSNorm: the op tests (op_tests/rmsnorm.h) on the CPU and the device emulation, and what only the CPU
// kernel promises (results independent of the OpenMP thread count).
#include "kernels/op_tests/rmsnorm.h"

#include <gtest/gtest.h>
#include <omp.h>

#include <cstring>

#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::rmsnorm::rmsnorm_test {
namespace {

FORGE_INSTANTIATE_OP_TEST(RmsNormOp, kCases, testing::Backend::cpu, testing::Backend::emulated);

TEST(RmsNorm, ResultsDoNotDependOnThreadCount) {
  // Enough rows for several reduction blocks in backward_weight.
  const Problem pr({301, 67}, 11);
  Buffers one(Device::cpu, pr), two(Device::cpu, pr);
  auto run_all = [&](Buffers& b) {
    const ops::RmsNormParams p = b.params(pr);
    ops::rmsnorm_forward(p);
    ops::rmsnorm_backward_input(p);
    ops::rmsnorm_backward_weight(p);
  };
  testing::with_threads(1, [&] { run_all(one); });
  testing::with_threads(2, [&] { run_all(two); });
  testing::expect_bitwise_equal(one.y.download(), two.y.download(), "y");
  testing::expect_bitwise_equal(one.dx.download(), two.dx.download(), "dx");
  testing::expect_bitwise_equal(one.dweight.download(), two.dweight.download(), "dweight");
}

}  // namespace
}  // namespace forge::op_tests::rmsnorm::rmsnorm_test
