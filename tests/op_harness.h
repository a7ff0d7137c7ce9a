// The op harness: helpers every op test uses to compare a kernel with a double-precision reference and
// to check gradients by central finite differences (evaluated in double on the reference).
#pragma once

#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <initializer_list>
#include <string>
#include <string_view>
#include <random>

#include "forge/kernels/ops.h"
#include <vector>

#include "forge/core/dtype.h"
#include "forge/core/error.h"

namespace forge::testing {

inline std::vector<float> random_floats(size_t n, uint32_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> dist(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(gen);
  return v;
}

inline std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// max |a-b| / (atol_floor + max|b|): a relative error against the reference's scale.
inline double relative_error(const float* got, const double* want, size_t n) {
  double max_diff = 0, max_ref = 0;
  for (size_t i = 0; i < n; ++i) {
    max_diff = std::max(max_diff, std::abs(static_cast<double>(got[i]) - want[i]));
    max_ref = std::max(max_ref, std::abs(want[i]));
  }
  return max_diff / (max_ref + 1e-30);
}
inline double relative_error(const std::vector<float>& got, const std::vector<double>& want) {
  EXPECT_EQ(got.size(), want.size());
  return relative_error(got.data(), want.data(), got.size());
}

// Scale-free similarity 1 - 2<x,y>/(|x|^2+|y|^2): 0 for identical vectors (used for low precision).
inline double dissimilarity(const float* x, const double* y, size_t n) {
  double xy = 0, xx = 0, yy = 0;
  for (size_t i = 0; i < n; ++i) {
    xy += x[i] * y[i];
    xx += double(x[i]) * x[i];
    yy += y[i] * y[i];
  }
  return 1.0 - 2.0 * xy / (xx + yy + 1e-300);
}

// Central finite differences of a scalar double-precision function f(x) at x; returns df/dx.
inline std::vector<double> finite_difference(const std::function<double(const std::vector<double>&)>& f,
                                             std::vector<double> x, double h = 1e-5) {
  std::vector<double> g(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    double saved = x[i];
    x[i] = saved + h;
    double up = f(x);
    x[i] = saved - h;
    double down = f(x);
    x[i] = saved;
    g[i] = (up - down) / (2 * h);
  }
  return g;
}

// <w, y>: projects an output onto fixed random weights so a vector-valued op becomes a scalar loss whose
// gradient with respect to the output is w (the dy fed to the backward kernel).
inline double dot(const std::vector<double>& w, const std::vector<double>& y) {
  double s = 0;
  for (size_t i = 0; i < w.size(); ++i) s += w[i] * y[i];
  return s;
}

// Expects f() to throw forge::Error with a one-line message containing every fragment (the culprit).
template <typename F>
void expect_error_containing(F&& f, std::initializer_list<std::string_view> fragments) {
  try {
    f();
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    for (std::string_view fragment : fragments)
      EXPECT_NE(message.find(fragment), std::string::npos) << "'" << fragment << "' not in: " << message;
  }
}

// Runs f with the OpenMP thread count set to `threads` (for thread-count invariance checks).
template <typename F>
void with_threads(int threads, F&& f) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(threads);
  f();
  omp_set_num_threads(saved);
}

// Whether this CPU's fp32 GEMM of [m, k] x [k, n] gives other bits with 1 and 2 threads. oneDNN's AVX-512
// kernels do not; its AVX2 ones may split k between threads, which reorders the sum. Tests of bitwise
// thread-count invariance of ops built on GEMMs hold only where the GEMM itself is invariant.
inline bool gemm_bits_depend_on_thread_count(int64_t m, int64_t n, int64_t k) {
  const std::vector<float> a = random_floats(m * k, 11), b = random_floats(k * n, 12);
  std::vector<float> c1(m * n), c2(m * n);
  ops::GemmParams p;
  p.m = m, p.n = n, p.k = k, p.a = a.data(), p.lda = k, p.b = b.data(), p.ldb = n, p.ldc = n;
  p.c = c1.data();
  with_threads(1, [&] { ops::gemm(p); });
  p.c = c2.data();
  with_threads(2, [&] { ops::gemm(p); });
  return std::memcmp(c1.data(), c2.data(), c1.size() * sizeof(float)) != 0;
}

// A GEMM-like op (ops::gemm, ops::fp8_gemm) with a bf16 output against the same op with an fp32 one. c16 is the
// bf16 C [m, p.ldc] (NaN where beta = 0 must not read it); run(p) runs the op. It runs once into an fp32 C
// holding c16's exact values, then into c16 with c_dtype bf16: every element must be the fp32 result rounded,
// bitwise, and each row's padding columns [n, ldc) untouched.
template <typename Params, typename Run>
void expect_bf16_output_is_fp32_rounded(Params p, std::vector<uint16_t> c16, Run run) {
  std::vector<float> c32(c16.size());
  for (size_t i = 0; i < c16.size(); ++i) c32[i] = bf16_bits_to_f32(c16[i]);
  const std::vector<uint16_t> before = c16;
  Params f32 = p;
  f32.c = c32.data();
  run(f32);
  p.c = c16.data(), p.c_dtype = DType::bf16;
  run(p);
  for (int64_t i = 0; i < p.m; ++i) {
    for (int64_t j = 0; j < p.n; ++j)
      ASSERT_EQ(c16[i * p.ldc + j], f32_to_bf16_bits(c32[i * p.ldc + j]))
          << "C[" << i << "," << j << "]: bf16 output " << bf16_bits_to_f32(c16[i * p.ldc + j]) << ", fp32 output "
          << c32[i * p.ldc + j];
    EXPECT_EQ(std::memcmp(&c16[i * p.ldc + p.n], &before[i * p.ldc + p.n], (p.ldc - p.n) * sizeof(uint16_t)), 0)
        << "padding of row " << i << " was written";
  }
}

}  // namespace forge::testing
