// Fused AdamW on device memory, one pass, following cpu/adamw.cpp (torch.optim.AdamW):
//   g = grad * grad_scale; p *= 1 - lr * wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
//   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// The step-dependent scalars are computed on the host in double by the CPU kernel's expressions, and the
// per-element arithmetic uses the same operation order with explicit FMAs where g++ contracts the CPU loop,
// so the two backends agree to the last bit or within an ulp. The optional bf16 shadow is rounded from the
// updated fp32 weight with core's integer recipe (core/dtype.cpp encode_bf16): nearest, ties to even, NaN
// kept quiet.
#include <cmath>
#include <string>

#include "forge/kernels/cuda/cuda_kernels.h"
#include "forge/kernels/cuda/kernel_support.cuh"

namespace forge::cuda {
namespace {

constexpr int kThreads = 256;

struct Scalars {
  float decay, beta1, beta2, one_minus_beta1, one_minus_beta2, step_size, inv_bias_correction2_sqrt, eps,
      grad_scale;
};

__device__ __forceinline__ uint16_t encode_bf16(float x) {
  const uint32_t u = __float_as_uint(x);
  const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  const uint32_t quiet_nan = (u >> 16) | 0x40u;
  return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

__global__ void adamw_kernel(float* __restrict__ param, const float* __restrict__ grad,
                             float* __restrict__ exp_avg, float* __restrict__ exp_avg_sq,
                             uint16_t* __restrict__ param_bf16, int64_t n, Scalars s) {
  const int64_t stride = int64_t{gridDim.x} * blockDim.x;
  for (int64_t i = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; i < n; i += stride) {
    const float g = __fmul_rn(grad[i], s.grad_scale);
    const float m = __fmaf_rn(s.beta1, exp_avg[i], __fmul_rn(s.one_minus_beta1, g));
    const float v = __fmaf_rn(s.beta2, exp_avg_sq[i], __fmul_rn(s.one_minus_beta2, __fmul_rn(g, g)));
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    const float denom = __fmaf_rn(__fsqrt_rn(v), s.inv_bias_correction2_sqrt, s.eps);
    const float p = __fmaf_rn(s.decay, param[i], -__fmul_rn(s.step_size, __fdiv_rn(m, denom)));
    param[i] = p;
    if (param_bf16 != nullptr) param_bf16[i] = encode_bf16(p);
  }
}

}  // namespace

bool supports_adamw(const ops::AdamWParams& p, std::string* reason) {
  constexpr const char* op = "adamw";
  if (p.n < 0) return detail::refuse(reason, op, "negative size " + std::to_string(p.n));
  if (p.step < 1) return detail::refuse(reason, op, "step is 1-based, got " + std::to_string(p.step));
  if (p.n == 0) return true;
  using detail::pointer_set;
  return pointer_set(p.param, op, "param", reason) && pointer_set(p.grad, op, "grad", reason) &&
         pointer_set(p.exp_avg, op, "exp_avg", reason) &&
         pointer_set(p.exp_avg_sq, op, "exp_avg_sq", reason);  // param_bf16 is optional
}

void adamw(const ops::AdamWParams& p) {
  if (std::string why; !supports_adamw(p, &why)) fail_message(why);
  if (p.n == 0) return;
  // The CPU kernel's scalar expressions, verbatim.
  const double t = static_cast<double>(p.step);
  Scalars s{};
  s.decay = static_cast<float>(1.0 - double{p.lr} * p.weight_decay);
  s.beta1 = p.beta1, s.beta2 = p.beta2, s.one_minus_beta1 = 1.0f - p.beta1,
  s.one_minus_beta2 = 1.0f - p.beta2;
  s.step_size = static_cast<float>(p.lr / (1.0 - std::pow(double{p.beta1}, t)));
  s.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(double{p.beta2}, t)));
  s.eps = p.eps, s.grad_scale = p.grad_scale;
  adamw_kernel<<<detail::grid_blocks(p.n, kThreads), kThreads, 0, stream()>>>(
      p.param, p.grad, p.exp_avg, p.exp_avg_sq, p.param_bf16, p.n, s);
  FORGE_CUDA_CHECK_LAUNCH("adamw");
}

}  // namespace forge::cuda
