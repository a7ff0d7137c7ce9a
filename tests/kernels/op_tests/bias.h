// Bias (ops::bias_add, ops::bias_backward), written once for every backend (op_harness.h): on the CPU against
// the double-precision reference and finite differences, elsewhere against the CPU kernel on the same inputs.
//
// bias_add is one rounded addition per element on every backend: the results are the same bits. bias_backward
// adds 32-row partials in block order on every backend, additions only (nothing to contract into an FMA), so
// other backends are expected to give the CPU's bits too; the bound allows one rounding per sequential step,
// which is what the order's argument proves without running the other backend.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::bias {

using testing::DeviceArray;
using testing::kU;

// A measured error for the test's XML output (RecordProperty), in scientific notation.
inline std::string error_text(double error) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3e", error);
  return text;
}

struct Case {
  int64_t rows, n, padding;  // padding: leading dimension - n (0: the default, ld = 0)
  std::string name() const {
    return "rows" + std::to_string(rows) + "_n" + std::to_string(n) + "_pad" + std::to_string(padding);
  }
  int64_t ld() const { return padding > 0 ? n + padding : 0; }
  int64_t stride() const { return n + padding; }
  bool finite_differences() const { return rows * n <= 300; }
};

// Odd widths for the vector tails, rows inside a wider matrix (a slice of a fused projection), a single row
// and a single column, ViT widths, a wide row, and enough rows for many reduction blocks.
inline const std::vector<Case> kCases = {{7, 37, 0},    {5, 23, 3},    {1, 1, 0},    {33, 1, 2},
                                         {1, 1024, 0},  {65, 768, 5},  {4, 4096, 0}, {300, 1031, 1},
                                         {1000, 65, 0}, {2049, 130, 7}};

struct Problem {
  int64_t rows, n, stride, ld;
  std::vector<float> y, bias, dy,
      dbias;  // y and dy [rows, stride]; padding columns NaN (never read or written)
  Problem(const Case& c, uint32_t seed) : rows(c.rows), n(c.n), stride(c.stride()), ld(c.ld()) {
    y = testing::random_floats(rows * stride, seed, -2, 2);
    dy = testing::random_floats(rows * stride, seed + 1);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = n; j < stride; ++j) y[r * stride + j] = dy[r * stride + j] = std::nanf("");
    bias = testing::random_floats(n, seed + 2);
    dbias = testing::random_floats(n, seed + 3);
  }
  std::string what(const char* op) const {
    return std::string(op) + " rows=" + std::to_string(rows) + " n=" + std::to_string(n) +
           " ld=" + std::to_string(ld);
  }
  // sum_r dy[r, j] in double, and the sum of the magnitudes of the addends dbias accumulates.
  std::vector<double> column_sums(bool magnitudes) const {
    std::vector<double> sums(n);
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t j = 0; j < n; ++j)
        sums[j] += magnitudes ? std::abs(dy[r * stride + j]) : dy[r * stride + j];
    return sums;
  }
};

class BiasOp : public testing::OpTest<Case> {
 protected:
  std::vector<float> add(Device on, const Problem& pr) {
    DeviceArray<float> y(on, pr.y), bias(on, pr.bias);
    ops::BiasParams p;
    p.rows = pr.rows, p.n = pr.n, p.y = y.data(), p.y_ld = pr.ld, p.bias = bias.data();
    FORGE_TEST_OP(bias_add, on, p);
    return y.download();
  }
  std::vector<float> backward(Device on, const Problem& pr) {
    DeviceArray<float> dy(on, pr.dy), dbias(on, pr.dbias);
    ops::BiasParams p;
    p.rows = pr.rows, p.n = pr.n, p.dy = dy.data(), p.dy_ld = pr.ld, p.dbias = dbias.data();
    FORGE_TEST_OP(bias_backward, on, p);
    return dbias.download();
  }
};

TEST_P(BiasOp, Add) {
  const Problem pr(test_case(), 110);
  const std::vector<float> y = add(Device::cpu, pr);
  if (on_cpu()) {
    // One rounding of the exact sum; padding columns keep their NaN bits.
    for (int64_t r = 0; r < pr.rows; ++r)
      for (int64_t j = 0; j < pr.stride; ++j) {
        const size_t i = r * pr.stride + j;
        if (j >= pr.n) {
          ASSERT_EQ(std::bit_cast<uint32_t>(y[i]), std::bit_cast<uint32_t>(pr.y[i]))
              << "padding written at " << i;
          continue;
        }
        const double want = double{pr.y[i]} + pr.bias[j];
        ASSERT_LE(std::abs(y[i] - want), kU * std::abs(want)) << r << "," << j;
      }
    return;
  }
  testing::expect_bitwise_equal(add(device(), pr), y, pr.what("bias_add"));
}

TEST_P(BiasOp, Backward) {
  const Problem pr(test_case(), 120);
  const std::vector<float> dbias = backward(Device::cpu, pr);
  // Every one of the rows / 32 + 32 + 1 sequential steps rounds once.
  const int64_t steps = (pr.rows + 31) / 32 + 32 + 1;
  const std::vector<double> magnitude = pr.column_sums(true);
  auto bound = [&](size_t j) { return steps * kU * (magnitude[j] + std::abs(pr.dbias[j])); };
  if (on_cpu()) {
    std::vector<double> want = pr.column_sums(false);
    std::vector<float> delta(pr.n);
    for (int64_t j = 0; j < pr.n; ++j) want[j] += pr.dbias[j], delta[j] = dbias[j] - pr.dbias[j];
    std::vector<float> want_f(want.begin(), want.end());
    RecordProperty("relative_error_dbias", error_text(testing::relative_error(dbias, want)));
    testing::expect_close(dbias, want_f, pr.what("bias_backward") + " against double",
                          [&](size_t j) { return bound(j) + std::abs(want[j] - want_f[j]); });
    if (!test_case().finite_differences()) return;
    // Scalar loss <dy, y + bias>: its gradient with respect to bias is what backward accumulates.
    const auto fd = testing::finite_difference(
        [&](const std::vector<double>& b) {
          double loss = 0;
          for (int64_t r = 0; r < pr.rows; ++r)
            for (int64_t j = 0; j < pr.n; ++j)
              loss += double{pr.dy[r * pr.stride + j]} * (pr.y[r * pr.stride + j] + b[j]);
          return loss;
        },
        testing::to_double(pr.bias));
    EXPECT_LT(testing::relative_error(delta, fd), 1e-5);
    return;
  }
  testing::expect_close(backward(device(), pr), dbias, pr.what("bias_backward"),
                        [&](size_t j) { return 2 * bound(j); });
}

// backward accumulates (+=), and its reduction order is a function of the shape: the same inputs give the
// same bits on every run; from zero, a second call doubles the result exactly.
TEST_P(BiasOp, BackwardAccumulatesAndRepeats) {
  Problem pr(test_case(), 130);
  const std::vector<float> first = backward(device(), pr);
  for (int run = 1; run < 3; ++run)
    testing::expect_bitwise_equal(backward(device(), pr), first,
                                  pr.what("bias_backward") + " run " + std::to_string(run));
  pr.dbias.assign(pr.n, 0.0f);
  DeviceArray<float> dy(device(), pr.dy), dbias(device(), pr.dbias);
  ops::BiasParams p;
  p.rows = pr.rows, p.n = pr.n, p.dy = dy.data(), p.dy_ld = pr.ld, p.dbias = dbias.data();
  FORGE_TEST_OP(bias_backward, device(), p);
  const std::vector<float> once = dbias.download();
  FORGE_TEST_OP(bias_backward, device(), p);
  const std::vector<float> twice = dbias.download();
  for (int64_t j = 0; j < pr.n; ++j) EXPECT_FLOAT_EQ(twice[j], 2 * once[j]) << j;
}

}  // namespace forge::op_tests::bias
