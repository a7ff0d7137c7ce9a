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
#include "forge/kernels/cpu/gelu_math.h"
#include "forge/kernels/cpu/simd_exp.h"

namespace forge::cpu {
namespace {

// Below this many elements a parallel region costs more than it saves.
constexpr int64_t kParallelElements = 1 << 15;

constexpr float kSqrtHalf = 0.70710678118654752f;    // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143268f;  // 1 / sqrt(2 pi)
constexpr float kQuick = 1.702f;                     // quick_gelu's sigmoid slope

bool supports(const ops::GeluParams& p, const char* op, bool backward, std::string* reason) {
  if (p.n < 0) return ops::refuse(reason, "{}: negative size {}", op, p.n);
  if (p.kind != ops::GeluKind::erf && p.kind != ops::GeluKind::tanh && p.kind != ops::GeluKind::quick)
    return ops::refuse(reason, "{}: unknown kind {}", op, static_cast<int>(p.kind));
  if (p.n == 0) return true;
  if (!ops::pointer_set(p.x, op, "x", reason)) return false;
  return backward ? ops::pointer_set(p.dy, op, "dy", reason) && ops::pointer_set(p.dx, op, "dx", reason)
                  : ops::pointer_set(p.out, op, "out", reason);
}

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
      for (int64_t i = 0; i < p.n; ++i) out[i] = gelu_tanh(x[i]);
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
      for (int64_t i = 0; i < p.n; ++i) dx[i] = dy[i] * gelu_tanh_derivative(x[i]);
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
