#include "forge/optim/adamw.h"

#include <cmath>

#include "forge/core/error.h"
#include "forge/kernels/ops.h"

namespace forge::optim {

double global_grad_norm(const ParameterStore& store) {
  if (!store.has_grads()) fail("gradient norm of a parameter store built without gradients (inference)");
  return std::sqrt(ops::sum_squares(store.grads().f32(), store.trained_numel(), store.device()));
}

float clip_coefficient(double norm, float max_norm) {
  if (max_norm <= 0) return 1.0f;
  // torch computes the coefficient in fp32: max_norm / (total_norm + 1e-6), clamped to 1.
  float coefficient = max_norm / (static_cast<float>(norm) + 1e-6f);
  return coefficient < 1.0f ? coefficient : 1.0f;
}

AdamW::AdamW(ParameterStore* store, AdamWConfig config)
    : store_(store),
      config_(config),
      state_{Tensor::zeros({store->trained_numel()}, DType::f32, store->device()),
             Tensor::zeros({store->trained_numel()}, DType::f32, store->device()), 0} {
  if (!store->has_grads()) fail("AdamW over a parameter store built without gradients (inference)");
}

void adamw_update_range(ParameterStore& store, int64_t begin, int64_t end, float* exp_avg, float* exp_avg_sq,
                        const AdamWConfig& config, float lr, float grad_scale, int64_t step,
                        bool write_bf16) {
  FORGE_CHECK(!store.fp32_released(),
              "AdamW over a store whose fp32 weights the distributed optimizer holds");
  float* params = store.params().f32();
  adamw_update_range(
      store, begin, end, [params](const ParamInfo&, int64_t flat) { return params + flat; }, exp_avg,
      exp_avg_sq, config, lr, grad_scale, step, write_bf16);
}

void adamw_update_range(ParameterStore& store, int64_t begin, int64_t end, const MasterWeights& masters,
                        float* exp_avg, float* exp_avg_sq, const AdamWConfig& config, float lr,
                        float grad_scale, int64_t step, bool write_bf16, const float* range_grads,
                        Device range_device) {
  FORGE_CHECK(0 <= begin && begin <= end && end <= store.trained_numel(),
              "AdamW range [{}, {}) outside the {} trained parameters", begin, end, store.trained_numel());
  FORGE_CHECK(!range_grads || !write_bf16, "an update of separate gradients writes no bf16 shadow");
  // The gradient of store element `flat`: the separate gradients hold element `begin` at range_grads.
  const float* store_grads = range_grads ? nullptr : store.grads().f32();
  auto grad_of = [&](int64_t flat) {
    return range_grads ? range_grads + (flat - begin) : store_grads + flat;
  };
  const Device device = range_grads ? range_device : store.device();
  uint16_t* shadow = write_bf16 && store.has_bf16() ? store.params_bf16().bf16() : nullptr;
  // One fused pass per run of adjacent parameters that share their weight decay (the store is one flat
  // buffer): a handful of launches per layer instead of one per tensor.
  int64_t run_lo = 0, run_hi = 0;
  float* run_params = nullptr;  // the master of element run_lo
  bool run_decay = false;
  auto flush = [&] {
    if (run_hi <= run_lo) return;
    ops::AdamWParams p;
    p.n = run_hi - run_lo;
    p.param = run_params;
    p.grad = grad_of(run_lo);
    p.exp_avg = exp_avg + (run_lo - begin);
    p.exp_avg_sq = exp_avg_sq + (run_lo - begin);
    p.param_bf16 = shadow ? shadow + run_lo : nullptr;
    p.lr = lr, p.beta1 = config.beta1, p.beta2 = config.beta2, p.eps = config.eps;
    p.weight_decay = run_decay ? config.weight_decay : 0.0f;
    p.step = step;
    p.grad_scale = grad_scale;
    ops::adamw(p, device);
    run_lo = run_hi = 0;
  };
  for_each_param_in_range(store, begin, end, [&](const ParamInfo& info, int64_t lo, int64_t hi) {
    float* master = masters(info, lo);
    if (lo != run_hi || info.weight_decay != run_decay || master != run_params + (lo - run_lo)) {
      flush();
      run_lo = lo, run_decay = info.weight_decay, run_params = master;
    }
    run_hi = hi;
  });
  flush();
}

void AdamW::step(float lr, float grad_scale) {
  ++state_.steps;
  adamw_update_range(*store_, 0, store_->trained_numel(), state_.exp_avg.f32(), state_.exp_avg_sq.f32(),
                     config_, lr, grad_scale, state_.steps,
                     /*write_bf16=*/true);
  store_->mark_updated();
}

}  // namespace forge::optim
