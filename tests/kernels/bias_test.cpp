// Bias: the op tests (op_tests/bias.h) on the CPU and the device emulation, and what only the CPU kernel
// promises (results independent of the OpenMP thread count).
#include "kernels/op_tests/bias.h"

#include <gtest/gtest.h>

#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::bias::bias_test {
namespace {

FORGE_INSTANTIATE_OP_TEST(BiasOp, kCases, testing::Backend::cpu, testing::Backend::emulated);

TEST(Bias, ResultsDoNotDependOnThreadCount) {
  // Several reduction blocks and column tiles, and enough elements for the parallel loops.
  const Problem pr({301, 67, 3}, 11);
  std::vector<float> y1 = pr.y, y2 = pr.y, dbias1 = pr.dbias, dbias2 = pr.dbias;
  ops::BiasParams p;
  p.rows = pr.rows, p.n = pr.n, p.y_ld = p.dy_ld = pr.ld, p.bias = pr.bias.data(), p.dy = pr.dy.data();
  auto run = [&](std::vector<float>& y, std::vector<float>& dbias) {
    p.y = y.data(), p.dbias = dbias.data();
    ops::bias_add(p);
    ops::bias_backward(p);
  };
  testing::with_threads(1, [&] { run(y1, dbias1); });
  testing::with_threads(2, [&] { run(y2, dbias2); });
  testing::expect_bitwise_equal(y1, y2, "y");
  testing::expect_bitwise_equal(dbias1, dbias2, "dbias");
}

}  // namespace
}  // namespace forge::op_tests::bias::bias_test
