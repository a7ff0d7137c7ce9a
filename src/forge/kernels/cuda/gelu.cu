// GELU forward and backward on device memory, in the CPU kernels' forms (see cpu/gelu.cpp): x Phi(x) through
// erfc, the tanh form as x sigmoid(2u), quick as x sigmoid(1.702 x), and sigmoid's complement without
// cancellation. The exponential is the CPU's simd_exp (cpu/simd_exp.h, kernel_support.cuh's
// exp_parts_like_cpu), so the tanh and quick forms agree with the CPU to the rounding of a few operations;
// the exact form differs by CUDA's erfcf against glibc's (a few ulp each).
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/kernel_support.cuh"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;

constexpr float kSqrtHalf = 0.70710678118654752f;     // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143268f;   // 1 / sqrt(2 pi)
constexpr float kSqrt2OverPi = 0.79788456080286536f;  // sqrt(2 / pi)
constexpr float kTanhCubic = 0.044715f;
constexpr float kQuick = 1.702f;

__device__ __forceinline__ float exp_like_cpu(float x) {
  const detail::ExpParts e = detail::exp_parts_like_cpu(x);
  return e.underflow ? 0.0f : __fmul_rn(e.p, e.scale);
}

// sigmoid(t) and its complement sigmoid(-t) from e = exp(-|t|) <= 1 and q = 1 / (1 + e): the one is q, the
// other e q (see cpu/gelu.cpp).
struct Sigmoid {
  float s, complement;
};
__device__ __forceinline__ Sigmoid sigmoid_like_cpu(float t) {
  const float e = exp_like_cpu(-fabsf(t));
  const float q = __fdiv_rn(1.0f, __fadd_rn(1.0f, e));
  const float eq = __fmul_rn(e, q);
  return t >= 0.0f ? Sigmoid{q, eq} : Sigmoid{eq, q};
}

// The derivatives' second term is 0 once the sigmoid saturates; x is clamped there so that x^2 stays finite.
// (NaN passes through, as std::clamp lets it on the CPU.)
__device__ __forceinline__ float clamp_saturated(float x) {
  return x < -100.0f ? -100.0f : x > 100.0f ? 100.0f : x;
}

__device__ __forceinline__ float tanh_argument(float x) {
  return __fmul_rn(kSqrt2OverPi, __fmaf_rn(__fmul_rn(__fmul_rn(kTanhCubic, x), x), x, x));
}
__device__ __forceinline__ float tanh_argument_slope(float x) {
  return __fmul_rn(kSqrt2OverPi, __fmaf_rn(__fmul_rn(3.0f * kTanhCubic, x), x, 1.0f));
}

__device__ __forceinline__ float gelu(ops::GeluKind kind, float x) {
  switch (kind) {
    case ops::GeluKind::erf:
      return __fmul_rn(__fmul_rn(0.5f, x), erfcf(__fmul_rn(-x, kSqrtHalf)));
    case ops::GeluKind::tanh:
      return __fmul_rn(x, sigmoid_like_cpu(__fmul_rn(2.0f, tanh_argument(x))).s);
    default:
      return __fmul_rn(x, sigmoid_like_cpu(__fmul_rn(kQuick, x)).s);
  }
}

__device__ __forceinline__ float gelu_derivative(ops::GeluKind kind, float x) {
  switch (kind) {
    case ops::GeluKind::erf: {
      const float cdf = __fmul_rn(0.5f, erfcf(__fmul_rn(-x, kSqrtHalf)));
      const float pdf = __fmul_rn(kInvSqrt2Pi, exp_like_cpu(__fmul_rn(__fmul_rn(-0.5f, x), x)));
      return __fmaf_rn(x, pdf, cdf);
    }
    case ops::GeluKind::tanh: {
      x = clamp_saturated(x);
      const Sigmoid s = sigmoid_like_cpu(__fmul_rn(2.0f, tanh_argument(x)));
      const float slope = __fmul_rn(__fmul_rn(2.0f, x), tanh_argument_slope(x));
      return __fmaf_rn(__fmul_rn(slope, s.s), s.complement, s.s);
    }
    default: {
      x = clamp_saturated(x);
      const Sigmoid s = sigmoid_like_cpu(__fmul_rn(kQuick, x));
      return __fmaf_rn(__fmul_rn(__fmul_rn(kQuick, x), s.s), s.complement, s.s);
    }
  }
}

// out may be x, dx may be dy or x (as on the CPU): each thread reads its elements before writing them.
__global__ void forward_kernel(ops::GeluKind kind, const float* x, int64_t n, float* out) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride)
    out[i] = gelu(kind, x[i]);
}

__global__ void backward_kernel(ops::GeluKind kind, const float* x, const float* dy, int64_t n, float* dx) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride)
    dx[i] = __fmul_rn(dy[i], gelu_derivative(kind, x[i]));
}

bool supports(const ops::GeluParams& p, const char* op, bool backward, std::string* reason) {
  if (p.n < 0) return detail::refuse(reason, op, "negative size " + std::to_string(p.n));
  if (p.kind != ops::GeluKind::erf && p.kind != ops::GeluKind::tanh && p.kind != ops::GeluKind::quick)
    return detail::refuse(reason, op, "unknown kind " + std::to_string(static_cast<int>(p.kind)));
  if (p.n == 0) return true;
  using detail::pointer_set;
  if (!pointer_set(p.x, op, "x", reason)) return false;
  return backward ? pointer_set(p.dy, op, "dy", reason) && pointer_set(p.dx, op, "dx", reason)
                  : pointer_set(p.out, op, "out", reason);
}

}  // namespace

bool supports_gelu_forward(const ops::GeluParams& p, std::string* reason) {
  return supports(p, "gelu_forward", false, reason);
}
bool supports_gelu_backward(const ops::GeluParams& p, std::string* reason) {
  return supports(p, "gelu_backward", true, reason);
}

void gelu_forward(const ops::GeluParams& p) {
  if (std::string why; !supports_gelu_forward(p, &why)) fail_message(why);
  if (p.n == 0) return;
  forward_kernel<<<detail::grid_blocks(p.n, kThreads), kThreads, 0, stream()>>>(p.kind, p.x, p.n, p.out);
  FORGE_CUDA_CHECK_LAUNCH("gelu_forward");
}

void gelu_backward(const ops::GeluParams& p) {
  if (std::string why; !supports_gelu_backward(p, &why)) fail_message(why);
  if (p.n == 0) return;
  backward_kernel<<<detail::grid_blocks(p.n, kThreads), kThreads, 0, stream()>>>(p.kind, p.x, p.dy, p.n,
                                                                                 p.dx);
  FORGE_CUDA_CHECK_LAUNCH("gelu_backward");
}

}  // namespace forge::cuda
