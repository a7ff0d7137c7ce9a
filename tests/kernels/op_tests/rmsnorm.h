// RMSNorm (ops::rmsnorm_*), written once for every backend (op_harness.h): on the CPU against the
// double-precision reference and finite differences, elsewhere against the CPU kernel on the same inputs.
//
// Tolerances against the CPU come from the arithmetic, not from trial runs (they were written on a machine
// without a GPU): the backends' reductions over a row differ in order, so rstd and the backward sums err
// within the bound of that many additions; element-wise formulas, which the CUDA kernels evaluate with the
// FMA pattern of the CPU build, within a few roundings of their operands' magnitudes; backward_weight adds
// 32-row partials in block order on every backend, so its bound only allows for another compiler's FMA
// contraction.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::rmsnorm {

using testing::DeviceArray;
using testing::kU;

constexpr double kEps = 1e-5;

struct Case {
  int64_t rows, dim;
  std::string name() const { return "rows" + std::to_string(rows) + "_dim" + std::to_string(dim); }
  // Small enough for finite differences of every input (two reference evaluations per element). Not a single
  // column: y = w x / sqrt(x^2 + eps) is then w sign(x) up to O(eps), and its tiny gradient drowns in the
  // differences' rounding.
  bool finite_differences() const { return rows * dim <= 300 && dim > 1; }
};

// An odd dim for the vector tails (7 x 37); small rows for finite differences; awkward sizes for the device
// kernels (never multiples of their block sizes), a wide row, a single column and a single row; and enough
// rows for several reduction blocks in backward_weight.
inline const std::vector<Case> kCases = {{7, 37},   {5, 23}, {3, 16}, {37, 200},   {300, 1031},
                                         {4, 4096}, {5, 1},  {1, 33}, {1000, 1031}};

// y = w * x / sqrt(mean(x^2) + eps), in double.
inline std::vector<double> reference_forward(const std::vector<double>& x, const std::vector<double>& w,
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

// A case's inputs (seed, seed + 1, ... for x, weight, dy and the dweight that backward_weight accumulates
// onto).
struct Problem {
  int64_t rows, dim;
  std::vector<float> x, weight, dy, dweight;
  Problem(const Case& c, uint32_t seed) : rows(c.rows), dim(c.dim) {
    x = testing::random_floats(rows * dim, seed, -2, 2);
    weight = testing::random_floats(dim, seed + 1, 0.5f, 1.5f);
    dy = testing::random_floats(rows * dim, seed + 2);
    dweight = testing::random_floats(dim, seed + 3);
  }
  std::string what(const char* op) const {
    return std::string(op) + " rows=" + std::to_string(rows) + " dim=" + std::to_string(dim);
  }
};

// Every array of the op on one device.
struct Buffers {
  DeviceArray<float> x, weight, dy, y, rstd, dx, dweight;
  Buffers(Device device, const Problem& pr)
      : x(device, pr.x),
        weight(device, pr.weight),
        dy(device, pr.dy),
        y(device, pr.x.size()),
        rstd(device, pr.rows),
        dx(device, pr.x.size()),
        dweight(device, pr.dweight) {}
  ops::RmsNormParams params(const Problem& pr) {
    ops::RmsNormParams p;
    p.rows = pr.rows, p.dim = pr.dim, p.eps = static_cast<float>(kEps);
    p.x = x.data(), p.weight = weight.data(), p.y = y.data(), p.rstd = rstd.data();
    p.dy = dy.data(), p.dx = dx.data(), p.dweight = dweight.data();
    return p;
  }
};

class RmsNormOp : public testing::OpTest<Case> {};

TEST_P(RmsNormOp, Forward) {
  const Problem pr(test_case(), 11);
  const int64_t rows = pr.rows, dim = pr.dim;
  Buffers cpu(Device::cpu, pr);
  FORGE_TEST_OP(rmsnorm_forward, Device::cpu, cpu.params(pr));
  const std::vector<float> y = cpu.y.download(), rstd = cpu.rstd.download();
  if (on_cpu()) {
    std::vector<double> want_rstd;
    const auto want =
        reference_forward(testing::to_double(pr.x), testing::to_double(pr.weight), rows, dim, &want_rstd);
    EXPECT_LT(testing::relative_error(y, want), 1e-6);
    EXPECT_LT(testing::relative_error(rstd, want_rstd), 1e-6);
    return;
  }
  Buffers dev(device(), pr);
  FORGE_TEST_OP(rmsnorm_forward, device(), dev.params(pr));
  // rstd = (sum/dim + eps)^-1/2: half the sum's relative error, plus a few roundings.
  const double rstd_tolerance = testing::reduction_tolerance(dim) / 2 + 4 * kU;
  testing::expect_close(dev.rstd.download(), rstd, pr.what("rmsnorm_forward") + " rstd",
                        [&](size_t i) { return rstd_tolerance * std::abs(rstd[i]); });
  testing::expect_close(dev.y.download(), y, pr.what("rmsnorm_forward") + " y",
                        [&](size_t i) { return (rstd_tolerance + 3 * kU) * std::abs(y[i]) + 1e-37; });
}

// Inference keeps no rstd: y is the same bits without it.
TEST_P(RmsNormOp, ForwardWithoutRstd) {
  const Problem pr(test_case(), 11);
  Buffers dev(device(), pr);
  ops::RmsNormParams p = dev.params(pr);
  FORGE_TEST_OP(rmsnorm_forward, device(), p);
  const std::vector<float> y_with = dev.y.download();
  dev.y.upload(std::vector<float>(y_with.size(), 0.0f));
  p.rstd = nullptr;
  FORGE_TEST_OP(rmsnorm_forward, device(), p);
  testing::expect_bitwise_equal(dev.y.download(), y_with, pr.what("rmsnorm_forward") + " without rstd");
}

TEST_P(RmsNormOp, BackwardInput) {
  const Problem pr(test_case(), on_cpu() ? 11 : 20);
  const int64_t rows = pr.rows, dim = pr.dim;
  Buffers cpu(Device::cpu, pr);
  const ops::RmsNormParams cpu_params = cpu.params(pr);
  FORGE_TEST_OP(rmsnorm_forward, Device::cpu, cpu_params);
  FORGE_TEST_OP(rmsnorm_backward_input, Device::cpu, cpu_params);
  const std::vector<float> rstd = cpu.rstd.download(), dx = cpu.dx.download();
  if (on_cpu()) {
    if (!test_case().finite_differences()) return;
    const auto wd = testing::to_double(pr.weight), dyd = testing::to_double(pr.dy);
    // Scalar loss <dy, y(x, w)>: its gradient is what backward computes for upstream gradient dy.
    const auto dx_fd = testing::finite_difference(
        [&](const std::vector<double>& x) { return testing::dot(dyd, reference_forward(x, wd, rows, dim)); },
        testing::to_double(pr.x));
    EXPECT_LT(testing::relative_error(dx, dx_fd), 1e-5);
    return;
  }
  // Both backends get the CPU's rstd, so only the row reduction's order differs.
  Buffers dev(device(), pr);
  dev.rstd.upload(rstd);
  dev.dx.upload(std::vector<float>(dx.size(), std::nanf("")));  // dx is overwritten, never read
  FORGE_TEST_OP(rmsnorm_backward_input, device(), dev.params(pr));
  // dx_j = r w_j dy_j - coef x_j with coef = r^3 / dim * sum_k dy_k w_k x_k: the sum's error is relative to
  // sum_k |dy_k w_k x_k|, then a few roundings of each term.
  std::vector<double> coef_abs(rows), coef(rows);
  for (int64_t r = 0; r < rows; ++r) {
    double dot = 0, dot_abs = 0;
    for (int64_t k = 0; k < dim; ++k) {
      const double t = double{pr.dy[r * dim + k]} * pr.weight[k] * pr.x[r * dim + k];
      dot += t, dot_abs += std::abs(t);
    }
    const double r3 = std::pow(double{rstd[r]}, 3) / dim;
    coef[r] = dot * r3, coef_abs[r] = dot_abs * r3;
  }
  const double dot_tolerance = testing::reduction_tolerance(dim) + 6 * kU;
  testing::expect_close(dev.dx.download(), dx, pr.what("rmsnorm_backward_input"), [&](size_t i) {
    const int64_t r = static_cast<int64_t>(i) / dim, j = static_cast<int64_t>(i) % dim;
    const double x = pr.x[i], first = std::abs(double{rstd[r]} * pr.weight[j] * pr.dy[i]);
    return dot_tolerance * coef_abs[r] * std::abs(x) + 4 * kU * (first + std::abs(coef[r] * x)) + 1e-37;
  });
}

TEST_P(RmsNormOp, BackwardWeight) {
  if (on_cpu()) {
    // dweight accumulates the gradient of <dy, y(x, w)> onto its initial value.
    const Problem pr(test_case(), 11);
    if (!test_case().finite_differences()) return;
    Buffers cpu(Device::cpu, pr);
    const ops::RmsNormParams p = cpu.params(pr);
    FORGE_TEST_OP(rmsnorm_forward, Device::cpu, p);
    FORGE_TEST_OP(rmsnorm_backward_weight, Device::cpu, p);
    const auto xd = testing::to_double(pr.x), dyd = testing::to_double(pr.dy);
    const auto dw_fd = testing::finite_difference(
        [&](const std::vector<double>& w) {
          return testing::dot(dyd, reference_forward(xd, w, pr.rows, pr.dim));
        },
        testing::to_double(pr.weight));
    const std::vector<float> dweight = cpu.dweight.download();
    std::vector<float> delta(pr.dim);
    for (int64_t j = 0; j < pr.dim; ++j) delta[j] = dweight[j] - pr.dweight[j];
    EXPECT_LT(testing::relative_error(delta, dw_fd), 1e-5);
    return;
  }
  const Problem pr(test_case(), 30);
  const int64_t rows = pr.rows, dim = pr.dim;
  const std::vector<float> rstd = testing::random_floats(rows, 33, 0.5f, 2.0f);
  Buffers cpu(Device::cpu, pr), dev(device(), pr);
  cpu.rstd.upload(rstd), dev.rstd.upload(rstd);
  FORGE_TEST_OP(rmsnorm_backward_weight, Device::cpu, cpu.params(pr));
  FORGE_TEST_OP(rmsnorm_backward_weight, device(), dev.params(pr));
  const std::vector<float> dweight = cpu.dweight.download();
  // Every one of the rows / 32 + 32 sequential steps rounds once or twice.
  const int64_t steps = (rows + 31) / 32 + 32 + 2;
  std::vector<double> magnitude(dim);
  for (int64_t j = 0; j < dim; ++j) {
    double sum = std::abs(pr.dweight[j]);
    for (int64_t r = 0; r < rows; ++r)
      sum += std::abs(double{pr.dy[r * dim + j]} * pr.x[r * dim + j] * rstd[r]);
    magnitude[j] = sum;
  }
  testing::expect_close(dev.dweight.download(), dweight, pr.what("rmsnorm_backward_weight"),
                        [&](size_t j) { return 2 * steps * kU * magnitude[j]; });
}

// backward_weight accumulates (+=): a second call from zero adds the same sum again, so the result doubles
// exactly.
TEST_P(RmsNormOp, BackwardWeightAccumulatesAcrossCalls) {
  const Problem pr(test_case(), 11);
  Buffers dev(device(), pr);
  const ops::RmsNormParams p = dev.params(pr);
  FORGE_TEST_OP(rmsnorm_forward, device(), p);
  dev.dweight.upload(std::vector<float>(pr.dim, 0.0f));
  FORGE_TEST_OP(rmsnorm_backward_weight, device(), p);
  const std::vector<float> once = dev.dweight.download();
  FORGE_TEST_OP(rmsnorm_backward_weight, device(), p);
  const std::vector<float> twice = dev.dweight.download();
  for (int64_t j = 0; j < pr.dim; ++j) EXPECT_FLOAT_EQ(twice[j], 2 * once[j]) << j;
}

// Every reduction order is a function of the shape: the same inputs give the same bits on every run.
TEST_P(RmsNormOp, BackwardWeightIsBitwiseRepeatable) {
  const Problem pr(test_case(), 40);
  const std::vector<float> rstd = testing::random_floats(pr.rows, 41, 0.5f, 2.0f);
  std::vector<float> first;
  for (int run = 0; run < 3; ++run) {
    Buffers dev(device(), pr);
    dev.rstd.upload(rstd);
    FORGE_TEST_OP(rmsnorm_backward_weight, device(), dev.params(pr));
    const std::vector<float> dweight = dev.dweight.download();
    if (run == 0)
      first = dweight;
    else
      testing::expect_bitwise_equal(dweight, first,
                                    pr.what("rmsnorm_backward_weight") + " run " + std::to_string(run));
  }
}

}  // namespace forge::op_tests::rmsnorm
