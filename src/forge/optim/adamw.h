// AdamW over a ParameterStore: fp32 moments in one allocation each, decoupled weight decay only on
// parameters registered with weight_decay (not on norms), global-norm gradient clipping as in
// torch.nn.utils.clip_grad_norm_, and the bf16 shadow of the weights refreshed in the same pass.
#pragma once

#include <cstdint>

#include "forge/nn/parameters.h"

namespace forge {

struct AdamWConfig {
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
};

// sqrt of the sum of squares of all gradients, accumulated in double.
double global_grad_norm(const nn::ParameterStore& store);
// torch's clip_grad_norm_ coefficient: max_norm / (norm + 1e-6) when that is below 1, else 1.
// max_norm <= 0 disables clipping.
float clip_coefficient(double norm, float max_norm);

class AdamW {
 public:
  AdamW(nn::ParameterStore* store, AdamWConfig config);
  // One update with learning rate lr; gradients are first multiplied by grad_scale (clipping).
  void step(float lr, float grad_scale);

  int64_t steps_taken() const { return step_; }
  void set_steps_taken(int64_t step) { step_ = step; }
  const Tensor& exp_avg() const { return exp_avg_; }
  const Tensor& exp_avg_sq() const { return exp_avg_sq_; }
  const AdamWConfig& config() const { return config_; }

 private:
  nn::ParameterStore* store_;
  AdamWConfig config_;
  Tensor exp_avg_, exp_avg_sq_;
  int64_t step_ = 0;
};

}  // namespace forge
