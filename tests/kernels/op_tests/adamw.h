// Fused AdamW (ops::adamw), written once for every backend (op_harness.h): on the CPU against
// torch.optim.AdamW's update in double over several steps, elsewhere step by step against the CPU kernel from
// the same state.
//
// The CUDA kernel shares the CPU's operation order and FMAs, so its results are usually bitwise the CPU's.
// The bounds allow one rounding more or less per operation (another compiler's contraction), measured against
// the operands: about 2 ulp of the larger term of each sum, propagated into the weight update.
#pragma once

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::adamw {

using testing::DeviceArray;
using testing::kU;

struct Case {
  int64_t n;
  float lr, beta1, beta2, eps, weight_decay, grad_scale;
  int64_t first_step, steps;
  bool shadow;         // a bf16 copy of the updated weights
  bool fresh_moments;  // zero moments (a run's first steps); else random ones
  std::string name() const {
    auto digits = [](double v) {
      std::string s = std::to_string(v);
      for (char& ch : s)
        if (ch == '.' || ch == '-') ch = '_';
      return s;
    };
    return std::string("n").append(std::to_string(n)) + "_lr" + digits(lr) + "_wd" + digits(weight_decay) +
           "_scale" + digits(grad_scale) + "_step" + std::to_string(first_step) + "x" +
           std::to_string(steps) + (shadow ? "_shadow" : "") + (fresh_moments ? "" : "_moments");
  }
};

// Several steps from zero moments, with and without decay, gradient scaling and the bf16 shadow (n spans
// several work blocks and a partial one); single steps from random moments, late in a run and with other
// betas.
inline const std::vector<Case> kCases = {
    {40009, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.0f, 1.0f, 1, 5, false, true},
    {40009, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, 1, 5, false, true},
    {40009, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.3f, 1, 5, false, true},
    {40009, 1e-2f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.3f, 1, 5, true, true},
    {37, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, 1, 1, true, false},
    {100003, 3e-4f, 0.9f, 0.999f, 1e-8f, 0.0f, 0.25f, 7, 1, true, false},
    {4099, 1e-2f, 0.8f, 0.95f, 1e-6f, 0.01f, 1.0f, 1000, 1, false, false},
};

// torch.optim.AdamW's update, in double.
inline void reference_step(std::vector<double>& p, std::vector<double>& m, std::vector<double>& v,
                           const std::vector<float>& grad, double lr, double beta1, double beta2, double eps,
                           double wd, double grad_scale, int64_t step) {
  const double bias_correction1 = 1 - std::pow(beta1, step), bias_correction2 = 1 - std::pow(beta2, step);
  for (size_t i = 0; i < p.size(); ++i) {
    const double g = grad[i] * grad_scale;
    p[i] *= 1 - lr * wd;
    m[i] = beta1 * m[i] + (1 - beta1) * g;
    v[i] = beta2 * v[i] + (1 - beta2) * g * g;
    p[i] -= lr / bias_correction1 * m[i] / (std::sqrt(v[i]) / std::sqrt(bias_correction2) + eps);
  }
}

// The optimizer state of one range.
struct State {
  std::vector<float> param, exp_avg, exp_avg_sq;
  std::vector<uint16_t> shadow;
};

// One step of the op on `on` from `state` (updated in place).
inline void step_on(Device on, const Case& c, State& state, const std::vector<float>& grad, int64_t step) {
  DeviceArray<float> param(on, state.param), g(on, grad), m(on, state.exp_avg), v(on, state.exp_avg_sq);
  DeviceArray<uint16_t> shadow(on, state.shadow);
  ops::AdamWParams p;
  p.n = c.n, p.lr = c.lr, p.beta1 = c.beta1, p.beta2 = c.beta2, p.eps = c.eps,
  p.weight_decay = c.weight_decay;
  p.grad_scale = c.grad_scale, p.step = step;
  p.param = param.data(), p.grad = g.data(), p.exp_avg = m.data(), p.exp_avg_sq = v.data();
  p.param_bf16 = c.shadow ? shadow.data() : nullptr;
  FORGE_TEST_OP(adamw, on, p);
  state.param = param.download(), state.exp_avg = m.download(), state.exp_avg_sq = v.download();
  state.shadow = shadow.download();
}

class AdamWOp : public testing::OpTest<Case> {};

TEST_P(AdamWOp, Steps) {
  const Case& c = test_case();
  State state;
  state.param = testing::random_floats(c.n, 61);
  state.exp_avg =
      c.fresh_moments ? std::vector<float>(c.n, 0) : testing::random_floats(c.n, 122, -0.1f, 0.1f);
  state.exp_avg_sq =
      c.fresh_moments ? std::vector<float>(c.n, 0) : testing::random_floats(c.n, 123, 0.0f, 0.01f);
  state.shadow.assign(c.n, 0);
  auto pd = testing::to_double(state.param), md = testing::to_double(state.exp_avg);
  auto vd = testing::to_double(state.exp_avg_sq);
  for (int64_t step = c.first_step; step < c.first_step + c.steps; ++step) {
    const std::string what = c.name() + " step " + std::to_string(step);
    // Gradients of varied magnitude, a few exactly zero (denominator ~eps on the first step).
    auto grad = testing::random_floats(c.n, 70 + static_cast<uint32_t>(step), -3, 3);
    for (int64_t i = 0; i < c.n; i += 97) grad[i] = 0;
    if (on_cpu()) {
      step_on(Device::cpu, c, state, grad, step);
      reference_step(pd, md, vd, grad, c.lr, c.beta1, c.beta2, c.eps, c.weight_decay, c.grad_scale, step);
      ASSERT_LT(testing::relative_error(state.param, pd), 2e-6) << what;
      ASSERT_LT(testing::relative_error(state.exp_avg, md), 2e-6) << what;
      ASSERT_LT(testing::relative_error(state.exp_avg_sq, vd), 2e-6) << what;
    } else {
      // The step on the device from the CPU's state, against the CPU's step from the same state.
      const State before = state;
      State got = state;
      step_on(device(), c, got, grad, step);
      step_on(Device::cpu, c, state, grad, step);
      const std::vector<float>&param0 = before.param, &m0 = before.exp_avg, &v0 = before.exp_avg_sq;
      const std::vector<float>&param = state.param, &m = state.exp_avg, &v = state.exp_avg_sq;
      const double step_size = c.lr / (1.0 - std::pow(double{c.beta1}, double(step)));
      const double correction2 = std::sqrt(1.0 - std::pow(double{c.beta2}, double(step)));
      std::vector<double> m_error(c.n), v_error(c.n);
      for (int64_t i = 0; i < c.n; ++i) {
        const double g = double{grad[i]} * c.grad_scale;
        m_error[i] = 4 * kU * (std::abs(c.beta1 * m0[i]) + std::abs((1 - c.beta1) * g));
        v_error[i] = 4 * kU * (c.beta2 * v0[i] + (1 - c.beta2) * g * g);
      }
      testing::expect_close(got.exp_avg, m, what + " exp_avg", [&](size_t i) { return m_error[i]; });
      testing::expect_close(got.exp_avg_sq, v, what + " exp_avg_sq", [&](size_t i) { return v_error[i]; });
      testing::expect_close(got.param, param, what + " param", [&](size_t i) {
        const double root = std::sqrt(double{v[i]}) / correction2, denom = root + c.eps;
        const double update = step_size * std::abs(m[i]) / denom;
        const double root_error = v[i] > 0 ? root * v_error[i] / (2 * v[i]) : 0;
        return 4 * kU * (std::abs(double{param0[i]}) + update) + step_size * m_error[i] / denom +
               update * (root_error / denom + 4 * kU);
      });
      if (c.shadow) {
        size_t bad = 0;
        for (int64_t i = 0; i < c.n; ++i) bad += got.shadow[i] != f32_to_bf16_bits(got.param[i]);
        EXPECT_EQ(bad, 0u) << what << ": bf16 shadow differs from the rounded fp32 weight";
      }
    }
    if (c.shadow) {
      for (int64_t i = 0; i < c.n; ++i)
        ASSERT_EQ(state.shadow[i], f32_to_bf16_bits(state.param[i])) << what << " " << i;
    }
  }
  if (!c.shadow) {
    for (uint16_t s : state.shadow) ASSERT_EQ(s, 0);
  }
}

class AdamWFixed : public testing::OpTest<testing::FixedCase> {};

// With a zero gradient the moments stay zero and only p *= 1 - lr * wd remains.
TEST_P(AdamWFixed, DecayIsDecoupledFromTheGradient) {
  const Case c{2, 0.5f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, 1, 1, false, true};
  State state{{2.0f, -4.0f}, {0, 0}, {0, 0}, {0, 0}};
  step_on(device(), c, state, {0, 0}, 1);
  EXPECT_FLOAT_EQ(state.param[0], 2.0f * 0.95f);
  EXPECT_FLOAT_EQ(state.param[1], -4.0f * 0.95f);
}

// With lr = 0 the weights pass through unchanged, so the shadow shows the rounding of chosen values: ties to
// even, carries, overflow to inf, subnormals, signed zero, infinities and NaN.
TEST_P(AdamWFixed, ShadowRoundsToNearestEven) {
  const std::vector<std::pair<uint32_t, uint16_t>> cases = {
      {0x3f808000u, 0x3f80u},                                                  // tie, even below: down
      {0x3f818000u, 0x3f82u},                                                  // tie, odd below: up
      {0x3f808001u, 0x3f81u}, {0x3f807fffu, 0x3f80u}, {0x7f7fffffu, 0x7f80u},  // FLT_MAX rounds to inf
      {0x00008000u, 0x0000u}, {0x00018000u, 0x0002u}, {0x00000001u, 0x0000u},  // subnormals
      {0x80000000u, 0x8000u}, {0x7f800000u, 0x7f80u}, {0xff800000u, 0xff80u},
      {0xbfffffffu, 0xc000u},  // carry into the exponent
  };
  const int64_t n = static_cast<int64_t>(cases.size()) + 1;
  const Case c{n, 0.0f, 0.9f, 0.95f, 1e-8f, 0.1f, 1.0f, 3, 1, true, true};
  State state;
  state.param.resize(n);
  for (size_t i = 0; i < cases.size(); ++i) state.param[i] = std::bit_cast<float>(cases[i].first);
  state.param[n - 1] = std::nanf("");
  state.exp_avg.assign(n, 0), state.exp_avg_sq.assign(n, 0), state.shadow.assign(n, 0);
  const std::vector<float> param = state.param;
  step_on(device(), c, state, std::vector<float>(n, 0.0f), 3);
  for (size_t i = 0; i < cases.size(); ++i) {
    EXPECT_EQ(std::bit_cast<uint32_t>(state.param[i]), cases[i].first) << "weight " << i << " changed";
    EXPECT_EQ(state.shadow[i], cases[i].second) << std::hex << "bf16 of 0x" << cases[i].first;
    EXPECT_EQ(state.shadow[i], f32_to_bf16_bits(param[i]))
        << std::hex << "core's bf16 of 0x" << cases[i].first;
  }
  EXPECT_TRUE(std::isnan(state.param[n - 1]));
  EXPECT_EQ(state.shadow[n - 1], f32_to_bf16_bits(state.param[n - 1])) << "NaN stays a quiet NaN";
  EXPECT_EQ(state.shadow[n - 1] & 0x7fc0u, 0x7fc0u);
}

}  // namespace forge::op_tests::adamw
