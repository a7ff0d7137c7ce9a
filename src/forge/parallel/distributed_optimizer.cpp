#include "forge/parallel/distributed_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "forge/core/dtype.h"
#include "forge/core/error.h"
#include "forge/kernels/ops.h"

namespace forge::parallel {
using namespace forge::optim;

DistributedAdamW::DistributedAdamW(ParameterStore* store, AdamWConfig config, comm::Communicator* dp,
                                   comm::Communicator* model_parallel, const GradBuckets* buckets)
    : store_(store), config_(config), dp_(dp), model_parallel_(model_parallel), buckets_(buckets) {
  FORGE_CHECK(store != nullptr && dp != nullptr,
              "the distributed optimizer needs a parameter store and a dp group");
  if (!store->has_grads()) fail("AdamW over a parameter store built without gradients (inference)");
  if (buckets) {
    FORGE_CHECK(&buckets->store() == store, "the gradient buckets cover another parameter store");
    sharded_ = buckets->sharded();
    if (sharded_ && (buckets->dp()->size() != dp->size() || buckets->dp()->rank() != dp->rank()))
      fail("the optimizer's dp group ({} ranks, rank {}) is not the gradient buckets' ({} ranks, rank {})",
           dp->size(), dp->rank(), buckets->dp()->size(), buckets->dp()->rank());
  }
  if (sharded_)
    owned_ = buckets->owned_ranges();
  else if (store->numel() > 0)
    owned_ = {{0, store->numel()}};
  int64_t total = 0;
  for (auto [lo, hi] : owned_) {
    moment_offsets_.push_back(total);
    total += hi - lo;
  }
  exp_avg_ = Tensor::zeros({total}, DType::f32, store->device());
  exp_avg_sq_ = Tensor::zeros({total}, DType::f32, store->device());
  if (sharded_) {
    int64_t shards = 0, padded = 0;
    for (const GradBucket& b : buckets->buckets()) {
      shards += b.shard_size;
      if (b.padded_size() != b.size()) padded = std::max(padded, b.padded_size());
    }
    gather_send_ = Tensor::zeros({shards}, DType::f32, store->device());
    if (padded > 0) gather_recv_ = Tensor::zeros({padded}, DType::f32, store->device());
  }
}

double DistributedAdamW::grad_norm() const {
  const float* grads = store_->grads().f32();
  const Device device = store_->device();
  // The sum lives where the gradients do, and each run's squares are added to it there, in order: one read
  // back per norm instead of one per run (a device synchronisation each), bitwise the same double additions.
  double sum = 0;
  Tensor device_sum;  // one double (as two floats' bytes) on a device
  if (device != Device::cpu) device_sum = Tensor::zeros({2}, DType::f32, device);
  double* total = device_sum.defined() ? static_cast<double*>(device_sum.raw()) : &sum;
  // Runs of adjacent primary parameters go to one call: with one rank and no replicated copies this is
  // global_grad_norm's single sum, bitwise.
  int64_t run_begin = 0, run_end = 0;
  auto flush = [&] {
    if (run_end > run_begin) ops::sum_squares_accumulate(grads + run_begin, run_end - run_begin, total, device);
    run_begin = run_end = 0;
  };
  for (auto [begin, end] : owned_) {
    for_each_param_in_range(*store_, begin, end, [&](const ParamInfo& info, int64_t lo, int64_t hi) {
      if (!info.shard.primary) return;
      if (lo != run_end) {
        flush();
        run_begin = lo;
      }
      run_end = hi;
    });
  }
  flush();
  if (device_sum.defined()) std::memcpy(&sum, device_sum.to(Device::cpu).raw(), sizeof(double));
  if (sharded_ && dp_->size() > 1) sum = comm::all_reduce_sum(*dp_, sum);
  if (model_parallel_ && model_parallel_->size() > 1) sum = comm::all_reduce_sum(*model_parallel_, sum);
  return std::sqrt(sum);
}

void DistributedAdamW::step(float lr, float grad_scale) {
  ++step_;
  for (size_t r = 0; r < owned_.size(); ++r) {
    const int64_t m = moment_offsets_[r];
    // Sharded: the shadow is refreshed after the gather, over whole buckets.
    adamw_update_range(*store_, owned_[r].first, owned_[r].second, exp_avg_.f32() + m, exp_avg_sq_.f32() + m,
                       config_, lr, grad_scale, step_, /*write_bf16=*/!sharded_);
  }
  if (sharded_) gather_params();
  store_->mark_updated();
}

void DistributedAdamW::gather_params() {
  const auto& buckets = buckets_->buckets();
  const Tensor& params = store_->params();
  // The buckets' communicator: the same group as dp_ (checked in the constructor), over the memory the
  // parameters live in (NCCL on GPUs, where dp_ carries only host scalars).
  comm::Communicator& group = *buckets_->dp();
  // One rank owns everything: its parameters are whole already.
  const bool communicate = group.size() > 1;
  std::vector<comm::Request> requests(buckets.size());
  // Launch every bucket's all-gather, then finish them in order, converting each to bf16 while later ones
  // are still in flight.
  int64_t send_offset = 0;
  for (size_t i = buckets.size(); communicate && i-- > 0;) {
    const GradBucket& b = buckets[i];
    auto [lo, hi] = buckets_->owned_range(static_cast<int>(i));
    // The send buffer must not alias the receive buffer (the bucket), so the own shard is staged (in the
    // device's stream order, which the communicator waits for).
    Tensor send = gather_send_.view(send_offset, {b.shard_size});
    send.view(0, {hi - lo}).copy_from(params.view(lo, {hi - lo}));
    send.view(hi - lo, {b.shard_size - (hi - lo)}).fill_zero();
    float* recv = b.padded_size() == b.size() ? params.f32() + b.begin : gather_recv_.f32();
    requests[i] = group.all_gather(send.f32(), recv, b.shard_size, comm::Type::f32);
    send_offset += b.shard_size;
  }
  for (size_t i = buckets.size(); i-- > 0;) {
    const GradBucket& b = buckets[i];
    if (communicate) {
      requests[i].wait();
      if (b.padded_size() != b.size()) params.view(b.begin, {b.size()}).copy_from(gather_recv_.view(0, {b.size()}));
    }
    if (store_->has_bf16())
      ops::convert_to_bf16(params.f32() + b.begin, store_->params_bf16().bf16() + b.begin, b.size(),
                           store_->device());
  }
}

void DistributedAdamW::append_pieces(std::vector<ShardPiece>& pieces, int64_t begin, int64_t end, int range,
                                     bool params, bool moments, bool primary_only) const {
  for_each_param_in_range(*store_, begin, end, [&](const ParamInfo& info, int64_t lo, int64_t hi) {
    if (primary_only && !info.shard.primary) return;
    ShardPiece piece;
    piece.global_shape = info.global_shape();
    piece.local_shape = info.shape;
    piece.split_dim = info.shard.dim;
    piece.split_start = info.shard.start;
    piece.flat_begin = lo - info.offset;
    piece.flat_end = hi - info.offset;
    const bool staged = on_device();
    if (params) {
      piece.name = info.name;
      piece.data = (staged ? host_params_ : store_->params()).f32() + lo;
      pieces.push_back(piece);
    }
    if (moments) {
      const int64_t m = moment_index(static_cast<size_t>(range), lo);
      piece.name = "exp_avg." + info.name;
      piece.data = (staged ? host_exp_avg_ : exp_avg_).f32() + m;
      pieces.push_back(piece);
      piece.name = "exp_avg_sq." + info.name;
      piece.data = (staged ? host_exp_avg_sq_ : exp_avg_sq_).f32() + m;
      pieces.push_back(piece);
    }
  });
}

std::vector<ShardPiece> DistributedAdamW::checkpoint_pieces(bool include_params) const {
  std::vector<ShardPiece> pieces;
  // Unsharded, every dp rank holds the same state: dp rank 0 writes it.
  if (!sharded_ && dp_->rank() != 0) return pieces;
  stage_on_host(/*download=*/true, include_params);
  for (size_t r = 0; r < owned_.size(); ++r)
    append_pieces(pieces, owned_[r].first, owned_[r].second, static_cast<int>(r), include_params,
                  /*moments=*/true,
                  /*primary_only=*/true);
  return pieces;
}

std::vector<ShardPiece> DistributedAdamW::checkpoint_pieces_for_load(bool include_params) const {
  stage_on_host(/*download=*/false, include_params);
  std::vector<ShardPiece> pieces;
  // Every rank needs its whole local weights (ZeRO gathers them after each step, so they must start equal),
  // replicated tensor-parallel copies included; the moments only where it updates.
  if (include_params)
    append_pieces(pieces, 0, store_->numel(), -1, /*params=*/true, /*moments=*/false, /*primary_only=*/false);
  for (size_t r = 0; r < owned_.size(); ++r)
    append_pieces(pieces, owned_[r].first, owned_[r].second, static_cast<int>(r), /*params=*/false,
                  /*moments=*/true, /*primary_only=*/false);
  return pieces;
}

void DistributedAdamW::stage_on_host(bool download, bool with_params) const {
  if (!on_device()) return;
  host_params_ = Tensor();
  if (download) {
    if (with_params) host_params_ = store_->params().to(Device::cpu);
    host_exp_avg_ = exp_avg_.to(Device::cpu), host_exp_avg_sq_ = exp_avg_sq_.to(Device::cpu);
  } else {
    if (with_params) host_params_ = Tensor::zeros(store_->params().shape(), DType::f32);
    host_exp_avg_ = Tensor::zeros(exp_avg_.shape(), DType::f32);
    host_exp_avg_sq_ = Tensor::zeros(exp_avg_sq_.shape(), DType::f32);
  }
}

void DistributedAdamW::finish_save() { host_params_ = host_exp_avg_ = host_exp_avg_sq_ = Tensor(); }

void DistributedAdamW::finish_load() {
  if (!on_device() || !host_exp_avg_.defined()) return;
  if (host_params_.defined()) {
    Tensor params = store_->params();
    params.copy_from(host_params_);
  }
  exp_avg_.copy_from(host_exp_avg_), exp_avg_sq_.copy_from(host_exp_avg_sq_);
  finish_save();
}

}  // namespace forge::parallel
