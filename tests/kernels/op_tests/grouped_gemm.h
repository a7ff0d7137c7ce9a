// The grouped GEMMs (ops::m_grouped_gemm, ops::k_grouped_gemm), written once for every backend
// (op_harness.h).
//
// On the CPU: against the double-precision reference, and bitwise equal to ops::gemm calls on the same
// sub-matrices, each non-empty group's in the pieces ops::grouped_gemm_pieces cuts its rows into (fp32 and
// bf16 operands, fp32 and bf16 C: the CPU kernel is that loop); grouped_gemm_test.cpp checks the three
// layouts as one another's gradients by finite differences. Elsewhere against the CPU kernel within gemm.h's
// bound: 2 (k + 8) 2^-23 of the magnitude sum |a b| (+ |beta c|), plus a bf16 ulp for a bf16 C.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <string>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/kernels/ops.h"
#include "op_harness.h"

namespace forge::op_tests::grouped_gemm {

using testing::DeviceArray;

struct Case {
  bool k_grouped;
  std::vector<int64_t> sizes;  // rows per group (0: an empty group)
  int64_t m, n, k;             // m_grouped: n, k; k_grouped: m, n
  bool trans_b;                // m_grouped
  DType ab_dtype, c_dtype;
  float alpha, beta;
  int64_t pad;  // added to every leading dimension, and to the group strides
  std::string name() const {
    std::string s = std::string(k_grouped ? "k" : "m") + "_grouped_g";
    for (size_t g = 0; g < sizes.size(); ++g) s += fmt::format("{}{}", g ? "_" : "", sizes[g]);
    s += k_grouped ? "_m" + std::to_string(m) + "_n" + std::to_string(n)
                   : "_n" + std::to_string(n) + "_k" + std::to_string(k) + (trans_b ? "_nt" : "_nn");
    return s + "_" + std::string(dtype_name(ab_dtype)) + "_to_" + std::string(dtype_name(c_dtype)) +
           (beta != 0 ? "_beta" : "") + (alpha != 1 ? "_alpha" : "") +
           (pad ? "_pad" + std::to_string(pad) : "");
  }
  int64_t groups() const { return static_cast<int64_t>(sizes.size()); }
  std::vector<int64_t> offsets() const {
    std::vector<int64_t> o(sizes.size() + 1, 0);
    std::partial_sum(sizes.begin(), sizes.end(), o.begin() + 1);
    return o;
  }
};

inline std::vector<Case> make_cases() {
  const std::vector<std::vector<int64_t>> shapes = {
      {5, 0, 17, 1, 0},  // empty groups first, in the middle, last; a one-row group
      {23},              // one group
      {0, 0, 0},         // nothing to do
      {31, 7, 64, 13},   // odd sizes
      {300, 0, 555},     // the CPU's pieces: 256 + 32 + 12 rows; 2 x 256 + 32 + 11
  };
  std::vector<Case> cases;
  for (auto [ab, c] :
       {std::pair{DType::f32, DType::f32}, {DType::bf16, DType::f32}, {DType::bf16, DType::bf16}})
    for (const auto& sizes : shapes) {
      cases.push_back({false, sizes, 0, 29, 37, true, ab, c, 1, 0, 3});   // forward y = x W^T
      cases.push_back({false, sizes, 0, 37, 29, false, ab, c, 1, 0, 0});  // input gradient dx = dy W
      cases.push_back({true, sizes, 29, 37, 0, false, ab, c, 1, 1, 2});   // weight gradient dW += dy^T x
    }
  cases.push_back(
      {false, {9, 0, 40}, 0, 24, 16, true, DType::f32, DType::f32, 0.5f, 0.25f, 1});  // scaled, +=
  cases.push_back({true, {9, 0, 40}, 24, 16, 0, false, DType::bf16, DType::bf16, 0.5f, 0.0f, 0});  // beta 0
  cases.push_back({true, {0, 12, 0}, 8, 8, 0, false, DType::f32, DType::f32, 1.0f, 0.5f, 1});      // beta 0.5
  // A training step's size on the tensor-core path: 8 experts of uneven load.
  cases.push_back(
      {false, {64, 0, 200, 8, 33, 128, 1, 100}, 0, 256, 384, true, DType::bf16, DType::bf16, 1, 0, 0});
  cases.push_back(
      {true, {64, 0, 200, 8, 33, 128, 1, 100}, 256, 384, 0, false, DType::bf16, DType::f32, 1, 1, 0});
  return cases;
}
inline const std::vector<Case> kCases = make_cases();

// Values stored in `dtype` (x then holds the stored values) as bytes.
inline std::vector<uint8_t> encode(std::vector<float>& x, DType dtype) {
  std::vector<uint8_t> bytes(x.size() * dtype_size(dtype));
  if (dtype == DType::f32) {
    std::memcpy(bytes.data(), x.data(), bytes.size());
    return bytes;
  }
  auto* bits = reinterpret_cast<uint16_t*>(bytes.data());
  for (size_t i = 0; i < x.size(); ++i) bits[i] = f32_to_bf16_bits(x[i]), x[i] = bf16_bits_to_f32(bits[i]);
  return bytes;
}
inline std::vector<float> decode(const std::vector<uint8_t>& bytes, DType dtype) {
  std::vector<float> x(bytes.size() / dtype_size(dtype));
  if (dtype == DType::f32) {
    std::memcpy(x.data(), bytes.data(), bytes.size());
    return x;
  }
  const auto* bits = reinterpret_cast<const uint16_t*>(bytes.data());
  for (size_t i = 0; i < x.size(); ++i) x[i] = bf16_bits_to_f32(bits[i]);
  return x;
}

// A case's operands (values as stored) and params (no pointers). A [R, cols_a] (lda); m_grouped: B holds
// groups matrices of b_group_stride elements, C [R, n] (ldc); k_grouped: B [R, n] (ldb), C groups of
// c_group_stride.
struct Problem {
  Case c;
  std::vector<int64_t> offsets;
  ops::GroupedGemmParams p;
  int64_t rows;
  std::vector<float> a, b, c0;
  std::vector<uint8_t> a_bytes, b_bytes, c_bytes;
  Problem(const Case& c_, uint32_t seed) : c(c_), offsets(c_.offsets()) {
    rows = offsets.back();
    p.groups = c.groups(), p.m = c.m, p.n = c.n, p.k = c.k, p.trans_b = c.trans_b;
    p.ab_dtype = c.ab_dtype, p.c_dtype = c.c_dtype, p.alpha = c.alpha, p.beta = c.beta;
    int64_t b_size, c_size;
    if (c.k_grouped) {
      p.lda = c.m + c.pad, p.ldb = c.n + c.pad + 1, p.ldc = c.n + c.pad;
      p.c_group_stride = (c.m - 1) * p.ldc + c.n + c.pad;
      b_size = rows * p.ldb, c_size = p.groups * p.c_group_stride;
    } else {
      p.lda = c.k + c.pad, p.ldb = (c.trans_b ? c.k : c.n) + c.pad, p.ldc = c.n + c.pad + 1;
      p.b_group_stride = (c.trans_b ? c.n : c.k) * p.ldb + c.pad;
      b_size = p.groups * p.b_group_stride, c_size = rows * p.ldc;
    }
    a = testing::random_floats(rows * p.lda, seed), b = testing::random_floats(b_size, seed + 1);
    c0 = testing::random_floats(c_size, seed + 2);
    if (p.beta == 0) std::fill(c0.begin(), c0.end(), std::numeric_limits<float>::quiet_NaN());
    a_bytes = encode(a, c.ab_dtype), b_bytes = encode(b, c.ab_dtype), c_bytes = encode(c0, c.c_dtype);
  }
  // Where element (i, j) of group g's C lives, and whether C's element `index` is one the op writes.
  int64_t c_index(int64_t g, int64_t i, int64_t j) const {
    return c.k_grouped ? g * p.c_group_stride + i * p.ldc + j : (offsets[g] + i) * p.ldc + j;
  }
  int64_t c_rows(int64_t g) const { return c.k_grouped ? c.m : offsets[g + 1] - offsets[g]; }
  int64_t contraction(int64_t g) const { return c.k_grouped ? offsets[g + 1] - offsets[g] : c.k; }
  // op(A)[i, l] and op(B)[l, j] of group g.
  double a_at(int64_t g, int64_t i, int64_t l) const {
    return c.k_grouped ? a[(offsets[g] + l) * p.lda + i] : a[(offsets[g] + i) * p.lda + l];
  }
  double b_at(int64_t g, int64_t l, int64_t j) const {
    if (c.k_grouped) return b[(offsets[g] + l) * p.ldb + j];
    const int64_t base = g * p.b_group_stride;
    return c.trans_b ? b[base + j * p.ldb + l] : b[base + l * p.ldb + j];
  }
  std::string what() const { return c.name(); }
};

// C in double (untouched elements keep c0), and per written element the magnitude that scales its rounding.
inline void reference(const Problem& pr, std::vector<double>& want, std::vector<double>& magnitude) {
  want.assign(pr.c0.begin(), pr.c0.end()), magnitude.assign(pr.c0.size(), 0);
  for (int64_t g = 0; g < pr.p.groups; ++g)
    for (int64_t i = 0; i < pr.c_rows(g); ++i)
      for (int64_t j = 0; j < pr.c.n; ++j) {
        double s = 0, s_abs = 0;
        for (int64_t l = 0; l < pr.contraction(g); ++l) {
          const double v = pr.a_at(g, i, l) * pr.b_at(g, l, j);
          s += v, s_abs += std::abs(v);
        }
        const int64_t index = pr.c_index(g, i, j);
        const double old = pr.p.beta != 0 ? double{pr.c0[index]} : 0.0;
        want[index] = pr.p.alpha * s + pr.p.beta * old;
        magnitude[index] = std::abs(double{pr.p.alpha}) * s_abs + std::abs(double{pr.p.beta} * old) + 1e-30;
      }
}

// The op on `on`; C's bytes after it.
inline std::vector<uint8_t> run_grouped(Device on, const Problem& pr) {
  DeviceArray<uint8_t> a(on, pr.a_bytes), b(on, pr.b_bytes), c(on, pr.c_bytes);
  ops::GroupedGemmParams p = pr.p;
  p.offsets = pr.offsets.data();  // host memory on every backend
  p.a = a.data(), p.b = b.data(), p.c = c.data();
  if (pr.c.k_grouped)
    FORGE_TEST_OP(k_grouped_gemm, on, p);
  else
    FORGE_TEST_OP(m_grouped_gemm, on, p);
  return c.download();
}

// ops::gemm per non-empty group, in its pieces (and the empty k_grouped groups' beta * C, as the op
// documents) on the CPU: the per-expert loop the grouped op replaces.
inline std::vector<uint8_t> run_per_group(const Problem& pr) {
  std::vector<uint8_t> a = pr.a_bytes, b = pr.b_bytes, c = pr.c_bytes;
  ops::GroupedGemmParams p = pr.p;
  p.offsets = pr.offsets.data(), p.a = a.data(), p.b = b.data(), p.c = c.data();
  for (int64_t g = 0; g < p.groups; ++g) {
    if (pr.offsets[g + 1] > pr.offsets[g]) {
      const ops::GemmParams q =
          pr.c.k_grouped ? ops::k_grouped_gemm_group(p, g) : ops::m_grouped_gemm_group(p, g);
      if (pr.c.k_grouped && p.c_dtype == DType::bf16) {  // rounded once: the group whole
        ops::gemm(q);
        continue;
      }
      for (const auto& [first, rows] : ops::grouped_gemm_pieces(pr.offsets[g + 1] - pr.offsets[g]))
        ops::gemm(ops::grouped_gemm_piece(q, pr.c.k_grouped, first, rows));
      continue;
    }
    if (!pr.c.k_grouped || p.beta == 1) continue;
    std::vector<float> values = decode(c, p.c_dtype);
    for (int64_t i = 0; i < p.m; ++i)
      for (int64_t j = 0; j < p.n; ++j) {
        float& v = values[pr.c_index(g, i, j)];
        v = p.beta == 0 ? 0.0f : v * p.beta;
      }
    const std::vector<uint8_t> scaled = encode(values, p.c_dtype);
    std::copy(scaled.begin(), scaled.end(), c.begin());  // in place: p.c points into c
  }
  return c;
}

class GroupedGemmOp : public testing::OpTest<Case> {};

TEST_P(GroupedGemmOp, MatchesTheReference) {
  const Problem pr(test_case(), 7);
  std::vector<double> want, magnitude;
  reference(pr, want, magnitude);
  const std::vector<uint8_t> cpu_bytes = run_grouped(Device::cpu, pr);
  const std::vector<float> cpu = decode(cpu_bytes, pr.p.c_dtype);
  const bool bf16 = pr.p.c_dtype == DType::bf16;
  int64_t k_max = pr.c.k;
  for (int64_t g = 0; g < pr.p.groups; ++g) k_max = std::max(k_max, pr.contraction(g));
  // Each fp32 addition errs by at most an ulp of the running magnitude (see the top of the file).
  const double tolerance = std::ldexp(2.0 * (k_max + 8), -23);
  if (on_cpu()) {
    // The per-group GEMM loop, bitwise (NaN where an untouched element held one).
    EXPECT_EQ(cpu_bytes, run_per_group(pr)) << pr.what() << ": not the per-group ops::gemm calls";
    for (size_t i = 0; i < cpu.size(); ++i) {
      if (magnitude[i] == 0) {  // not written: the old bits
        ASSERT_EQ(std::memcmp(&cpu_bytes[i * dtype_size(pr.p.c_dtype)],
                              &pr.c_bytes[i * dtype_size(pr.p.c_dtype)], dtype_size(pr.p.c_dtype)),
                  0)
            << pr.what() << ": C[" << i << "] written";
        continue;
      }
      const double bound = tolerance * magnitude[i] + (bf16 ? std::abs(want[i]) / 128 : 0.0);
      ASSERT_NEAR(cpu[i], want[i], bound) << pr.what() << ": C[" << i << "]";
    }
    return;
  }
  const std::vector<uint8_t> got_bytes = run_grouped(device(), pr);
  const std::vector<float> got = decode(got_bytes, pr.p.c_dtype);
  for (size_t i = 0; i < got.size(); ++i) {
    if (magnitude[i] == 0) {
      const size_t e = dtype_size(pr.p.c_dtype);
      ASSERT_EQ(std::memcmp(&got_bytes[i * e], &cpu_bytes[i * e], e), 0) << pr.what() << ": C[" << i << "]";
      continue;
    }
    const double g = got[i], w = cpu[i];
    const double ulp =
        bf16 ? std::ldexp(1.0, std::ilogb(std::max({std::abs(g), std::abs(w), 1e-30})) - 7) : 0.0;
    ASSERT_LE(std::abs(g - w), tolerance * magnitude[i] + ulp)
        << pr.what() << ": C[" << i << "] " << g << ", cpu " << w;
  }
}

// The empty groups of k_grouped_gemm: beta = 1 leaves C_g, beta = 0 zeros it (a NaN there included), beta =
// 0.5 halves it; the other groups are their GEMMs.
class GroupedGemmFixed : public testing::OpTest<testing::FixedCase> {};

TEST_P(GroupedGemmFixed, EmptyKGroupsKeepBetaTimesC) {
  const int64_t m = 2, n = 3;
  const std::vector<int64_t> offsets = {0, 0, 2, 2};                  // groups 0 and 2 empty
  const std::vector<float> a = {1, 2, 3, 4}, b = {1, 0, 1, 0, 1, 1};  // A [2, m], B [2, n]
  const float nan = std::numeric_limits<float>::quiet_NaN();
  for (float beta : {1.0f, 0.0f, 0.5f}) {
    std::vector<float> c0(3 * m * n, 8.0f);
    c0[1] = nan;  // in empty group 0
    DeviceArray<float> da(device(), a), db(device(), b), dc(device(), c0);
    ops::GroupedGemmParams p;
    p.groups = 3, p.offsets = offsets.data(), p.m = m, p.n = n;
    p.a = da.data(), p.lda = m, p.b = db.data(), p.ldb = n, p.c = dc.data(), p.ldc = n,
    p.c_group_stride = m * n;
    p.beta = beta;
    FORGE_TEST_OP(k_grouped_gemm, device(), p);
    const std::vector<float> c = dc.download();
    // Group 1: A^T B = [[1*1 + 3*0, 1*0 + 3*1, 1*1 + 3*1], [2*1 + 4*0, 2*0 + 4*1, 2*1 + 4*1]] + beta * 8.
    const std::vector<float> product = {1, 3, 4, 2, 4, 6};
    for (int64_t i = 0; i < m * n; ++i) {
      EXPECT_EQ(c[m * n + i], product[i] + beta * 8.0f) << "beta " << beta << ", group 1 element " << i;
      for (int64_t g : {0, 2}) {
        const float old = c0[g * m * n + i], now = c[g * m * n + i];
        if (beta == 1.0f)
          EXPECT_TRUE(std::memcmp(&now, &old, sizeof now) == 0) << "beta 1, group " << g << " element " << i;
        else if (beta == 0.0f || !std::isnan(old))
          EXPECT_EQ(now, beta == 0.0f ? 0.0f : old * beta)
              << "beta " << beta << ", group " << g << " element " << i;
        else
          EXPECT_TRUE(std::isnan(now)) << "beta " << beta << ": NaN * beta, group " << g << " element " << i;
      }
    }
  }
}

// Offsets that go down are an error (one line), on every backend.
TEST_P(GroupedGemmFixed, DecreasingOffsetsAreOneLine) {
  const std::vector<int64_t> offsets = {0, 3, 2};
  std::vector<float> zeros(64, 0.0f);
  DeviceArray<float> a(device(), zeros), b(device(), zeros), c(device(), zeros);
  ops::GroupedGemmParams p;
  p.groups = 2, p.offsets = offsets.data(), p.n = 2, p.k = 2, p.a = a.data(), p.lda = 2, p.b = b.data(),
  p.ldb = 2;
  p.c = c.data(), p.ldc = 2;
  testing::expect_error_containing(
      [&] { ops::m_grouped_gemm(p, device()); },
      {"m_grouped_gemm", "offsets must not decrease", "offsets[2] = 2 < offsets[1] = 3"});
}

}  // namespace forge::op_tests::grouped_gemm
