// LayerNorm (ops::layernorm_*), written once for every backend (op_harness.h): on the CPU against the
// double-precision reference (every case) and finite differences (the small ones), elsewhere against the CPU
// kernel on the same inputs.
//
// Tolerances against the CPU come from the arithmetic, not from trial runs (they were written on a machine
// without a GPU): the backends' reductions over a row differ in order, so the mean, the variance and the
// backward sums err within the bound of that many additions (testing::reduction_tolerance); the
// element-wise formulas, which the CUDA kernels evaluate with the CPU build's FMA pattern, within a few
// roundings of their operands' magnitudes; backward_weight adds 32-row partials in block order on every
// backend, so its bound only allows for another compiler's FMA contraction.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::layernorm {

using testing::DeviceArray;
using testing::kU;

// A measured error for the test's XML output (RecordProperty), in scientific notation.
inline std::string error_text(double error) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3e", error);
  return text;
}

constexpr double kEps = 1e-5;

struct Case {
  int64_t rows, dim;
  bool bias;
  std::string name() const {
    return "rows" + std::to_string(rows) + "_dim" + std::to_string(dim) + (bias ? "_bias" : "_nobias");
  }
  // Small enough for finite differences of every input (two reference evaluations per element).
  bool finite_differences() const { return rows * dim <= 300; }
};

// Odd dims for the vector tails (7 x 37, 5 x 23); small rows for finite differences; a single row and a
// single column (y = bias: every input gradient is zero); ViT widths (768, 1024) and a wide row (4096);
// awkward sizes for the device kernels, never multiples of their block sizes; enough rows for several
// reduction blocks.
inline const std::vector<Case> kCases = {{7, 37, true},    {5, 23, false},    {3, 16, true},
                                         {37, 200, true},  {300, 1031, true}, {4, 4096, true},
                                         {2, 4096, false}, {1, 1024, true},   {65, 768, true},
                                         {5, 1, true},     {1, 33, false},    {1000, 1031, false}};

// Per-row statistics of the double reference.
struct Statistics {
  std::vector<double> mean, rstd;
};

// y = (x - mean) / sqrt(var + eps) * w + b, var biased (PyTorch's nn.LayerNorm), in double. b may be empty.
inline std::vector<double> reference_forward(const std::vector<double>& x, const std::vector<double>& w,
                                             const std::vector<double>& b, int64_t rows, int64_t dim,
                                             Statistics* stats = nullptr) {
  std::vector<double> y(rows * dim);
  if (stats) stats->mean.resize(rows), stats->rstd.resize(rows);
  for (int64_t r = 0; r < rows; ++r) {
    double sum = 0, squares = 0;
    for (int64_t j = 0; j < dim; ++j) sum += x[r * dim + j];
    const double mean = sum / dim;
    for (int64_t j = 0; j < dim; ++j) squares += (x[r * dim + j] - mean) * (x[r * dim + j] - mean);
    const double rstd = 1.0 / std::sqrt(squares / dim + kEps);
    if (stats) stats->mean[r] = mean, stats->rstd[r] = rstd;
    for (int64_t j = 0; j < dim; ++j)
      y[r * dim + j] = (x[r * dim + j] - mean) * rstd * w[j] + (b.empty() ? 0.0 : b[j]);
  }
  return y;
}

// The analytic gradients in double, from the reference's own statistics: dx of <dy, y> for every row, and
// dweight_j = sum_r dy_rj xhat_rj, dbias_j = sum_r dy_rj (without their initial values).
struct Gradients {
  std::vector<double> dx, dweight, dbias;
};
inline Gradients reference_backward(const std::vector<double>& x, const std::vector<double>& w,
                                    const std::vector<double>& dy, int64_t rows, int64_t dim) {
  Statistics s;
  reference_forward(x, w, {}, rows, dim, &s);
  Gradients g{std::vector<double>(rows * dim), std::vector<double>(dim), std::vector<double>(dim)};
  for (int64_t r = 0; r < rows; ++r) {
    double g_sum = 0, gx_sum = 0;
    for (int64_t j = 0; j < dim; ++j) {
      const double xhat = (x[r * dim + j] - s.mean[r]) * s.rstd[r];
      g_sum += dy[r * dim + j] * w[j], gx_sum += dy[r * dim + j] * w[j] * xhat;
      g.dweight[j] += dy[r * dim + j] * xhat, g.dbias[j] += dy[r * dim + j];
    }
    for (int64_t j = 0; j < dim; ++j) {
      const double xhat = (x[r * dim + j] - s.mean[r]) * s.rstd[r];
      g.dx[r * dim + j] = s.rstd[r] * (dy[r * dim + j] * w[j] - g_sum / dim - xhat * gx_sum / dim);
    }
  }
  return g;
}

// A case's inputs (seed, seed + 1, ...). Each row of x is offset by its own constant in [-3, 3], as a ViT's
// residual stream is, so that the mean matters; the bias is empty for a case without one.
struct Problem {
  int64_t rows, dim;
  std::vector<float> x, weight, bias, dy, dweight, dbias;
  Problem(const Case& c, uint32_t seed) : rows(c.rows), dim(c.dim) {
    x = testing::random_floats(rows * dim, seed, -2, 2);
    const std::vector<float> offset = testing::random_floats(rows, seed + 5, -3, 3);
    for (int64_t i = 0; i < rows * dim; ++i) x[i] += offset[i / dim];
    weight = testing::random_floats(dim, seed + 1, 0.5f, 1.5f);
    if (c.bias) bias = testing::random_floats(dim, seed + 6, -0.5f, 0.5f);
    dy = testing::random_floats(rows * dim, seed + 2);
    dweight = testing::random_floats(dim, seed + 3);
    dbias = testing::random_floats(dim, seed + 4);
  }
  std::string what(const char* op) const {
    return std::string(op) + " rows=" + std::to_string(rows) + " dim=" + std::to_string(dim) +
           (bias.empty() ? "" : " bias");
  }
};

// Every array of the op on one device (bias and dbias only with a bias).
struct Buffers {
  DeviceArray<float> x, weight, bias, dy, y, mean, rstd, dx, dweight, dbias;
  Buffers(Device device, const Problem& pr)
      : x(device, pr.x),
        weight(device, pr.weight),
        bias(device, pr.bias),
        dy(device, pr.dy),
        y(device, pr.x.size()),
        mean(device, pr.rows),
        rstd(device, pr.rows),
        dx(device, pr.x.size()),
        dweight(device, pr.dweight),
        dbias(device, pr.bias.empty() ? std::vector<float>{} : pr.dbias) {}
  ops::LayerNormParams params(const Problem& pr) {
    ops::LayerNormParams p;
    p.rows = pr.rows, p.dim = pr.dim, p.eps = static_cast<float>(kEps);
    p.x = x.data(), p.weight = weight.data(), p.bias = bias.data(), p.y = y.data();
    p.mean = mean.data(), p.rstd = rstd.data();
    p.dy = dy.data(), p.dx = dx.data(), p.dweight = dweight.data(), p.dbias = dbias.data();
    return p;
  }
};

class LayerNormOp : public testing::OpTest<Case> {
 protected:
  // The largest |got - want| / max |want| of an array, also recorded in the test's XML output.
  void record(const char* what, const std::vector<float>& got, const std::vector<double>& want) {
    const double error = testing::relative_error(got, want);
    RecordProperty(what, error_text(error));
  }
};

TEST_P(LayerNormOp, Forward) {
  const Problem pr(test_case(), 11);
  const int64_t rows = pr.rows, dim = pr.dim;
  Buffers cpu(Device::cpu, pr);
  FORGE_TEST_OP(layernorm_forward, Device::cpu, cpu.params(pr));
  const std::vector<float> y = cpu.y.download(), mean = cpu.mean.download(), rstd = cpu.rstd.download();
  if (on_cpu()) {
    Statistics want;
    const auto want_y = reference_forward(testing::to_double(pr.x), testing::to_double(pr.weight),
                                          testing::to_double(pr.bias), rows, dim, &want);
    record("relative_error_y", y, want_y);
    EXPECT_LT(testing::relative_error(y, want_y), 2e-6);
    EXPECT_LT(testing::relative_error(mean, want.mean), 1e-6);
    // A single column has no variance: rstd is eps^-1/2 exactly up to rounding.
    EXPECT_LT(testing::relative_error(rstd, want.rstd), 1e-6);
    return;
  }
  Buffers dev(device(), pr);
  FORGE_TEST_OP(layernorm_forward, device(), dev.params(pr));
  // The mean: a sum of dim terms in another order, relative to sum |x|. rstd = (var + eps)^-1/2: the squared
  // deviations' sum error, halved (the mean's error changes var only to second order), and a few roundings.
  std::vector<double> mean_tolerance(rows);
  for (int64_t r = 0; r < rows; ++r) {
    double sum_abs = 0;
    for (int64_t j = 0; j < dim; ++j) sum_abs += std::abs(pr.x[r * dim + j]);
    mean_tolerance[r] = testing::reduction_tolerance(dim) * sum_abs / dim + 2 * kU * std::abs(mean[r]);
  }
  const double rstd_tolerance = testing::reduction_tolerance(dim) / 2 + 4 * kU;
  testing::expect_close(dev.mean.download(), mean, pr.what("layernorm_forward") + " mean",
                        [&](size_t r) { return mean_tolerance[r] + 1e-37; });
  testing::expect_close(dev.rstd.download(), rstd, pr.what("layernorm_forward") + " rstd",
                        [&](size_t r) { return rstd_tolerance * std::abs(rstd[r]); });
  // y = (x - mean) r w + b: the mean's error scaled by r w, rstd's relative error on xhat w, and a few
  // roundings of each term.
  testing::expect_close(dev.y.download(), y, pr.what("layernorm_forward") + " y", [&](size_t i) {
    const int64_t r = static_cast<int64_t>(i) / dim, j = static_cast<int64_t>(i) % dim;
    const double w = std::abs(pr.weight[j]), centred = std::abs(double{pr.x[i]} - mean[r]);
    const double b = pr.bias.empty() ? 0.0 : std::abs(pr.bias[j]);
    return w * rstd[r] * (mean_tolerance[r] + 2 * kU * centred) +
           w * centred * rstd[r] * (rstd_tolerance + 4 * kU) + 2 * kU * (std::abs(y[i]) + b) + 1e-37;
  });
}

// Inference keeps no statistics: y is the same bits without them.
TEST_P(LayerNormOp, ForwardWithoutStatistics) {
  const Problem pr(test_case(), 11);
  Buffers dev(device(), pr);
  ops::LayerNormParams p = dev.params(pr);
  FORGE_TEST_OP(layernorm_forward, device(), p);
  const std::vector<float> y_with = dev.y.download();
  dev.y.upload(std::vector<float>(y_with.size(), 0.0f));
  p.mean = nullptr, p.rstd = nullptr;
  FORGE_TEST_OP(layernorm_forward, device(), p);
  testing::expect_bitwise_equal(dev.y.download(), y_with,
                                pr.what("layernorm_forward") + " without statistics");
}

TEST_P(LayerNormOp, BackwardInput) {
  const Problem pr(test_case(), on_cpu() ? 11 : 20);
  const int64_t rows = pr.rows, dim = pr.dim;
  Buffers cpu(Device::cpu, pr);
  const ops::LayerNormParams cpu_params = cpu.params(pr);
  FORGE_TEST_OP(layernorm_forward, Device::cpu, cpu_params);
  FORGE_TEST_OP(layernorm_backward_input, Device::cpu, cpu_params);
  const std::vector<float> mean = cpu.mean.download(), rstd = cpu.rstd.download(), dx = cpu.dx.download();
  if (on_cpu()) {
    const auto xd = testing::to_double(pr.x), wd = testing::to_double(pr.weight),
               dyd = testing::to_double(pr.dy);
    const Gradients want = reference_backward(xd, wd, dyd, rows, dim);
    // Errors relative to the largest r dy w, dx's first term: with a single column dx is exactly zero, and
    // its rounding residue is relative to that term, not to the zero.
    double scale = 1e-30;
    for (int64_t i = 0; i < rows * dim; ++i)
      scale = std::max(scale, std::abs(double{rstd[i / dim]} * pr.dy[i] * pr.weight[i % dim]));
    auto error = [&](const std::vector<double>& want_dx) {
      double worst = 0, largest = scale;
      for (size_t i = 0; i < dx.size(); ++i)
        worst = std::max(worst, std::abs(dx[i] - want_dx[i])),
        largest = std::max(largest, std::abs(want_dx[i]));
      return worst / largest;
    };
    RecordProperty("relative_error_dx", error_text(error(want.dx)));
    EXPECT_LT(error(want.dx), 1e-5);
    if (!test_case().finite_differences()) return;
    // Scalar loss <dy, y(x, w, b)>: its gradient is what backward computes for upstream gradient dy. The
    // analytic reference above must agree too, or it proves nothing on the large cases.
    const auto bd = testing::to_double(pr.bias);
    const auto dx_fd = testing::finite_difference(
        [&](const std::vector<double>& x) {
          return testing::dot(dyd, reference_forward(x, wd, bd, rows, dim));
        },
        xd);
    EXPECT_LT(error(dx_fd), 1e-5);
    double reference_error = 0;
    for (size_t i = 0; i < dx_fd.size(); ++i)
      reference_error = std::max(reference_error, std::abs(want.dx[i] - dx_fd[i]));
    EXPECT_LT(reference_error / scale, 1e-7) << "the analytic reference disagrees with finite differences";
    return;
  }
  // Both backends get the CPU's statistics, so only the row reductions' order differs.
  Buffers dev(device(), pr);
  dev.mean.upload(mean), dev.rstd.upload(rstd);
  dev.dx.upload(std::vector<float>(dx.size(), std::nanf("")));  // dx is overwritten, never read
  FORGE_TEST_OP(layernorm_backward_input, device(), dev.params(pr));
  // dx_j = r (g_j - mean(g) - xhat_j mean(g xhat)), g = dy w: each mean errs relative to the mean of its
  // terms' magnitudes; then a few roundings of each term.
  std::vector<double> g_mean(rows), g_abs(rows), gx_mean(rows), gx_abs(rows);
  auto xhat_of = [&](size_t i) { return (double{pr.x[i]} - mean[i / dim]) * rstd[i / dim]; };
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < dim; ++j) {
      const size_t i = r * dim + j;
      const double g = double{pr.dy[i]} * pr.weight[j];
      g_mean[r] += g / dim, g_abs[r] += std::abs(g) / dim;
      gx_mean[r] += g * xhat_of(i) / dim, gx_abs[r] += std::abs(g * xhat_of(i)) / dim;
    }
  }
  const double sum_tolerance = testing::reduction_tolerance(dim) + 4 * kU;
  testing::expect_close(dev.dx.download(), dx, pr.what("layernorm_backward_input"), [&](size_t i) {
    const int64_t r = static_cast<int64_t>(i) / dim, j = static_cast<int64_t>(i) % dim;
    const double xhat = std::abs(xhat_of(i)), g = std::abs(double{pr.dy[i]} * pr.weight[j]);
    return rstd[r] * (sum_tolerance * (g_abs[r] + xhat * gx_abs[r]) +
                      6 * kU * (g + std::abs(g_mean[r]) + xhat * std::abs(gx_mean[r]))) +
           1e-37;
  });
}

TEST_P(LayerNormOp, BackwardWeight) {
  if (on_cpu()) {
    // dweight and dbias accumulate the gradient of <dy, y(x, w, b)> onto their initial values.
    const Problem pr(test_case(), 11);
    const int64_t rows = pr.rows, dim = pr.dim;
    Buffers cpu(Device::cpu, pr);
    const ops::LayerNormParams p = cpu.params(pr);
    FORGE_TEST_OP(layernorm_forward, Device::cpu, p);
    FORGE_TEST_OP(layernorm_backward_weight, Device::cpu, p);
    const std::vector<float> dweight = cpu.dweight.download(), dbias = cpu.dbias.download();
    std::vector<float> delta_w(dim), delta_b(pr.bias.empty() ? 0 : dim);
    for (int64_t j = 0; j < dim; ++j) delta_w[j] = dweight[j] - pr.dweight[j];
    for (size_t j = 0; j < delta_b.size(); ++j) delta_b[j] = dbias[j] - pr.dbias[j];
    const auto xd = testing::to_double(pr.x), wd = testing::to_double(pr.weight),
               dyd = testing::to_double(pr.dy);
    const Gradients want = reference_backward(xd, wd, dyd, rows, dim);
    // The subtraction of the initial value rounds once more (relative to it, of the order of the result).
    record("relative_error_dweight", delta_w, want.dweight);
    EXPECT_LT(testing::relative_error(delta_w, want.dweight), 1e-5);
    if (!delta_b.empty()) {
      record("relative_error_dbias", delta_b, want.dbias);
      EXPECT_LT(testing::relative_error(delta_b, want.dbias), 1e-5);
    }
    if (!test_case().finite_differences()) return;
    const auto bd = testing::to_double(pr.bias);
    const auto dw_fd = testing::finite_difference(
        [&](const std::vector<double>& w) {
          return testing::dot(dyd, reference_forward(xd, w, bd, rows, dim));
        },
        wd);
    EXPECT_LT(testing::relative_error(delta_w, dw_fd), 1e-5);
    if (!delta_b.empty()) {
      const auto db_fd = testing::finite_difference(
          [&](const std::vector<double>& b) {
            return testing::dot(dyd, reference_forward(xd, wd, b, rows, dim));
          },
          bd);
      EXPECT_LT(testing::relative_error(delta_b, db_fd), 1e-5);
    }
    return;
  }
  const Problem pr(test_case(), 30);
  const int64_t rows = pr.rows, dim = pr.dim;
  const std::vector<float> mean = testing::random_floats(rows, 32, -1.0f, 1.0f);
  const std::vector<float> rstd = testing::random_floats(rows, 33, 0.5f, 2.0f);
  Buffers cpu(Device::cpu, pr), dev(device(), pr);
  cpu.mean.upload(mean), dev.mean.upload(mean), cpu.rstd.upload(rstd), dev.rstd.upload(rstd);
  FORGE_TEST_OP(layernorm_backward_weight, Device::cpu, cpu.params(pr));
  FORGE_TEST_OP(layernorm_backward_weight, device(), dev.params(pr));
  const std::vector<float> dweight = cpu.dweight.download(), dbias = cpu.dbias.download();
  // Every one of the rows / 32 + 32 sequential steps rounds once or twice (xhat twice more).
  const int64_t steps = (rows + 31) / 32 + 32 + 4;
  std::vector<double> magnitude_w(dim), magnitude_b(dim);
  for (int64_t j = 0; j < dim; ++j) {
    double sum_w = std::abs(pr.dweight[j]), sum_b = std::abs(pr.dbias[j]);
    for (int64_t r = 0; r < rows; ++r) {
      const double d = pr.dy[r * dim + j];
      sum_w += std::abs(d * (double{pr.x[r * dim + j]} - mean[r]) * rstd[r]), sum_b += std::abs(d);
    }
    magnitude_w[j] = sum_w, magnitude_b[j] = sum_b;
  }
  testing::expect_close(dev.dweight.download(), dweight, pr.what("layernorm_backward_weight") + " dweight",
                        [&](size_t j) { return 2 * steps * kU * magnitude_w[j]; });
  if (!pr.bias.empty())
    testing::expect_close(dev.dbias.download(), dbias, pr.what("layernorm_backward_weight") + " dbias",
                          [&](size_t j) { return 2 * steps * kU * magnitude_b[j]; });
}

// backward_weight accumulates (+=): a second call from zero adds the same sums again, so the results double
// exactly. Without dbias, dweight is the same bits and dbias untouched.
TEST_P(LayerNormOp, BackwardWeightAccumulatesAcrossCalls) {
  const Problem pr(test_case(), 11);
  Buffers dev(device(), pr);
  ops::LayerNormParams p = dev.params(pr);
  FORGE_TEST_OP(layernorm_forward, device(), p);
  dev.dweight.upload(std::vector<float>(pr.dim, 0.0f));
  if (!pr.bias.empty()) dev.dbias.upload(std::vector<float>(pr.dim, 0.0f));
  FORGE_TEST_OP(layernorm_backward_weight, device(), p);
  const std::vector<float> once = dev.dweight.download(), once_b = dev.dbias.download();
  FORGE_TEST_OP(layernorm_backward_weight, device(), p);
  const std::vector<float> twice = dev.dweight.download(), twice_b = dev.dbias.download();
  for (int64_t j = 0; j < pr.dim; ++j) EXPECT_FLOAT_EQ(twice[j], 2 * once[j]) << j;
  for (size_t j = 0; j < once_b.size(); ++j) EXPECT_FLOAT_EQ(twice_b[j], 2 * once_b[j]) << j;
  dev.dweight.upload(std::vector<float>(pr.dim, 0.0f));
  p.dbias = nullptr;
  FORGE_TEST_OP(layernorm_backward_weight, device(), p);
  testing::expect_bitwise_equal(dev.dweight.download(), once,
                                pr.what("layernorm_backward_weight") + " no dbias");
  testing::expect_bitwise_equal(dev.dbias.download(), twice_b,
                                pr.what("layernorm_backward_weight") + " dbias");
}

// Every reduction order is a function of the shape: the same inputs give the same bits on every run.
TEST_P(LayerNormOp, IsBitwiseRepeatable) {
  const Problem pr(test_case(), 40);
  std::vector<float> first_y, first_dx, first_dweight, first_dbias;
  for (int run = 0; run < 3; ++run) {
    Buffers dev(device(), pr);
    const ops::LayerNormParams p = dev.params(pr);
    FORGE_TEST_OP(layernorm_forward, device(), p);
    FORGE_TEST_OP(layernorm_backward_input, device(), p);
    FORGE_TEST_OP(layernorm_backward_weight, device(), p);
    const std::vector<float> y = dev.y.download(), dx = dev.dx.download();
    const std::vector<float> dweight = dev.dweight.download(), dbias = dev.dbias.download();
    if (run == 0) {
      first_y = y, first_dx = dx, first_dweight = dweight, first_dbias = dbias;
      continue;
    }
    const std::string what = pr.what("layernorm") + " run " + std::to_string(run);
    testing::expect_bitwise_equal(y, first_y, what + " y");
    testing::expect_bitwise_equal(dx, first_dx, what + " dx");
    testing::expect_bitwise_equal(dweight, first_dweight, what + " dweight");
    testing::expect_bitwise_equal(dbias, first_dbias, what + " dbias");
  }
}

}  // namespace forge::op_tests::layernorm
