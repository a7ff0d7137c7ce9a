// nn::ContextParallel over a communicator: the modules' context-parallel group (the layout's cp group), with
// attention across it in ring or all-to-all mode (parallel/context_parallel.h). On GPUs the attention's
// tensors are device memory and travel over `device_group` (NCCL over the same ranks); statistics and token
// ids are host values and go over `group` (MPI) either way.
#pragma once

#include "forge/comm/comm.h"
#include "forge/nn/context_parallel.h"
#include "forge/parallel/context_parallel.h"

namespace forge::parallel {

class CommContextParallel final : public nn::ContextParallel {
 public:
  CommContextParallel(comm::Communicator* group, ContextAttention mode,
                      comm::Communicator* device_group = nullptr, Device device = Device::cpu)
      : group_(group), device_group_(device_group ? device_group : group), mode_(mode), device_(device) {}
  int rank() const override { return group_->rank(); }
  int size() const override { return group_->size(); }
  ContextAttention mode() const { return mode_; }
  void attention_forward(const ops::AttentionParams& p) override;
  void attention_backward(const ops::AttentionParams& p) override;
  void all_reduce_sum(float* values, int64_t n) override;
  void shift_tokens(const int32_t* local, int32_t* out, int64_t batch, int64_t local_seq, int64_t k,
                    int32_t fill) override;
  // What the attention across the group spent so far (forward and backward together); reset by the caller.
  ContextAttentionStats& stats() { return stats_; }

 private:
  ContextSplit split(const ops::AttentionParams& p) const;
  comm::Communicator* group_;
  comm::Communicator* device_group_;
  ContextAttention mode_;
  Device device_;
  ContextAttentionStats stats_;
};

}  // namespace forge::parallel
