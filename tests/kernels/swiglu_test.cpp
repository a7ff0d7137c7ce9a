#include <gtest/gtest.h>

#include <cmath>

#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge {
namespace {

// out[r, j] = silu(g) * u with g = gate_up[r, j], u = gate_up[r, ffn + j], in double.
std::vector<double> reference_forward(const std::vector<double>& gate_up, int64_t rows, int64_t ffn) {
  std::vector<double> out(rows * ffn);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < ffn; ++j) {
      const double g = gate_up[r * 2 * ffn + j], u = gate_up[r * 2 * ffn + ffn + j];
      out[r * ffn + j] = g / (1 + std::exp(-g)) * u;
    }
  return out;
}

TEST(Swiglu, ForwardMatchesDoubleReference) {
  const int64_t rows = 6, ffn = 29;
  auto gate_up = testing::random_floats(rows * 2 * ffn, 31, -8, 8);
  std::vector<float> out(rows * ffn);
  ops::SwigluParams p;
  p.rows = rows, p.ffn = ffn, p.gate_up = gate_up.data(), p.out = out.data();
  ops::swiglu_forward(p);
  EXPECT_LT(testing::relative_error(out, reference_forward(testing::to_double(gate_up), rows, ffn)), 1e-6);
}

TEST(Swiglu, BackwardMatchesFiniteDifferences) {
  const int64_t rows = 4, ffn = 19;
  auto gate_up = testing::random_floats(rows * 2 * ffn, 32, -5, 5);
  auto dout = testing::random_floats(rows * ffn, 33);
  std::vector<float> dgate_up(rows * 2 * ffn, 9.0f);  // overwritten
  ops::SwigluParams p;
  p.rows = rows, p.ffn = ffn, p.gate_up = gate_up.data(), p.dout = dout.data(), p.dgate_up = dgate_up.data();
  ops::swiglu_backward(p);
  const auto doutd = testing::to_double(dout);
  auto fd = testing::finite_difference(
      [&](const std::vector<double>& x) { return testing::dot(doutd, reference_forward(x, rows, ffn)); },
      testing::to_double(gate_up));
  EXPECT_LT(testing::relative_error(dgate_up, fd), 1e-6);
}

TEST(Swiglu, SaturatesCleanlyForLargeGates) {
  // silu(g) -> 0 for g << 0 and -> g for g >> 0; the exponential must not overflow to inf/NaN.
  const std::vector<float> gate_up = {-200.0f, -90.0f, 90.0f, 200.0f, 1.0f, 2.0f, 3.0f, 4.0f};
  const std::vector<float> dout = {1, 1, 1, 1};
  std::vector<float> out(4), dgate_up(8);
  ops::SwigluParams p;
  p.rows = 1, p.ffn = 4, p.gate_up = gate_up.data(), p.out = out.data(), p.dout = dout.data();
  p.dgate_up = dgate_up.data();
  ops::swiglu_forward(p);
  ops::swiglu_backward(p);
  const std::vector<float> want_out = {0.0f, 0.0f, 270.0f, 800.0f}, want_dgate = {0, 0, 3, 4};
  for (int j = 0; j < 4; ++j) {
    EXPECT_NEAR(out[j], want_out[j], 1e-30f + 1e-6f * std::abs(want_out[j])) << j;
    EXPECT_NEAR(dgate_up[j], want_dgate[j], 1e-6f) << j;
    EXPECT_NEAR(dgate_up[4 + j], want_out[j] / gate_up[4 + j], 1e-30f + 1e-6f * std::abs(want_out[j])) << j;
  }
}

}  // namespace
}  // namespace forge
