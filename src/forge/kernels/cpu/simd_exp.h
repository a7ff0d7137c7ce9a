// exp() that the compiler can vectorise. glibc's expf is a scalar call (its vector variants need
// -ffast-math), which would dominate softmax and SwiGLU loops; this version is branch-free arithmetic,
// accurate to about 2 ulp. It never returns a denormal: for x < -87 (true value below ~1.6e-38) it returns
// 0, because denormal operands slow every later multiply by orders of magnitude (a peaked softmax is full
// of them). x > 88 returns exp(88) ~ 1.7e38 rather than inf; NaN propagates.
//
// tanh() on the same arithmetic (glibc's tanhf is scalar too: Gemma 2's soft-capped logits spent three times
// the loss head's GEMM in it): the odd Taylor series through x^9 below |x| = 0.3 (truncation under 2e-8 of
// x), above it 1 - 2 / (exp(2|x|) + 1) with x's sign, within 1e-6 of tanh relative (checked in
// simd_exp_test.cpp); +-1 beyond |x| = 10, where tanh rounds to it; NaN propagates.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace forge::cpu {

inline float simd_exp(float x) {
  const bool underflow = x < -87.0f;
  x = underflow ? -87.0f : x;
  x = x > 88.0f ? 88.0f : x;
  // x = k ln2 + r with |r| <= ln2/2; adding and subtracting 1.5 * 2^23 rounds to the nearest integer.
  const float k = (x * 1.44269504f + 12582912.0f) - 12582912.0f;
  // ln2 split in a high part exact in float and a low correction (Cody-Waite).
  float r = x - k * 0.693145752f;
  r = r - k * 1.42860677e-6f;
  // Taylor series to degree 7: truncation error < 6e-9 on |r| <= 0.347.
  float p = 1.98412698e-4f;
  p = p * r + 1.38888889e-3f;
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const float scale = std::bit_cast<float>((static_cast<int32_t>(k) + 127) << 23);
  return underflow ? 0.0f : p * scale;
}

inline float simd_tanh(float x) {
  const float a = std::fabs(x), x2 = x * x;
  float p = 62.0f / 2835.0f;
  p = p * x2 - 17.0f / 315.0f;
  p = p * x2 + 2.0f / 15.0f;
  p = p * x2 - 1.0f / 3.0f;
  const float small = x + x * x2 * p;
  const float e = simd_exp(2.0f * (a > 10.0f ? 10.0f : a));
  const float large = std::copysign(1.0f - 2.0f / (e + 1.0f), x);
  return a < 0.3f ? small : large;
}

}  // namespace forge::cpu
