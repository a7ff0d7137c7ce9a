// The scalar pieces of the GELU forms that more than one CPU kernel computes (gelu.cpp; the GeGLU of
// swiglu.cpp), written so that they never cancel: sigmoid and its complement both from exp(-|t|), and the
// tanh form as x sigmoid(2u), since 1 + tanh(u) = 2 sigmoid(2u). Each vectorises inside an `omp simd` loop.
#pragma once

#include <algorithm>
#include <cmath>

#include "forge/kernels/cpu/simd_exp.h"

namespace forge::cpu {

constexpr float kSqrt2OverPi = 0.79788456080286536f;  // sqrt(2 / pi)
constexpr float kTanhCubic = 0.044715f;               // the tanh form's cubic coefficient

// sigmoid(t) and 1 - sigmoid(t) = sigmoid(-t) from e = exp(-|t|) <= 1 and q = 1 / (1 + e): the one is q,
// the other e q. Neither cancels, nothing overflows, and where simd_exp flushes e to 0 (|t| > 87) they are
// exactly 1 and 0.
struct Sigmoid {
  float s, complement;
};
inline Sigmoid sigmoid(float t) {
  const float e = simd_exp(-std::abs(t));
  const float q = 1.0f / (1.0f + e);
  return t >= 0.0f ? Sigmoid{q, e * q} : Sigmoid{e * q, q};
}

// The derivatives' second term, x u'(x) s (1 - s), is 0 once the sigmoid saturates (|x| > 52 in either form);
// x is clamped there so that x^2 stays finite (inf * 0 would be NaN).
inline float clamp_saturated(float x) { return std::clamp(x, -100.0f, 100.0f); }

// u = sqrt(2/pi) (x + 0.044715 x^3) and du/dx; gelu = x sigmoid(2u).
inline float tanh_argument(float x) { return kSqrt2OverPi * (x + kTanhCubic * x * x * x); }
inline float tanh_argument_slope(float x) { return kSqrt2OverPi * (1.0f + 3.0f * kTanhCubic * x * x); }

// The tanh form and its derivative s + 2 x u'(x) s (1 - s), s = sigmoid(2u).
inline float gelu_tanh(float x) { return x * sigmoid(2.0f * tanh_argument(x)).s; }
inline float gelu_tanh_derivative(float x) {
  const float v = clamp_saturated(x);
  const Sigmoid s = sigmoid(2.0f * tanh_argument(v));
  return s.s + 2.0f * v * tanh_argument_slope(v) * s.s * s.complement;
}

}  // namespace forge::cpu
