// AdamW over a ParameterStore: fp32 moments in one allocation each, decoupled weight decay only on
// parameters registered with weight_decay (not on norms), global-norm gradient clipping as in
// torch.nn.utils.clip_grad_norm_, and the bf16 shadow of the weights refreshed in the same pass.
// The update of a flat range (adamw_update_range) is shared with the data-parallel optimizer
// (parallel/distributed_optimizer.h), which updates only the ranges its rank owns.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>

#include "forge/core/parameters.h"

namespace forge::optim {

struct AdamWConfig {
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
};

// sqrt of the sum of squares of all gradients, accumulated in double.
double global_grad_norm(const ParameterStore& store);
// torch's clip_grad_norm_ coefficient: max_norm / (norm + 1e-6) when that is below 1, else 1.
// max_norm <= 0 disables clipping.
float clip_coefficient(double norm, float max_norm);

// Calls fn(info, lo, hi) for every parameter overlapping the flat range [begin, end) of the store's
// buffers, with [lo, hi) the overlap, in offset order. Ranges of a sharded optimizer or of gradient buckets
// cross parameter boundaries; per-parameter properties (weight decay, sharding) apply piece by piece.
template <typename Fn>
void for_each_param_in_range(const ParameterStore& store, int64_t begin, int64_t end, Fn&& fn) {
  const auto& infos = store.infos();
  const std::vector<int>& order = store.ids_by_offset();
  // The last parameter starting at or before `begin`.
  auto it = std::upper_bound(order.begin(), order.end(), begin,
                             [&](int64_t offset, int id) { return offset < infos[id].offset; });
  if (it != order.begin()) --it;
  for (; it != order.end() && infos[*it].offset < end; ++it) {
    const ParamInfo& p = infos[*it];
    const int64_t lo = std::max(begin, p.offset), hi = std::min(end, p.offset + shape_numel(p.shape));
    if (lo < hi) fn(p, lo, hi);
  }
}

// One AdamW step (1-based `step`) on the flat range [begin, end) of the store's parameters, split by
// parameter so that each piece gets its own weight decay. exp_avg and exp_avg_sq point at the moments of
// element `begin`. write_bf16: also write the bf16 shadow of the range, in the same pass (when the store
// has one). Elementwise: updating a range in pieces gives bitwise the same result as in one call.
void adamw_update_range(ParameterStore& store, int64_t begin, int64_t end, float* exp_avg, float* exp_avg_sq,
                        const AdamWConfig& config, float lr, float grad_scale, int64_t step, bool write_bf16);
// Where the fp32 master weight of element `flat` (of parameter `info`) lives.
using MasterWeights = std::function<float*(const ParamInfo& info, int64_t flat)>;
// The same with the master weights elsewhere than the store's fp32 buffer (the distributed optimizer's
// shards): one fused pass per run of elements adjacent in both the store and `masters`. grads: the
// gradient of element `begin` when not the store's (an offloaded optimizer's host copy), and the device
// the update then runs on (the host); null: the store's gradients, on the store's device.
void adamw_update_range(ParameterStore& store, int64_t begin, int64_t end, const MasterWeights& masters,
                        float* exp_avg, float* exp_avg_sq, const AdamWConfig& config, float lr,
                        float grad_scale, int64_t step, bool write_bf16, const float* grads = nullptr,
                        Device device = Device::cpu);

class AdamW {
 public:
  AdamW(ParameterStore* store, AdamWConfig config);
  // One update with learning rate lr; gradients are first multiplied by grad_scale (clipping).
  void step(float lr, float grad_scale);

  int64_t steps_taken() const { return state_.steps; }
  void set_steps_taken(int64_t step) { state_.steps = step; }
  const Tensor& exp_avg() const { return state_.exp_avg; }
  const Tensor& exp_avg_sq() const { return state_.exp_avg_sq; }
  // The moments and the step count, as checkpoints read and write them (ckpt/checkpoint.h).
  OptimizerMoments& moments() { return state_; }
  const OptimizerMoments& moments() const { return state_; }
  const AdamWConfig& config() const { return config_; }

 private:
  ParameterStore* store_;
  AdamWConfig config_;
  OptimizerMoments state_;
};

}  // namespace forge::optim
