#include <gtest/gtest.h>

#include <cmath>

#include "forge/core/dtype.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge {
namespace {

struct Config {
  float weight_decay, grad_scale;
  bool bf16_shadow;
};

class AdamW : public ::testing::TestWithParam<Config> {};

// torch.optim.AdamW's update, in double.
void reference_step(std::vector<double>& p, std::vector<double>& m, std::vector<double>& v,
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

TEST_P(AdamW, MatchesDoubleReferenceOverSeveralSteps) {
  const Config config = GetParam();
  const int64_t n = 40009;  // spans several work blocks and a partial one
  auto param = testing::random_floats(n, 61);
  std::vector<float> m(n, 0), v(n, 0);
  std::vector<uint16_t> shadow(n, 0);
  auto pd = testing::to_double(param);
  std::vector<double> md(n, 0), vd(n, 0);
  ops::AdamWParams p;
  p.n = n, p.param = param.data(), p.exp_avg = m.data(), p.exp_avg_sq = v.data();
  p.param_bf16 = config.bf16_shadow ? shadow.data() : nullptr;
  p.lr = 1e-2f, p.beta1 = 0.9f, p.beta2 = 0.95f, p.eps = 1e-8f;
  p.weight_decay = config.weight_decay, p.grad_scale = config.grad_scale;
  for (int64_t step = 1; step <= 5; ++step) {
    // Gradients of varied magnitude, a few exactly zero (denominator ~eps on the first step).
    auto grad = testing::random_floats(n, 70 + step, -3, 3);
    for (int64_t i = 0; i < n; i += 97) grad[i] = 0;
    p.grad = grad.data(), p.step = step;
    ops::adamw(p);
    reference_step(pd, md, vd, grad, p.lr, p.beta1, p.beta2, p.eps, p.weight_decay, p.grad_scale, step);
    ASSERT_LT(testing::relative_error(param, pd), 2e-6) << "step " << step;
    ASSERT_LT(testing::relative_error(m, md), 2e-6) << "step " << step;
    ASSERT_LT(testing::relative_error(v, vd), 2e-6) << "step " << step;
    if (config.bf16_shadow) {
      for (int64_t i = 0; i < n; ++i) ASSERT_EQ(shadow[i], f32_to_bf16_bits(param[i])) << i;
    }
  }
  if (!config.bf16_shadow) {
    for (uint16_t s : shadow) ASSERT_EQ(s, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Configs, AdamW,
                         ::testing::Values(Config{0.0f, 1.0f, false}, Config{0.1f, 1.0f, false},
                                           Config{0.1f, 0.3f, false}, Config{0.1f, 0.3f, true}));

TEST(AdamWDecay, DecayIsDecoupledFromTheGradient) {
  // With a zero gradient the moments stay zero and only p *= 1 - lr * wd remains.
  std::vector<float> param = {2.0f, -4.0f}, grad = {0, 0}, m = {0, 0}, v = {0, 0};
  ops::AdamWParams p;
  p.n = 2, p.param = param.data(), p.grad = grad.data(), p.exp_avg = m.data(), p.exp_avg_sq = v.data();
  p.lr = 0.5f, p.weight_decay = 0.1f;
  ops::adamw(p);
  EXPECT_FLOAT_EQ(param[0], 2.0f * 0.95f);
  EXPECT_FLOAT_EQ(param[1], -4.0f * 0.95f);
}

}  // namespace
}  // namespace forge
