// GEMM: the op tests (op_tests/gemm.h) on the CPU and the device emulation, what only the CPU kernel promises
// (the bf16 output's threaded passes) and its output-dtype errors.
#include "kernels/op_tests/gemm.h"

#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <string>

#include "forge/core/dtype.h"
#include "forge/kernels/cpu/cpu_kernels.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::gemm::gemm_test {
namespace {

FORGE_INSTANTIATE_OP_TEST(GemmOp, kCases, testing::Backend::cpu, testing::Backend::emulated);

struct GemmCase {
  bool trans_a, trans_b;
  float alpha, beta;
};

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

// m * n > 16384: the widening and rounding passes run threaded.
TEST(GemmBf16OutputThreads, ThreadedPassesAreTheFp32OutputRounded) {
  for (int threads : {1, 2})
    testing::with_threads(threads, [] {
      check_bf16_output(160, 130, 64, GemmCase{false, true, 1, 0}, 17);
      check_bf16_output(160, 130, 64, GemmCase{true, false, 1, 1}, 27);
    });
}

// With beta = 0 on CPUs with native bf16 the matmul writes the bf16 C itself (no fp32 scratch and rounding
// pass): it must still be the fp32-output GEMM rounded, bit for bit, at a transformer's depths (K of a
// model's hidden and FFN widths, where a kernel for another output type could block K differently), in the
// three layouts training runs, on one and two threads.
TEST(GemmBf16OutputDirect, DeepProductsAreTheFp32OutputRounded) {
  for (int threads : {1, 2})
    testing::with_threads(threads, [] {
      check_bf16_output(192, 704, 512, GemmCase{false, true, 1, 0}, 37);
      check_bf16_output(192, 352, 1408, GemmCase{false, false, 1, 0}, 47);
      check_bf16_output(256, 96, 1024, GemmCase{true, false, 1, 0}, 57);
      check_bf16_output(200, 130, 2816, GemmCase{false, true, 0.5f, 0}, 67);
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

// The compiled kernels are kept for the kGemmCacheSize most recently used shapes: more shapes than that leave
// the cache at its size, and a shape evicted long ago compiles again and computes the same bits.
TEST(GemmCache, HoldsTheMostRecentShapesOnly) {
  const int64_t k = 8, n = 4, shapes = cpu::kGemmCacheSize + 40;
  const std::vector<float> a = testing::random_floats(static_cast<size_t>(shapes * k), 5),
                           b = testing::random_floats(static_cast<size_t>(k * n), 6);
  auto run = [&](int64_t m) {
    std::vector<float> c(static_cast<size_t>(m * n));
    ops::GemmParams p;
    p.m = m, p.n = n, p.k = k, p.lda = k, p.ldb = n, p.ldc = n;
    p.a = a.data(), p.b = b.data(), p.c = c.data();
    cpu::gemm(p);
    return c;
  };
  const std::vector<float> first = run(1);
  for (int64_t m = 2; m <= shapes; ++m) run(m);
  EXPECT_EQ(cpu::gemm_cache_entries(), cpu::kGemmCacheSize);
  EXPECT_EQ(run(1), first);
}

}  // namespace
}  // namespace forge::op_tests::gemm::gemm_test
