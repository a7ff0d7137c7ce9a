// LayerNorm: the op tests (op_tests/layernorm.h) on the CPU and the device emulation, and what only the CPU
// kernel promises (results independent of the OpenMP thread count).
#include "kernels/op_tests/layernorm.h"

#include <gtest/gtest.h>

#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::layernorm::layernorm_test {
namespace {

FORGE_INSTANTIATE_OP_TEST(LayerNormOp, kCases, testing::Backend::cpu, testing::Backend::emulated);

TEST(LayerNorm, ResultsDoNotDependOnThreadCount) {
  // Enough rows for several reduction blocks in backward_weight, and enough elements for the parallel loops.
  const Problem pr({301, 67, true}, 11);
  Buffers one(Device::cpu, pr), two(Device::cpu, pr);
  auto run_all = [&](Buffers& b) {
    const ops::LayerNormParams p = b.params(pr);
    ops::layernorm_forward(p);
    ops::layernorm_backward_input(p);
    ops::layernorm_backward_weight(p);
  };
  testing::with_threads(1, [&] { run_all(one); });
  testing::with_threads(2, [&] { run_all(two); });
  testing::expect_bitwise_equal(one.y.download(), two.y.download(), "y");
  testing::expect_bitwise_equal(one.mean.download(), two.mean.download(), "mean");
  testing::expect_bitwise_equal(one.rstd.download(), two.rstd.download(), "rstd");
  testing::expect_bitwise_equal(one.dx.download(), two.dx.download(), "dx");
  testing::expect_bitwise_equal(one.dweight.download(), two.dweight.download(), "dweight");
  testing::expect_bitwise_equal(one.dbias.download(), two.dbias.download(), "dbias");
}

}  // namespace
}  // namespace forge::op_tests::layernorm::layernorm_test
