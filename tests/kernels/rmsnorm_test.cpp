#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstring>

#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge {
namespace {

constexpr double kEps = 1e-5;

// y = w * x / sqrt(mean(x^2) + eps), in double.
std::vector<double> reference_forward(const std::vector<double>& x, const std::vector<double>& w,
                                      int64_t rows, int64_t dim, std::vector<double>* rstd = nullptr) {
  std::vector<double> y(rows * dim);
  if (rstd) rstd->resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    double ss = 0;
    for (int64_t j = 0; j < dim; ++j) ss += x[r * dim + j] * x[r * dim + j];
    const double s = 1.0 / std::sqrt(ss / dim + kEps);
    if (rstd) (*rstd)[r] = s;
    for (int64_t j = 0; j < dim; ++j) y[r * dim + j] = w[j] * x[r * dim + j] * s;
  }
  return y;
}

struct Problem {
  int64_t rows, dim;
  std::vector<float> x, w, dy, y, rstd, dx, dweight;
  explicit Problem(int64_t rows_, int64_t dim_) : rows(rows_), dim(dim_) {
    x = testing::random_floats(rows * dim, 11, -2, 2);
    w = testing::random_floats(dim, 12, 0.5f, 1.5f);
    dy = testing::random_floats(rows * dim, 13);
    y.assign(rows * dim, 0), rstd.assign(rows, 0), dx.assign(rows * dim, 7.0f);
    dweight = testing::random_floats(dim, 14);  // backward_weight accumulates onto this
  }
  ops::RmsNormParams params() {
    ops::RmsNormParams p;
    p.rows = rows, p.dim = dim, p.eps = static_cast<float>(kEps);
    p.x = x.data(), p.weight = w.data(), p.y = y.data(), p.rstd = rstd.data();
    p.dy = dy.data(), p.dx = dx.data(), p.dweight = dweight.data();
    return p;
  }
  void run_all() {
    auto p = params();
    ops::rmsnorm_forward(p);
    ops::rmsnorm_backward_input(p);
    ops::rmsnorm_backward_weight(p);
  }
};

TEST(RmsNorm, ForwardMatchesDoubleReference) {
  Problem pr(7, 37);  // odd dim exercises the vector tails
  auto p = pr.params();
  ops::rmsnorm_forward(p);
  std::vector<double> rstd;
  auto want = reference_forward(testing::to_double(pr.x), testing::to_double(pr.w), pr.rows, pr.dim, &rstd);
  EXPECT_LT(testing::relative_error(pr.y, want), 1e-6);
  EXPECT_LT(testing::relative_error(pr.rstd, rstd), 1e-6);
}

TEST(RmsNorm, BackwardMatchesFiniteDifferences) {
  Problem pr(5, 23);
  const auto initial_dweight = pr.dweight;
  pr.run_all();
  const auto xd = testing::to_double(pr.x), wd = testing::to_double(pr.w), dyd = testing::to_double(pr.dy);
  // Scalar loss <dy, y(x, w)>: its gradients are what backward computes for upstream gradient dy.
  auto dx_fd = testing::finite_difference(
      [&](const std::vector<double>& x) {
        return testing::dot(dyd, reference_forward(x, wd, pr.rows, pr.dim));
      },
      xd);
  auto dw_fd = testing::finite_difference(
      [&](const std::vector<double>& w) {
        return testing::dot(dyd, reference_forward(xd, w, pr.rows, pr.dim));
      },
      wd);
  EXPECT_LT(testing::relative_error(pr.dx, dx_fd), 1e-5);
  std::vector<float> dweight_delta(pr.dim);
  for (int64_t j = 0; j < pr.dim; ++j) dweight_delta[j] = pr.dweight[j] - initial_dweight[j];
  EXPECT_LT(testing::relative_error(dweight_delta, dw_fd), 1e-5);
}

TEST(RmsNorm, BackwardWeightAccumulatesAcrossCalls) {
  Problem pr(3, 16);
  auto p = pr.params();
  ops::rmsnorm_forward(p);
  std::fill(pr.dweight.begin(), pr.dweight.end(), 0.0f);
  ops::rmsnorm_backward_weight(p);
  const auto once = pr.dweight;
  ops::rmsnorm_backward_weight(p);
  for (int64_t j = 0; j < pr.dim; ++j) EXPECT_FLOAT_EQ(pr.dweight[j], 2 * once[j]);
}

TEST(RmsNorm, ResultsDoNotDependOnThreadCount) {
  // Enough rows for several reduction blocks in backward_weight.
  Problem one(301, 67), two(301, 67);
  testing::with_threads(1, [&] { one.run_all(); });
  testing::with_threads(2, [&] { two.run_all(); });
  EXPECT_EQ(0, std::memcmp(one.y.data(), two.y.data(), one.y.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(one.dx.data(), two.dx.data(), one.dx.size() * sizeof(float)));
  EXPECT_EQ(0, std::memcmp(one.dweight.data(), two.dweight.data(), one.dweight.size() * sizeof(float)));
}

}  // namespace
}  // namespace forge
