// GELU forward and backward in Hugging Face's three forms (ops::GeluKind). Each form is written so that it
// never cancels: x Phi(x) through erfc (1 + erf(z) loses every digit as z -> -inf), and the tanh form as
// x sigmoid(2u), since 1 + tanh(u) = 2 sigmoid(2u); sigmoid and its complement, which the derivatives need,
// both from exp(-|t|).
//
// The tanh and quick forms use simd_exp and vectorise; the exact form calls erfc (glibc's has no vector
// variant without -ffast-math).
#include <algorithm>
#include <cmath>

#include "forge/kernels/cpu/cpu_kernels.h"
#include "forge/kernels/cpu/simd_exp.h"

namespace forge::cpu {
namespace {

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelElements = 1 << 15;

constexpr float kSqrtHalf = 0.70710678118654752f;     // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143268f;   // 1 / sqrt(2 pi)
constexpr float kSqrt2OverPi = 0.79788456080286536f;  // sqrt(2 / pi)
constexpr float kTanhCubic = 0.044715f;               // the tanh form's cubic coefficient
constexpr float kQuick = 1.702f;                      // quick_gelu's sigmoid slope

bool supports(const ops::GeluParams& p, const char* op, bool backward, std::string* reason) {
  if (p.n < 0) return ops::refuse(reason, "{}: negative size {}", op, p.n);
  if (p.kind != ops::GeluKind::erf && p.kind != ops::GeluKind::tanh && p.kind != ops::GeluKind::quick)
    return ops::refuse(reason, "{}: unknown kind {}", op, static_cast<int>(p.kind));
  if (p.n == 0) return true;
  if (!ops::pointer_set(p.x, op, "x", reason)) return false;
  return backward ? ops::pointer_set(p.dy, op, "dy", reason) && ops::pointer_set(p.dx, op, "dx", reason)
                  : ops::pointer_set(p.out, op, "out", reason);
}

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

}  // namespace

bool supports_gelu_forward(const ops::GeluParams& p, std::string* reason) {
  return supports(p, "gelu_forward", false, reason);
}
bool supports_gelu_backward(const ops::GeluParams& p, std::string* reason) {
  return supports(p, "gelu_backward", true, reason);
}

void gelu_forward(const ops::GeluParams& p) {
  if (std::string why; !supports_gelu_forward(p, &why)) fail("{}", why);
  const float* x = p.x;
  float* out = p.out;
  const bool parallel = p.n > kParallelElements;
  switch (p.kind) {
    case ops::GeluKind::erf:
#pragma omp parallel for schedule(static) if (parallel)
      for (int64_t i = 0; i < p.n; ++i) out[i] = 0.5f * x[i] * std::erfc(-x[i] * kSqrtHalf);
      break;
    case ops::GeluKind::tanh:
#pragma omp parallel for simd schedule(static) if (parallel)
      for (int64_t i = 0; i < p.n; ++i) out[i] = x[i] * sigmoid(2.0f * tanh_argument(x[i])).s;
      break;
    case ops::GeluKind::quick:
#pragma omp parallel for simd schedule(static) if (parallel)
      for (int64_t i = 0; i < p.n; ++i) out[i] = x[i] * sigmoid(kQuick * x[i]).s;
      break;
  }
}

// erf:   gelu' = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
// tanh:  gelu' = s + 2 x u'(x) s (1 - s), s = sigmoid(2u)
// quick: gelu' = s + 1.702 x s (1 - s), s = sigmoid(1.702 x)
void gelu_backward(const ops::GeluParams& p) {
  if (std::string why; !supports_gelu_backward(p, &why)) fail("{}", why);
  const float* x = p.x;
  const float* dy = p.dy;
  float* dx = p.dx;
  const bool parallel = p.n > kParallelElements;
  switch (p.kind) {
    case ops::GeluKind::erf:
#pragma omp parallel for schedule(static) if (parallel)
      for (int64_t i = 0; i < p.n; ++i) {
        const float v = x[i];
        const float cdf = 0.5f * std::erfc(-v * kSqrtHalf);
        const float pdf = kInvSqrt2Pi * simd_exp(-0.5f * v * v);
        dx[i] = dy[i] * (cdf + v * pdf);
      }
      break;
    case ops::GeluKind::tanh:
#pragma omp parallel for simd schedule(static) if (parallel)
      for (int64_t i = 0; i < p.n; ++i) {
        const float v = clamp_saturated(x[i]);
        const Sigmoid s = sigmoid(2.0f * tanh_argument(v));
        dx[i] = dy[i] * (s.s + 2.0f * v * tanh_argument_slope(v) * s.s * s.complement);
      }
      break;
    case ops::GeluKind::quick:
#pragma omp parallel for simd schedule(static) if (parallel)
      for (int64_t i = 0; i < p.n; ++i) {
        const float v = clamp_saturated(x[i]);
        const Sigmoid s = sigmoid(kQuick * v);
        dx[i] = dy[i] * (s.s + kQuick * v * s.s * s.complement);
      }
      break;
  }
}

}  // namespace forge::cpu
