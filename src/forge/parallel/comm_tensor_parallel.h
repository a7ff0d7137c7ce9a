// The tensor-parallel group of nn/ (nn::TensorParallel) over a comm::Communicator: the all-reduces,
// all-gathers and reduce-scatters that Megatron's column- and row-parallel layers, vocabulary-parallel
// embedding and cross-entropy, and sequence parallelism need. These calls sit on the critical path of
// forward and backward, where nothing else is ready to overlap with them: on host buffers they block; on
// device buffers they complete in the device's stream order (the kernels queued after them run after them,
// and the host does not wait).
#pragma once

#include "forge/comm/comm.h"
#include "forge/nn/tensor_parallel.h"

namespace forge::parallel {

class CommTensorParallel final : public nn::TensorParallel {
 public:
  // group carries host buffers; device_group (an NCCL communicator over the same ranks, when the model lives
  // on GPUs) carries device buffers. Without device_group every buffer goes to group.
  CommTensorParallel(comm::Communicator* group, bool sequence_parallel,
                     comm::Communicator* device_group = nullptr)
      : group_(group), device_group_(device_group), sequence_parallel_(sequence_parallel) {}
  int rank() const override { return group_->rank(); }
  int size() const override { return group_->size(); }
  bool sequence_parallel() const override { return sequence_parallel_; }

  void all_reduce_sum(float* buf, int64_t count, Device where) override;
  void all_reduce_max(float* buf, int64_t count, Device where) override;
  void all_gather(const float* send, float* recv, int64_t count, Device where) override;
  Tensor all_gather_rows(const Tensor& shard) override;
  Tensor reduce_scatter_rows(const Tensor& full) override;
  void all_reduce_rows(Tensor& x) override;

 private:
  comm::Communicator& group_for(Device where) const;
  void reduce(float* buf, int64_t count, comm::ReduceOp op, Device where);

  comm::Communicator* group_;
  comm::Communicator* device_group_;
  bool sequence_parallel_;
};

}  // namespace forge::parallel
