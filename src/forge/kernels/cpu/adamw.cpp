// Fused AdamW, one pass over memory, following torch.optim.AdamW:
//   g = grad * grad_scale; p *= 1 - lr * wd; m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
//   p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// The step-dependent scalars are computed in double, as Python computes them for torch.
// With a bf16 shadow, each block of updated weights is rounded to bf16 while still in cache.
#include <algorithm>
#include <cmath>

#include "forge/kernels/cpu/cpu_kernels.h"

namespace forge::cpu {
namespace {

// Elements per block: the unit of work per thread and of the bf16 shadow write. The four fp32 streams of a
// block (256 KiB) stay in L2 until the shadow conversion re-reads the parameters.
constexpr int64_t kBlock = 16384;

}  // namespace

bool supports_adamw(const ops::AdamWParams& p, std::string* reason) {
  if (p.n < 0) return ops::refuse(reason, "adamw: negative size {}", p.n);
  if (p.step < 1) return ops::refuse(reason, "adamw: step is 1-based, got {}", p.step);
  return true;
}

void adamw(const ops::AdamWParams& p) {
  if (std::string why; !supports_adamw(p, &why)) fail("{}", why);
  const double t = static_cast<double>(p.step);
  const float decay = static_cast<float>(1.0 - double{p.lr} * p.weight_decay);
  const float beta1 = p.beta1, beta2 = p.beta2, one_minus_beta1 = 1.0f - p.beta1,
              one_minus_beta2 = 1.0f - p.beta2;
  const float step_size = static_cast<float>(p.lr / (1.0 - std::pow(double{p.beta1}, t)));
  const float inv_bias_correction2_sqrt =
      static_cast<float>(1.0 / std::sqrt(1.0 - std::pow(double{p.beta2}, t)));
  const float eps = p.eps, grad_scale = p.grad_scale;
  const int64_t blocks = (p.n + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static)
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t begin = b * kBlock, size = std::min(kBlock, p.n - begin);
    float* param = p.param + begin;
    const float* grad = p.grad + begin;
    float* m = p.exp_avg + begin;
    float* v = p.exp_avg_sq + begin;
#pragma omp simd
    for (int64_t i = 0; i < size; ++i) {
      const float g = grad[i] * grad_scale;
      const float mi = beta1 * m[i] + one_minus_beta1 * g;
      const float vi = beta2 * v[i] + one_minus_beta2 * (g * g);
      m[i] = mi;
      v[i] = vi;
      const float denom = std::sqrt(vi) * inv_bias_correction2_sqrt + eps;
      param[i] = param[i] * decay - step_size * (mi / denom);
    }
    if (p.param_bf16) convert_f32_to_bf16(param, p.param_bf16 + begin, static_cast<size_t>(size));
  }
}

}  // namespace forge::cpu
