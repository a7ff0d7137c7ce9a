#include "forge/optim/adamw.h"

#include <cmath>

#include "forge/core/error.h"
#include "forge/kernels/ops.h"

namespace forge {

double global_grad_norm(const nn::ParameterStore& store) {
  if (!store.has_grads()) fail("gradient norm of a parameter store built without gradients (inference)");
  return std::sqrt(ops::sum_squares(store.grads().f32(), store.numel()));
}

float clip_coefficient(double norm, float max_norm) {
  if (max_norm <= 0) return 1.0f;
  // torch computes the coefficient in fp32: max_norm / (total_norm + 1e-6), clamped to 1.
  float coefficient = max_norm / (static_cast<float>(norm) + 1e-6f);
  return coefficient < 1.0f ? coefficient : 1.0f;
}

AdamW::AdamW(nn::ParameterStore* store, AdamWConfig config)
    : store_(store),
      config_(config),
      exp_avg_(Tensor::zeros({store->numel()}, DType::f32)),
      exp_avg_sq_(Tensor::zeros({store->numel()}, DType::f32)) {
  if (!store->has_grads()) fail("AdamW over a parameter store built without gradients (inference)");
}

void AdamW::step(float lr, float grad_scale) {
  ++step_;
  float* params = store_->params().f32();
  const float* grads = store_->grads().f32();
  uint16_t* shadow = store_->has_bf16() ? store_->params_bf16().bf16() : nullptr;
  for (const auto& info : store_->infos()) {
    ops::AdamWParams p;
    p.n = shape_numel(info.shape);
    p.param = params + info.offset;
    p.grad = grads + info.offset;
    p.exp_avg = exp_avg_.f32() + info.offset;
    p.exp_avg_sq = exp_avg_sq_.f32() + info.offset;
    p.param_bf16 = shadow ? shadow + info.offset : nullptr;
    p.lr = lr, p.beta1 = config_.beta1, p.beta2 = config_.beta2, p.eps = config_.eps;
    p.weight_decay = info.weight_decay ? config_.weight_decay : 0.0f;
    p.step = step_;
    p.grad_scale = grad_scale;
    ops::adamw(p);
  }
}

}  // namespace forge
