#include "forge/parallel/comm_tensor_parallel.h"

#include "forge/core/error.h"

namespace forge::parallel {

comm::Communicator& CommTensorParallel::group_for(Device where) const {
  if (where == Device::cpu) return *group_;
  FORGE_CHECK(device_group_ != nullptr,
              "tensor parallelism: a device buffer, but the group has no device communicator (NCCL)");
  return *device_group_;
}

// Host buffers: blocking MPI calls. Device buffers: NCCL operations completed in the device's stream order
// (Communicator::wait_on_stream), so the host goes on queueing kernels instead of draining the GPU's queue at
// every collective; results are read by later kernels, or by copies that wait for them.
void CommTensorParallel::all_reduce_sum(float* buf, int64_t count, Device where) {
  reduce(buf, count, comm::ReduceOp::sum, where);
}

void CommTensorParallel::all_reduce_max(float* buf, int64_t count, Device where) {
  reduce(buf, count, comm::ReduceOp::max, where);
}

void CommTensorParallel::reduce(float* buf, int64_t count, comm::ReduceOp op, Device where) {
  comm::Communicator& group = group_for(where);
  if (where == Device::cpu) {
    group.all_reduce_blocking(buf, count, comm::Type::f32, op);
    return;
  }
  comm::Request request = group.all_reduce(buf, count, comm::Type::f32, op);
  group.wait_on_stream(request);
}

void CommTensorParallel::all_gather(const float* send, float* recv, int64_t count, Device where) {
  comm::Communicator& group = group_for(where);
  comm::Request request = group.all_gather(send, recv, count, comm::Type::f32);
  group.wait_on_stream(request);
}

Tensor CommTensorParallel::all_gather_rows(const Tensor& shard) {
  FORGE_CHECK(shard.rank() == 2, "all_gather_rows expects a [rows, dim] tensor, got {}",
              shape_string(shard.shape()));
  Tensor full = Tensor::empty({shard.dim(0) * size(), shard.dim(1)}, shard.dtype(), shard.device());
  comm::Communicator& group = group_for(shard.device());
  comm::Request request =
      group.all_gather(shard.raw(), full.raw(), shard.numel(), comm::type_of(shard.dtype()));
  group.wait_on_stream(request);
  return full;
}

void CommTensorParallel::all_reduce_rows(Tensor& x) {
  comm::Communicator& group = group_for(x.device());
  if (x.device() == Device::cpu) {
    group.all_reduce_blocking(x.raw(), x.numel(), comm::type_of(x.dtype()), comm::ReduceOp::sum);
    return;
  }
  comm::Request request = group.all_reduce(x.raw(), x.numel(), comm::type_of(x.dtype()), comm::ReduceOp::sum);
  group.wait_on_stream(request);
}

Tensor CommTensorParallel::reduce_scatter_rows(const Tensor& full) {
  FORGE_CHECK(full.rank() == 2 && full.dim(0) % size() == 0,
              "reduce_scatter_rows: {} rows do not split over {} tensor-parallel ranks", full.dim(0), size());
  Tensor shard = Tensor::empty({full.dim(0) / size(), full.dim(1)}, full.dtype(), full.device());
  comm::Communicator& group = group_for(full.device());
  comm::Request request = group.reduce_scatter(full.raw(), shard.raw(), shard.numel(),
                                               comm::type_of(full.dtype()), comm::ReduceOp::sum);
  group.wait_on_stream(request);
  return shard;
}

}  // namespace forge::parallel
