// The expert-parallel group of nn/ (nn::ExpertParallel) over a comm::Communicator: the counts' all-to-all on
// the host and the rows' all-to-all(v), asynchronous, over the communicator of the rows' memory (MPI for the
// host's, NCCL for a GPU's).
#pragma once

#include "forge/comm/comm.h"
#include "forge/nn/expert_parallel.h"

namespace forge::parallel {

class CommExpertParallel final : public nn::ExpertParallel {
 public:
  // group carries host buffers; device_group (NCCL over the same ranks, when the model lives on GPUs) device
  // buffers.
  explicit CommExpertParallel(comm::Communicator* group, comm::Communicator* device_group = nullptr)
      : group_(group), device_group_(device_group) {}
  int rank() const override { return group_->rank(); }
  int size() const override { return group_->size(); }
  void exchange_counts(const int64_t* send, int64_t* recv, int64_t n) override;
  std::unique_ptr<Transfer> all_to_all_rows(const Tensor& send, std::span<const int64_t> send_rows,
                                            const Tensor& recv, std::span<const int64_t> recv_rows,
                                            int64_t cols) override;

 private:
  comm::Communicator* group_;
  comm::Communicator* device_group_;
};

}  // namespace forge::parallel
