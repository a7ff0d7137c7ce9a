// The tensor-parallel group as modules see it. nn/ knows nothing of MPI or NCCL: parallel/ implements this
// interface over a comm::Communicator, and a model built without one (tp = 1) runs every module unsplit.
//
// Megatron's conjugate pairs, expressed as two operations on the token rows:
//   gather_in   before a column-parallel GEMM (forward) and before a row-parallel GEMM's input gradient
//               (backward): identity without sequence parallelism; with it, the [rows/tp, d] shard of each
//               rank becomes the full [rows, d] (all-gather).
//   reduce_out  after a row-parallel GEMM (forward) and after a column-parallel GEMM's input gradient
//               (backward): partial sums over ranks become the full sum (all-reduce), or with sequence
//               parallelism this rank's summed shard of rows (reduce-scatter).
#pragma once

#include <cstdint>

#include "forge/core/tensor.h"

namespace forge::nn {

class TensorParallel {
 public:
  virtual ~TensorParallel() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual bool sequence_parallel() const = 0;

  // `where` says where a buffer lives: the model's device (activations, gradients) or the host (scalars and
  // per-row statistics brought back to be combined there). Implementations route each to a communicator for
  // that memory (NCCL for a GPU's, MPI for the host's). A result in host memory is there on return; one in
  // device memory is there for the device's later work (kernels and copies on its stream), the host need not
  // have waited for it.
  virtual void all_reduce_sum(float* buf, int64_t count, Device where) = 0;  // in place
  virtual void all_reduce_max(float* buf, int64_t count, Device where) = 0;  // in place (FP8 amaxes)
  // Gathers each rank's lse-style vector: out[size * count] in rank order.
  virtual void all_gather(const float* send, float* recv, int64_t count, Device where) = 0;
  // [rows/tp, d] per rank -> [rows, d], shards in rank order, on the shard's device, in its dtype.
  virtual Tensor all_gather_rows(const Tensor& shard) = 0;
  // [rows, d] partial sums -> this rank's [rows/tp, d] shard of the sum, on the input's device, in its dtype.
  virtual Tensor reduce_scatter_rows(const Tensor& full) = 0;
  // x summed over the ranks in place, in its dtype (fp32, or bf16: a bf16 run's messages). Groups that carry
  // fp32 only may keep this default.
  virtual void all_reduce_rows(Tensor& x) {
    FORGE_CHECK(x.dtype() == DType::f32, "this tensor-parallel group sums fp32 only, not {}",
                dtype_name(x.dtype()));
    all_reduce_sum(x.f32(), x.numel(), x.device());
  }

  Tensor gather_in(const Tensor& x) { return sequence_parallel() ? all_gather_rows(x) : x; }
  Tensor reduce_out(const Tensor& x) {
    if (sequence_parallel()) return reduce_scatter_rows(x);
    Tensor y = x;
    all_reduce_rows(y);
    return y;
  }
};

// The same group without sequence parallelism, for modules that must see every row while the stack around
// them is sequence-parallel (DeepSeek-V3's multi-token prediction, whose depths shift the rows by one
// position): gather_in is the identity and reduce_out an all-reduce, over the wrapped group's collectives.
class WithoutSequenceParallel final : public TensorParallel {
 public:
  explicit WithoutSequenceParallel(TensorParallel* group) : group_(group) {}
  int rank() const override { return group_->rank(); }
  int size() const override { return group_->size(); }
  bool sequence_parallel() const override { return false; }
  void all_reduce_sum(float* buf, int64_t count, Device where) override {
    group_->all_reduce_sum(buf, count, where);
  }
  void all_reduce_max(float* buf, int64_t count, Device where) override {
    group_->all_reduce_max(buf, count, where);
  }
  void all_gather(const float* send, float* recv, int64_t count, Device where) override {
    group_->all_gather(send, recv, count, where);
  }
  Tensor all_gather_rows(const Tensor& shard) override { return group_->all_gather_rows(shard); }
  Tensor reduce_scatter_rows(const Tensor& full) override { return group_->reduce_scatter_rows(full); }
  void all_reduce_rows(Tensor& x) override { group_->all_reduce_rows(x); }

 private:
  TensorParallel* group_;
};

// Identity when tp is null (one rank).
inline Tensor gather_in(TensorParallel* tp, const Tensor& x) { return tp ? tp->gather_in(x) : x; }
inline Tensor reduce_out(TensorParallel* tp, const Tensor& x) { return tp ? tp->reduce_out(x) : x; }

}  // namespace forge::nn
