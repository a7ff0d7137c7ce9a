// GEMM (ops::gemm), written once for every backend (op_harness.h): on the CPU against the double-precision
// reference (a bf16 C: bitwise the fp32-output GEMM rounded), elsewhere against the CPU kernel on the same
// operands.
//
// Tolerance against the CPU: products of fp32/bf16 values are exact or rounded once, and each side's k
// additions err by at most k ulps of the magnitude sum_l |op(A)[i,l] op(B)[l,j]| (2^-23: tensor cores may
// truncate), so the two differ by at most about 2 k 2^-23 of it. A bf16 C is each side's fp32 result rounded
// once: they differ by that bound plus one bf16 ulp (taken at the larger value: a rounding may cross a
// binade).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::gemm {

using testing::DeviceArray;

struct Layout {
  bool trans_a, trans_b;
  float alpha, beta;
};

// The layouts of training's GEMMs (forward NT, backward_input NN, backward_weight TN accumulating) and a
// scaled TT.
inline constexpr Layout kNT{false, true, 1, 0}, kNN{false, false, 1, 0}, kTN{true, false, 1, 1},
    kTT{true, true, 0.5f, 0.25f};

struct Case {
  int64_t m, n, k;
  Layout layout;
  DType ab_dtype, c_dtype;
  int64_t pad;     // added to every leading dimension's minimum (lda + pad, ldb + pad + 2, ldc + pad + 1)
  int64_t offset;  // elements past an aligned address of a, b (and a bf16 C) on another backend: 2- or 4-byte
                   // aligned pointers, which the GPU's plans must not assume away
  std::string name() const {
    return std::to_string(m) + "x" + std::to_string(n) + "x" + std::to_string(k) + "_" +
           (layout.trans_a ? "t" : "n") + (layout.trans_b ? "t" : "n") + (layout.beta != 0 ? "_beta" : "") +
           "_" + std::string(dtype_name(ab_dtype)) + "_to_" + std::string(dtype_name(c_dtype)) + "_pad" +
           std::to_string(pad) + (offset ? "_offset" + std::to_string(offset) : "");
  }
};

inline std::vector<Case> make_cases() {
  std::vector<Case> cases;
  for (Layout layout : {kNT, kNN, kTN, kTT})
    for (auto [ab, c] :
         {std::pair{DType::f32, DType::f32}, {DType::bf16, DType::f32}, {DType::bf16, DType::bf16}}) {
      cases.push_back({37, 29, 53, layout, ab, c, 3, 0});  // odd shapes, padded leading dimensions
      cases.push_back({37, 29, 61, layout, ab, c, 3, 0});
      cases.push_back({40, 24, 64, layout, ab, c, 0, 1});  // dense, pointers off by one element
    }
  // Big enough for the tensor-core kernels a training step uses; the three Linear layouts.
  for (Layout layout : {kNT, kNN, kTN})
    for (DType c : {DType::f32, DType::bf16}) cases.push_back({256, 384, 1024, layout, DType::bf16, c, 0, 0});
  cases.push_back({128, 192, 256, kNT, DType::bf16, DType::f32, 0, 0});
  return cases;
}
inline const std::vector<Case> kCases = make_cases();

// A case's operands: fp32 values (the exact values of the bf16 operands when ab_dtype is bf16) and their
// bytes in ab_dtype; C before the op (NaN where beta = 0: it must not be read).
struct Problem {
  ops::GemmParams p;  // no pointers
  std::vector<float> a, b, c0;
  std::vector<uint8_t> a_bytes, b_bytes, c_bytes;
  Problem(const Case& c, uint32_t seed) {
    p.m = c.m, p.n = c.n, p.k = c.k;
    p.trans_a = c.layout.trans_a, p.trans_b = c.layout.trans_b;
    p.lda = (p.trans_a ? c.m : c.k) + c.pad, p.ldb = (p.trans_b ? c.k : c.n) + c.pad + 2,
    p.ldc = c.n + c.pad + 1;
    p.alpha = c.layout.alpha, p.beta = c.layout.beta;
    p.ab_dtype = c.ab_dtype, p.c_dtype = c.c_dtype;
    a = testing::random_floats((p.trans_a ? c.k : c.m) * p.lda, seed);
    b = testing::random_floats((p.trans_b ? c.n : c.k) * p.ldb, seed + 1);
    c0 = testing::random_floats(c.m * p.ldc, seed + 2);
    a_bytes = encode(a, c.ab_dtype), b_bytes = encode(b, c.ab_dtype);
    if (p.beta == 0) std::fill(c0.begin(), c0.end(), std::numeric_limits<float>::quiet_NaN());
    c_bytes = encode(c0, c.c_dtype);  // c0 then holds C's stored values
  }
  // x in `dtype` (f32 or bf16), x itself then holding the stored values.
  static std::vector<uint8_t> encode(std::vector<float>& x, DType dtype) {
    std::vector<uint8_t> bytes(x.size() * dtype_size(dtype));
    if (dtype == DType::f32) {
      std::memcpy(bytes.data(), x.data(), bytes.size());
      return bytes;
    }
    auto* bits = reinterpret_cast<uint16_t*>(bytes.data());
    for (size_t i = 0; i < x.size(); ++i) bits[i] = f32_to_bf16_bits(x[i]), x[i] = bf16_bits_to_f32(bits[i]);
    return bytes;
  }
  // C [m, ldc] as floats (its bf16 values widened).
  std::vector<float> decode(const std::vector<uint8_t>& bytes) const {
    std::vector<float> x(c0.size());
    if (p.c_dtype == DType::f32) {
      std::memcpy(x.data(), bytes.data(), bytes.size());
    } else {
      const auto* bits = reinterpret_cast<const uint16_t*>(bytes.data());
      for (size_t i = 0; i < x.size(); ++i) x[i] = bf16_bits_to_f32(bits[i]);
    }
    return x;
  }
};

// C = alpha * op(A) op(B) + beta * C0 in double, and per element the magnitude |alpha| sum_l |op(A) op(B)| +
// |beta C0| that scales every rounding error of an fp32-accumulating GEMM.
inline void reference(const Problem& pr, std::vector<double>& c, std::vector<double>& magnitude) {
  const ops::GemmParams& p = pr.p;
  c.assign(p.m * p.ldc, 0), magnitude.assign(p.m * p.n, 0);
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t j = 0; j < p.n; ++j) {
      double s = 0, s_abs = 0;
      for (int64_t l = 0; l < p.k; ++l) {
        const double av = p.trans_a ? pr.a[l * p.lda + i] : pr.a[i * p.lda + l];
        const double bv = p.trans_b ? pr.b[j * p.ldb + l] : pr.b[l * p.ldb + j];
        s += av * bv, s_abs += std::abs(av * bv);
      }
      const double c0 = p.beta != 0 ? double{pr.c0[i * p.ldc + j]} : 0.0;
      c[i * p.ldc + j] = p.alpha * s + p.beta * c0;
      magnitude[i * p.n + j] = std::abs(double{p.alpha}) * s_abs + std::abs(double{p.beta} * c0);
    }
}

// One bf16 ulp at |x| (8 significant bits: the spacing in x's binade; 0 at 0).
inline double bf16_ulp(double x) { return x == 0 ? 0.0 : std::ldexp(1.0, std::ilogb(x) - 7); }

// C after the op on `on` (a, b and, when bf16, C `offset` elements into their allocations; an fp32 C stays
// aligned, as in the GPU tests these cases come from).
inline std::vector<uint8_t> run_gemm(Device on, const Problem& pr, int64_t offset) {
  const size_t ab = dtype_size(pr.p.ab_dtype), c_offset = pr.p.c_dtype == DType::bf16 ? offset * 2 : 0;
  DeviceArray<uint8_t> a(on, pr.a_bytes, offset * ab), b(on, pr.b_bytes, offset * ab),
      c(on, pr.c_bytes, c_offset);
  ops::GemmParams p = pr.p;
  p.a = a.data(), p.b = b.data(), p.c = c.data();
  FORGE_TEST_OP(gemm, on, p);
  return c.download();
}

// The case on `on` (a device) against the CPU kernel on the same operands, within the bound above; C's
// padding columns untouched.
inline void expect_matches_cpu(Device on, const Case& c, const Problem& pr) {
  const ops::GemmParams& p = pr.p;
  std::vector<double> want, magnitude;
  reference(pr, want, magnitude);
  const std::vector<uint8_t> got_bytes = run_gemm(on, pr, c.offset);
  const std::vector<float> got = pr.decode(got_bytes), cpu = pr.decode(run_gemm(Device::cpu, pr, 0));
  const double tolerance = std::ldexp(2.0 * (p.k + 8), -23);
  const size_t esize = dtype_size(p.c_dtype);
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j) {
      const double g = got[i * p.ldc + j], w = cpu[i * p.ldc + j];
      const double ulp = p.c_dtype == DType::bf16 ? bf16_ulp(std::max(std::abs(g), std::abs(w))) : 0.0;
      ASSERT_LE(std::abs(g - w), tolerance * magnitude[i * p.n + j] + ulp)
          << c.name() << ": C[" << i << "," << j << "] " << g << ", cpu " << w;
    }
    // Compared bitwise: NaN where beta = 0.
    const size_t row = i * p.ldc * esize;
    EXPECT_EQ(
        std::memcmp(&got_bytes[row + p.n * esize], &pr.c_bytes[row + p.n * esize], (p.ldc - p.n) * esize), 0)
        << c.name() << ": padding of row " << i << " was written";
  }
}

class GemmOp : public testing::OpTest<Case> {};

TEST_P(GemmOp, MatchesTheCpu) {
  const Case& c = test_case();
  const Problem pr(c, 11);
  const ops::GemmParams& p = pr.p;
  if (!on_cpu()) return expect_matches_cpu(device(), c, pr);
  if (p.c_dtype == DType::bf16) {
    // The fp32-output GEMM of the same operands, rounded once, bitwise; C's padding untouched.
    std::vector<uint16_t> c16(pr.c_bytes.size() / 2);
    std::memcpy(c16.data(), pr.c_bytes.data(), pr.c_bytes.size());
    std::vector<uint8_t> a = pr.a_bytes, b = pr.b_bytes;
    ops::GemmParams q = p;  // the helper runs it with an fp32 C, then with the bf16 one
    q.a = a.data(), q.b = b.data(), q.c_dtype = DType::f32;
    testing::expect_bf16_output_is_fp32_rounded(q, c16, [](const auto& params) { ops::gemm(params); });
    return;
  }
  std::vector<double> want, magnitude;
  reference(pr, want, magnitude);
  const std::vector<float> got = pr.decode(run_gemm(Device::cpu, pr, 0));
  for (int64_t i = 0; i < p.m; ++i)
    for (int64_t j = 0; j < p.n; ++j)
      ASSERT_NEAR(got[i * p.ldc + j], want[i * p.ldc + j], 2e-5 * p.k) << i << "," << j;
}

// The plan (cached per shape) gives the same bits on every call.
TEST_P(GemmOp, RepeatedCallsGiveTheSameBits) {
  const Problem pr(test_case(), 41);
  const std::vector<uint8_t> first = run_gemm(device(), pr, test_case().offset);
  EXPECT_EQ(run_gemm(device(), pr, test_case().offset), first);
}

}  // namespace forge::op_tests::gemm
