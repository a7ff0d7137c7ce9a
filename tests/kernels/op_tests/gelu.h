// GELU (ops::gelu_*), written once for every backend (op_harness.h): on the CPU against the double-precision
// reference (every element, every kind) and finite differences (the small cases), elsewhere against the CPU
// kernel on the same inputs.
//
// Bounds, per element, from the arithmetic. The tanh and quick forms are x sigmoid(t) with t = 2u or 1.702 x:
// the few roundings that make t err by a few ulp of |t|, and exp(-t) turns an absolute error in t into the
// same relative error, so the bound grows with |t| (the far negative tail, where gelu is tiny). The exact
// form's erfc is a few ulp on either backend (glibc's and CUDA's erfcf), and its tail, like exp(-x^2 / 2) in
// the derivative, decays as exp(-x^2 / 2): the rounding of -x / sqrt(2) grows the bound with x^2. The
// derivatives are sums of two terms that cancel near gelu's minimum (x ~ -0.75), so their bounds are relative
// to the terms' magnitudes, not to the (small) sum. The CUDA kernels use the CPU's exponential and operation
// order; the same bounds hold against the CPU.
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <string>
#include <vector>

#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::gelu {

using testing::DeviceArray;
using testing::kU;

// A measured error for the test's XML output (RecordProperty), in scientific notation.
inline std::string error_text(double error) {
  char text[32];
  std::snprintf(text, sizeof text, "%.3e", error);
  return text;
}

struct Case {
  int64_t n;
  ops::GeluKind kind;
  std::string name() const {
    const char* kind_name = kind == ops::GeluKind::erf    ? "erf"
                            : kind == ops::GeluKind::tanh ? "tanh"
                                                          : "quick";
    return std::string(kind_name) + "_n" + std::to_string(n);
  }
  bool finite_differences() const { return n <= 300; }
};

// Every kind at: a single element, odd lengths for the vector tails, small ones for finite differences, a ViT
// row (1024), a wide one (4096) and one long enough for the CPU's parallel loop (2^15 + 3).
inline const std::vector<Case> kCases = [] {
  std::vector<Case> cases;
  for (ops::GeluKind kind : {ops::GeluKind::erf, ops::GeluKind::tanh, ops::GeluKind::quick})
    for (int64_t n : {1, 37, 200, 1024, 4096, 32771}) cases.push_back({n, kind});
  return cases;
}();

// One element of the reference in double: gelu, gelu', the derivative's two terms' magnitude and |t| (x^2
// for erf). The forms are the kernels' non-cancelling ones (1 + tanh(u) = 2 sigmoid(2u), 1 - tanh(u)^2 =
// 4 sigmoid(2u) sigmoid(-2u)), in double: near x = -9.4 the configs' 0.5 x (1 + tanh(u)) is 0 even in double,
// while the true value is -6e-32. GeluKnownValues checks them against the configs' formulas where neither
// cancels.
struct Reference {
  double value, derivative, derivative_terms, t;
};
inline double sigmoid(double t) { return t >= 0 ? 1 / (1 + std::exp(-t)) : std::exp(t) / (1 + std::exp(t)); }
inline Reference reference(ops::GeluKind kind, double x) {
  constexpr double kPi = 3.14159265358979323846;
  switch (kind) {
    case ops::GeluKind::erf: {
      const double cdf = 0.5 * std::erfc(-x / std::sqrt(2.0)),
                   pdf = std::exp(-0.5 * x * x) / std::sqrt(2 * kPi);
      // erfc(z) and exp(-x^2 / 2) decay as exp(-x^2 / 2): an ulp or two of their arguments is x^2 ulp of
      // them.
      return {x * cdf, cdf + x * pdf, cdf + std::abs(x * pdf), x * x};
    }
    case ops::GeluKind::tanh: {
      const double c = std::sqrt(2 / kPi), u = c * (x + 0.044715 * x * x * x),
                   du = c * (1 + 3 * 0.044715 * x * x);
      const double s = sigmoid(2 * u), second = 2 * x * du * s * sigmoid(-2 * u);
      return {x * s, s + second, s + std::abs(second), std::abs(2 * u)};
    }
    case ops::GeluKind::quick:
    default: {
      const double s = sigmoid(1.702 * x), second = 1.702 * x * s * sigmoid(-1.702 * x);
      return {x * s, s + second, s + std::abs(second), std::abs(1.702 * x)};
    }
  }
}

// The relative bound on an element: 16 roundings (erfc or exp, the products), plus 4 ulp of |t| for the
// exponential's argument.
inline double relative_bound(const Reference& r) { return (16 + 4 * r.t) * kU; }

struct Problem {
  int64_t n;
  ops::GeluKind kind;
  std::vector<float> x, dy;
  Problem(const Case& c, uint32_t seed) : n(c.n), kind(c.kind) {
    x = testing::random_floats(n, seed, -6, 6);
    dy = testing::random_floats(n, seed + 1);
    // Zeros, a tiny value, gelu's minimum, the erf form's far tail and the exponential's clamps (simd_exp
    // returns 0 below -87 and clamps above 88: t = -2u reaches 87 near x = -9.4 in the tanh form, 1.702 x
    // near x = -51 in the quick one).
    const float special[] = {0.0f, -0.0f, 1e-30f, -0.7517916f, -9.0f, -9.4f, -12.0f, -51.0f, 52.0f, 30.0f};
    for (size_t k = 0; k < std::size(special); ++k) x[(k * 13) % n] = special[k];
  }
  std::string what(const char* op) const {
    return std::string(op) + " " + ops::gelu_kind_name(kind) + " n=" + std::to_string(n);
  }
};

class GeluOp : public testing::OpTest<Case> {
 protected:
  // out (forward) or dx (backward) of the op on `on`; the output starts as NaN (overwritten, never read).
  std::vector<float> run(Device on, const Problem& pr, bool backward) {
    DeviceArray<float> x(on, pr.x), dy(on, pr.dy), out(on, std::vector<float>(pr.n, std::nanf("")));
    ops::GeluParams p;
    p.n = pr.n, p.kind = pr.kind, p.x = x.data();
    if (backward) {
      p.dy = dy.data(), p.dx = out.data();
      FORGE_TEST_OP(gelu_backward, on, p);
    } else {
      p.out = out.data();
      FORGE_TEST_OP(gelu_forward, on, p);
    }
    return out.download();
  }
};

TEST_P(GeluOp, Forward) {
  const Problem pr(test_case(), 80);
  const std::vector<float> out = run(Device::cpu, pr, false);
  // The 1e-37 floor: the exponential's flush to zero below exp(-87).
  auto bound = [&](size_t i) {
    const Reference r = reference(pr.kind, pr.x[i]);
    return relative_bound(r) * std::abs(r.value) + 1e-37;
  };
  if (on_cpu()) {
    std::vector<double> want(pr.n);
    for (int64_t i = 0; i < pr.n; ++i) want[i] = reference(pr.kind, pr.x[i]).value;
    RecordProperty("relative_error_out", error_text(testing::relative_error(out, want)));
    std::vector<float> want_f(want.begin(), want.end());
    testing::expect_close(out, want_f, pr.what("gelu_forward") + " against double", [&](size_t i) {
      return bound(i) + std::abs(want[i] - want_f[i]);  // the reference's own rounding to float
    });
    return;
  }
  testing::expect_close(run(device(), pr, false), out, pr.what("gelu_forward"),
                        [&](size_t i) { return 2 * bound(i); });
}

TEST_P(GeluOp, Backward) {
  const Problem pr(test_case(), 90);
  const std::vector<float> dx = run(Device::cpu, pr, true);
  auto bound = [&](size_t i) {
    const Reference r = reference(pr.kind, pr.x[i]);
    return relative_bound(r) * std::abs(pr.dy[i]) * r.derivative_terms + 1e-37;
  };
  if (on_cpu()) {
    std::vector<double> want(pr.n);
    for (int64_t i = 0; i < pr.n; ++i) want[i] = pr.dy[i] * reference(pr.kind, pr.x[i]).derivative;
    RecordProperty("relative_error_dx", error_text(testing::relative_error(dx, want)));
    std::vector<float> want_f(want.begin(), want.end());
    testing::expect_close(dx, want_f, pr.what("gelu_backward") + " against double",
                          [&](size_t i) { return bound(i) + std::abs(want[i] - want_f[i]); });
    if (!test_case().finite_differences()) return;
    // Scalar loss <dy, gelu(x)>: its gradient is dy gelu'(x), what backward computes.
    const auto dyd = testing::to_double(pr.dy);
    const auto fd = testing::finite_difference(
        [&](const std::vector<double>& x) {
          double loss = 0;
          for (size_t i = 0; i < x.size(); ++i) loss += dyd[i] * reference(pr.kind, x[i]).value;
          return loss;
        },
        testing::to_double(pr.x));
    EXPECT_LT(testing::relative_error(dx, fd), 1e-6);
    return;
  }
  testing::expect_close(run(device(), pr, true), dx, pr.what("gelu_backward"),
                        [&](size_t i) { return 2 * bound(i); });
}

// out may be x and dx may be dy: in place gives the same bits.
TEST_P(GeluOp, InPlace) {
  const Problem pr(test_case(), 100);
  const std::vector<float> out = run(device(), pr, false), dx = run(device(), pr, true);
  DeviceArray<float> x(device(), pr.x), dy(device(), pr.dy);
  ops::GeluParams p;
  p.n = pr.n, p.kind = pr.kind, p.x = x.data(), p.dy = dy.data(), p.dx = dy.data();
  FORGE_TEST_OP(gelu_backward, device(), p);
  testing::expect_bitwise_equal(dy.download(), dx, pr.what("gelu_backward") + " in place");
  p.out = x.data();
  FORGE_TEST_OP(gelu_forward, device(), p);
  testing::expect_bitwise_equal(x.download(), out, pr.what("gelu_forward") + " in place");
}

// gelu(x) -> x and gelu'(x) -> 1 for x >> 0, -> 0 for x << 0, in every form, with no overflow to inf or NaN
// (sigmoid's complement, exp(-t) s, is inf * 0 there if computed carelessly).
class GeluSaturation : public testing::OpTest<testing::FixedCase> {};

TEST_P(GeluSaturation, SaturatesCleanlyForLargeInputs) {
  const std::vector<float> values = {-1e30f, -1000.0f, -200.0f, -90.0f, 90.0f, 200.0f, 1000.0f, 1e30f};
  const std::vector<float> want_out = {0, 0, 0, 0, 90.0f, 200.0f, 1000.0f, 1e30f},
                           want_dx = {0, 0, 0, 0, 1, 1, 1, 1};
  for (ops::GeluKind kind : {ops::GeluKind::erf, ops::GeluKind::tanh, ops::GeluKind::quick}) {
    DeviceArray<float> x(device(), values), dy(device(), std::vector<float>(values.size(), 1.0f));
    DeviceArray<float> out(device(), values.size()), dx(device(), values.size());
    ops::GeluParams p;
    p.n = static_cast<int64_t>(values.size()), p.kind = kind, p.x = x.data(), p.out = out.data();
    p.dy = dy.data(), p.dx = dx.data();
    FORGE_TEST_OP(gelu_forward, device(), p);
    FORGE_TEST_OP(gelu_backward, device(), p);
    const std::vector<float> got_out = out.download(), got_dx = dx.download();
    for (size_t i = 0; i < values.size(); ++i) {
      EXPECT_EQ(got_out[i], want_out[i]) << ops::gelu_kind_name(kind) << " gelu(" << values[i] << ")";
      EXPECT_EQ(got_dx[i], want_dx[i]) << ops::gelu_kind_name(kind) << " gelu'(" << values[i] << ")";
    }
  }
}

// Values Hugging Face's and PyTorch's definitions give (0.5 x (1 + erf(x / sqrt 2)), 0.5 x (1 + tanh(sqrt(2 /
// pi) (x + 0.044715 x^3))), x sigmoid(1.702 x), evaluated in double), on every backend.
class GeluKnownValues : public testing::OpTest<testing::FixedCase> {};

TEST_P(GeluKnownValues, MatchTheConfigsDefinitions) {
  const std::vector<float> values = {1.0f, -1.0f, 2.0f, -0.5f};
  const double want[3][4] = {
      {0.8413447460685429, -0.15865525393145707, 1.9544997361036416, -0.15426876936299344},
      {0.8411919906082768, -0.15880800939172324, 1.954597694087775, -0.15428599017485606},
      {0.8457957659328212, -0.1542042340671787, 1.9356586231442083, -0.1496115633936199}};
  for (int k = 0; k < 3; ++k) {
    const auto kind = static_cast<ops::GeluKind>(k);
    DeviceArray<float> x(device(), values), out(device(), values.size());
    ops::GeluParams p;
    p.n = 4, p.kind = kind, p.x = x.data(), p.out = out.data();
    FORGE_TEST_OP(gelu_forward, device(), p);
    const std::vector<float> got = out.download();
    // A few ulp: erfc (CUDA's erfcf is within 4 ulp, glibc's within 1) or exp, and the products.
    for (size_t i = 0; i < values.size(); ++i) {
      EXPECT_NEAR(got[i], want[k][i], 16 * kU * std::abs(want[k][i]))
          << ops::gelu_kind_name(kind) << " " << values[i];
      EXPECT_NEAR(reference(kind, values[i]).value, want[k][i], 1e-15)
          << ops::gelu_kind_name(kind) << " reference";
    }
  }
}

}  // namespace forge::op_tests::gelu
