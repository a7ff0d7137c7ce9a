// Current scaling: the op tests (op_tests/fp8_current_scaling.h: amax_to, the cast with a scale from an amax
// in memory against the host-scale path, the GEMM with scale pointers) on the CPU and the device emulation,
// and what only the CPU kernel has: scale pointers with its limited-precision accumulator model, and a
// non-finite scale_inv behind a pointer refused (the CPU reads it without waiting).
#include "kernels/op_tests/fp8_current_scaling.h"

#include <gtest/gtest.h>

#include <bit>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/core/error.h"
#include "forge/fp8/recipe.h"
#include "forge/fp8/scaling.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::fp8_current_scaling {
FORGE_INSTANTIATE_OP_TEST(Fp8CurrentScalingOp, kCases, testing::Backend::cpu, testing::Backend::emulated);
FORGE_INSTANTIATE_OP_TEST(Fp8CurrentScalingFixed, testing::kFixedCase, testing::Backend::cpu,
                          testing::Backend::emulated);
}  // namespace forge::op_tests::fp8_current_scaling

namespace forge::fp8_current_scaling_test {

namespace {

constexpr float kNaN = std::numeric_limits<float>::quiet_NaN();
constexpr float kInf = std::numeric_limits<float>::infinity();

uint32_t bits(float x) { return std::bit_cast<uint32_t>(x); }

// The GEMM reading scale_inv through pointers is the GEMM given the values, bit for bit, in every
// combination.
TEST(Fp8CurrentScaling, GemmScalePointersAreTheValues) {
  const int64_t m = 24, n = 40, k = 72;
  std::vector<uint8_t> a(m * k), b(n * k);
  const std::vector<float> av = testing::random_floats(a.size(), 1, -400.0f, 400.0f);
  const std::vector<float> bv = testing::random_floats(b.size(), 2, -4e4f, 4e4f);
  for (size_t i = 0; i < a.size(); ++i) a[i] = f32_to_e4m3(av[i]);
  for (size_t i = 0; i < b.size(); ++i) b[i] = f32_to_e5m2(bv[i]);
  const float a_scale_inv = 0.0123f, b_scale_inv = 3.71f;
  auto run = [&](bool a_pointer, bool b_pointer, int accumulator_bits) {
    std::vector<float> c = testing::random_floats(m * n, 3);
    ops::Fp8GemmParams p;
    p.m = m, p.n = n, p.k = k;
    p.a = a.data(), p.lda = k, p.a_dtype = DType::e4m3;
    p.b = b.data(), p.ldb = k, p.trans_b = true, p.b_dtype = DType::e5m2;
    p.c = c.data(), p.ldc = n, p.beta = 0.5f;
    p.accumulator_bits = accumulator_bits, p.promote_every = 32;
    p.a_scale_inv = a_scale_inv, p.b_scale_inv = b_scale_inv;
    // A pointer replaces the value, which is then wrong (and not finite) on purpose.
    if (a_pointer) p.a_scale_inv_ptr = &a_scale_inv, p.a_scale_inv = kInf;
    if (b_pointer) p.b_scale_inv_ptr = &b_scale_inv, p.b_scale_inv = kNaN;
    ops::fp8_gemm(p);
    return c;
  };
  for (int accumulator_bits : {0, 12}) {
    const std::vector<float> want = run(false, false, accumulator_bits);
    for (auto [ap, bp] : {std::pair{true, false}, std::pair{false, true}, std::pair{true, true}}) {
      const std::vector<float> got = run(ap, bp, accumulator_bits);
      for (size_t i = 0; i < want.size(); ++i)
        ASSERT_EQ(bits(got[i]), bits(want[i]))
            << "element " << i << " pointers " << ap << bp << " bits " << accumulator_bits;
    }
  }
  // A non-finite scale_inv behind a pointer is refused where it can be read without waiting: here.
  const float inf = kInf;
  std::vector<float> c(m * n);
  ops::Fp8GemmParams p;
  p.m = m, p.n = n, p.k = k, p.a = a.data(), p.lda = k, p.b = b.data(), p.ldb = k, p.trans_b = true;
  p.b_dtype = DType::e5m2, p.c = c.data(), p.ldc = n, p.a_scale_inv_ptr = &inf;
  testing::expect_error_containing([&] { ops::fp8_gemm(p); }, {"fp8_gemm", "scale_inv must be finite"});
}

}  // namespace
}  // namespace forge::fp8_current_scaling_test
