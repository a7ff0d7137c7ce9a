#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <string>

#include "forge/core/dtype.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge {
namespace {

// Reference: C = alpha * op(A) op(B) + beta * C0 in double.
std::vector<double> reference_gemm(const ops::GemmParams& p, const std::vector<float>& a,
                                   const std::vector<float>& b, const std::vector<float>& c0) {
  std::vector<double> c(p.m * p.ldc);
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t j = 0; j < p.n; ++j) {
      double s = 0;
      for (int64_t l = 0; l < p.k; ++l) {
        double av = p.trans_a ? a[l * p.lda + i] : a[i * p.lda + l];
        double bv = p.trans_b ? b[j * p.ldb + l] : b[l * p.ldb + j];
        s += av * bv;
      }
      c[i * p.ldc + j] = p.alpha * s + p.beta * c0[i * p.ldc + j];
    }
  return c;
}

struct GemmCase {
  bool trans_a, trans_b;
  float alpha, beta;
};

class GemmTest : public ::testing::TestWithParam<std::tuple<GemmCase, DType>> {};

TEST_P(GemmTest, MatchesDoubleReference) {
  auto [gc, dtype] = GetParam();
  const int64_t m = 37, n = 29, k = 53;
  ops::GemmParams p;
  p.m = m, p.n = n, p.k = k;
  p.trans_a = gc.trans_a, p.trans_b = gc.trans_b;
  p.lda = (gc.trans_a ? m : k) + 3;  // padded leading dimensions exercise the strides
  p.ldb = (gc.trans_b ? k : n) + 5;
  p.ldc = n + 2;
  p.alpha = gc.alpha, p.beta = gc.beta;
  p.ab_dtype = dtype;
  auto a = testing::random_floats((gc.trans_a ? k : m) * p.lda, 1);
  auto b = testing::random_floats((gc.trans_b ? n : k) * p.ldb, 2);
  auto c = testing::random_floats(m * p.ldc, 3);
  std::vector<uint16_t> a16(a.size()), b16(b.size());
  if (dtype == DType::bf16) {
    // The reference sees the bf16-rounded operands, so only accumulation error remains.
    for (size_t i = 0; i < a.size(); ++i) a16[i] = f32_to_bf16_bits(a[i]), a[i] = bf16_bits_to_f32(a16[i]);
    for (size_t i = 0; i < b.size(); ++i) b16[i] = f32_to_bf16_bits(b[i]), b[i] = bf16_bits_to_f32(b16[i]);
    p.a = a16.data(), p.b = b16.data();
  } else {
    p.a = a.data(), p.b = b.data();
  }
  auto want = reference_gemm(p, a, b, c);
  p.c = c.data();
  ops::gemm(p);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j)
      ASSERT_NEAR(c[i * p.ldc + j], want[i * p.ldc + j], 2e-5 * k) << i << "," << j;
}

INSTANTIATE_TEST_SUITE_P(Layouts, GemmTest,
                         ::testing::Combine(::testing::Values(GemmCase{false, true, 1, 0}, GemmCase{false, false, 1, 0},
                                                              GemmCase{true, false, 1, 1}, GemmCase{true, true, 0.5f, 0.25f}),
                                            ::testing::Values(DType::f32, DType::bf16)));

// ------------------------------------------------------------------------------------------------------------
// bf16 output (c_dtype = bf16): the fp32-output GEMM of the same operands, rounded once to bf16, bitwise.

std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> y(x.size());
  for (size_t i = 0; i < x.size(); ++i) y[i] = f32_to_bf16_bits(x[i]);
  return y;
}

// Runs op(A)[m,k] op(B)[k,n] (bf16 operands, padded leading dimensions) twice: into an fp32 C holding the old
// bf16 C's exact values, and into the bf16 C itself; the bf16 result must be the fp32 one rounded, and C's
// padding columns untouched.
void check_bf16_output(int64_t m, int64_t n, int64_t k, GemmCase gc, uint32_t seed) {
  ops::GemmParams p;
  p.m = m, p.n = n, p.k = k;
  p.trans_a = gc.trans_a, p.trans_b = gc.trans_b;
  p.lda = (gc.trans_a ? m : k) + 3, p.ldb = (gc.trans_b ? k : n) + 5, p.ldc = n + 2;
  p.alpha = gc.alpha, p.beta = gc.beta;
  p.ab_dtype = DType::bf16;
  const auto a16 = to_bf16(testing::random_floats((gc.trans_a ? k : m) * p.lda, seed));
  const auto b16 = to_bf16(testing::random_floats((gc.trans_b ? n : k) * p.ldb, seed + 1));
  p.a = a16.data(), p.b = b16.data();
  std::vector<uint16_t> c16 = to_bf16(testing::random_floats(m * p.ldc, seed + 2));
  if (p.beta == 0) std::fill(c16.begin(), c16.end(), uint16_t{0x7fc0});  // NaN: beta = 0 must not read C
  testing::expect_bf16_output_is_fp32_rounded(p, c16, [](const auto& params) { ops::gemm(params); });
}

class GemmBf16Output : public ::testing::TestWithParam<GemmCase> {};

TEST_P(GemmBf16Output, IsTheFp32OutputRoundedBitwise) { check_bf16_output(37, 29, 53, GetParam(), 7); }

INSTANTIATE_TEST_SUITE_P(Layouts, GemmBf16Output,
                         ::testing::Values(GemmCase{false, true, 1, 0}, GemmCase{false, false, 1, 0},
                                           GemmCase{true, false, 1, 1}, GemmCase{true, true, 0.5f, 0.25f}));

// m * n > 16384: the widening and rounding passes run threaded.
TEST(GemmBf16OutputThreads, ThreadedPassesAreTheFp32OutputRounded) {
  for (int threads : {1, 2})
    testing::with_threads(threads, [] {
      check_bf16_output(160, 130, 64, GemmCase{false, true, 1, 0}, 17);
      check_bf16_output(160, 130, 64, GemmCase{true, false, 1, 1}, 27);
    });
}

TEST(GemmErrors, OutputDtypeIsFp32OrBf16FromBf16Operands) {
  std::vector<float> a(16, 1.0f), b(16, 1.0f), c(16);
  ops::GemmParams p;
  p.m = p.n = p.k = 4, p.lda = p.ldb = p.ldc = 4;
  p.a = a.data(), p.b = b.data(), p.c = c.data();
  p.c_dtype = DType::f16;
  testing::expect_error_containing([&] { ops::gemm(p); }, {"gemm", "c_dtype", "fp32 or bf16", "fp16"});
  p.c_dtype = DType::e4m3;
  testing::expect_error_containing([&] { ops::gemm(p); }, {"gemm", "c_dtype", "fp8_e4m3"});
  p.c_dtype = DType::bf16;  // fp32 operands
  testing::expect_error_containing([&] { ops::gemm(p); },
                                   {"gemm", "c_dtype bf16 needs bf16 operands", "fp32"});
}

}  // namespace
}  // namespace forge
