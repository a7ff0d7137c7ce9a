// The grouped GEMMs: the op tests (op_tests/grouped_gemm.h) on the CPU and the device emulation, and on the
// CPU the three layouts as one another's gradients (finite differences).
#include "kernels/op_tests/grouped_gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::grouped_gemm::grouped_gemm_test {
namespace {

FORGE_INSTANTIATE_OP_TEST(GroupedGemmOp, kCases, testing::Backend::cpu, testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(GroupedGemmFixed, testing::kFixedCase, testing::Backend::cpu,
                          testing::Backend::emulated);

// For y = m_grouped(x, W) (NT: W_g [n, k]) and the loss <dy, y>: the input gradient is m_grouped(dy, W) (NN)
// and the weight gradient k_grouped(dy, x), checked by finite differences in double (fp32, small sizes).
TEST(GroupedGemm, ThreeLayoutsAreOneAnothersGradients) {
  const std::vector<int64_t> offsets = {0, 3, 3, 8, 9};  // 4 experts, the second empty
  const int64_t groups = 4, rows = 9, n = 5, k = 7;
  const std::vector<float> x = testing::random_floats(rows * k, 1),
                           w = testing::random_floats(groups * n * k, 2);
  const std::vector<float> dy = testing::random_floats(rows * n, 3);
  const auto forward = [&](const std::vector<double>& xv, const std::vector<double>& wv) {
    std::vector<double> y(rows * n, 0.0);
    for (int64_t g = 0; g < groups; ++g)
      for (int64_t r = offsets[g]; r < offsets[g + 1]; ++r)
        for (int64_t j = 0; j < n; ++j)
          for (int64_t l = 0; l < k; ++l) y[r * n + j] += xv[r * k + l] * wv[g * n * k + j * k + l];
    return y;
  };
  const auto dyd = testing::to_double(dy), xd = testing::to_double(x), wd = testing::to_double(w);
  const auto want_dx = testing::finite_difference(
      [&](const std::vector<double>& v) { return testing::dot(dyd, forward(v, wd)); }, xd);
  const auto want_dw = testing::finite_difference(
      [&](const std::vector<double>& v) { return testing::dot(dyd, forward(xd, v)); }, wd);
  ops::GroupedGemmParams p;
  p.groups = groups, p.offsets = offsets.data();
  std::vector<float> dx(rows * k, std::nanf("")), dw(groups * n * k, 0.0f);
  p.n = k, p.k = n, p.a = dy.data(), p.lda = n, p.b = w.data(), p.ldb = k, p.b_group_stride = n * k;
  p.trans_b = false, p.c = dx.data(), p.ldc = k;
  ops::m_grouped_gemm(p);
  EXPECT_LT(testing::relative_error(dx, want_dx), 1e-6);
  ops::GroupedGemmParams q;
  q.groups = groups, q.offsets = offsets.data(), q.m = n, q.n = k;
  q.a = dy.data(), q.lda = n, q.b = x.data(), q.ldb = k, q.c = dw.data(), q.ldc = k, q.c_group_stride = n * k;
  q.beta = 1;
  ops::k_grouped_gemm(q);
  EXPECT_LT(testing::relative_error(dw, want_dw), 1e-6);
  // The empty expert's gradient stays what it was (zero): beta = 1.
  for (int64_t i = 0; i < n * k; ++i) EXPECT_EQ(dw[n * k + i], 0.0f);
}

}  // namespace
}  // namespace forge::op_tests::grouped_gemm::grouped_gemm_test
