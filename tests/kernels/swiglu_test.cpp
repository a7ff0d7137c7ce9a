// Gated linear units: the SwiGLU op tests (op_tests/swiglu.h) on the CPU and the device emulation; GeGLU
// (the tanh GELU gate, Gemma's) on the CPU, against a double-precision reference and finite differences.
#include "kernels/op_tests/swiglu.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "forge/core/error.h"
#include "op_harness.h"

namespace forge::op_tests::swiglu::swiglu_test {
namespace {

FORGE_INSTANTIATE_OP_TEST(SwigluOp, kCases, testing::Backend::cpu, testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(SwigluSaturation, testing::kFixedCase, testing::Backend::cpu,
                          testing::Backend::emulated);

// gelu_tanh(g) * u in double: g/2 (1 + tanh(sqrt(2/pi) (g + 0.044715 g^3))) * u.
std::vector<double> geglu_reference(const std::vector<double>& gate_up, int64_t rows, int64_t ffn) {
  std::vector<double> out(rows * ffn);
  const double c = std::sqrt(2.0 / M_PI);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < ffn; ++j) {
      const double g = gate_up[r * 2 * ffn + j], u = gate_up[r * 2 * ffn + ffn + j];
      out[r * ffn + j] = 0.5 * g * (1 + std::tanh(c * (g + 0.044715 * g * g * g))) * u;
    }
  return out;
}

std::vector<float> run_geglu(const Problem& pr, bool backward) {
  std::vector<float> out(pr.dout.size()), dgate_up(pr.gate_up.size(), std::nanf(""));
  ops::SwigluParams p;
  p.activation = ops::GluActivation::gelu_tanh;
  p.rows = pr.rows, p.ffn = pr.ffn, p.gate_up = pr.gate_up.data();
  if (!backward) {
    p.out = out.data();
    ops::swiglu_forward(p, Device::cpu);
    return out;
  }
  p.dout = pr.dout.data(), p.dgate_up = dgate_up.data();
  ops::swiglu_backward(p, Device::cpu);
  return dgate_up;
}

// The reference's values lie between -0.17 |u| and |g u|: fp32 sigmoid and products give ~1e-7 relative.
TEST(GegluCpu, ForwardMatchesDoubleReference) {
  for (const Case& c : kCases) {
    const Problem pr(c, 80);
    EXPECT_LT(testing::relative_error(run_geglu(pr, false),
                                      geglu_reference(testing::to_double(pr.gate_up), pr.rows, pr.ffn)),
              1e-6)
        << c.name();
  }
}

TEST(GegluCpu, BackwardMatchesFiniteDifferences) {
  for (const Case& c : kCases) {
    if (!c.finite_differences()) continue;
    const Problem pr(c, 90);
    const auto doutd = testing::to_double(pr.dout);
    const auto fd = testing::finite_difference(
        [&](const std::vector<double>& x) {
          return testing::dot(doutd, geglu_reference(x, pr.rows, pr.ffn));
        },
        testing::to_double(pr.gate_up));
    EXPECT_LT(testing::relative_error(run_geglu(pr, true), fd), 1e-6) << c.name();
  }
}

// The GELU kernel's tanh form and GeGLU's gate are one function: gelu(g) * 1 equals the GELU op bitwise.
TEST(GegluCpu, GateIsTheTanhGelu) {
  const Problem pr(Case{37, 200}, 95);
  std::vector<float> ones = pr.gate_up;
  for (int64_t r = 0; r < pr.rows; ++r)
    for (int64_t j = 0; j < pr.ffn; ++j) ones[r * 2 * pr.ffn + pr.ffn + j] = 1.0f;
  Problem unit = pr;
  unit.gate_up = ones;
  const std::vector<float> geglu = run_geglu(unit, false);
  std::vector<float> gates(pr.rows * pr.ffn), gelu(gates.size());
  for (int64_t r = 0; r < pr.rows; ++r)
    for (int64_t j = 0; j < pr.ffn; ++j) gates[r * pr.ffn + j] = ones[r * 2 * pr.ffn + j];
  ops::GeluParams g;
  g.kind = ops::GeluKind::tanh, g.n = static_cast<int64_t>(gates.size()), g.x = gates.data(),
  g.out = gelu.data();
  ops::gelu_forward(g, Device::cpu);
  EXPECT_EQ(geglu, gelu);
}

}  // namespace
}  // namespace forge::op_tests::swiglu::swiglu_test
