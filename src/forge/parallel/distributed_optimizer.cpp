#include "forge/parallel/distributed_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "forge/core/device.h"
#include "forge/core/dtype.h"
#include "forge/core/error.h"
#include "forge/kernels/emulated_device.h"
#include "forge/kernels/ops.h"

namespace forge::parallel {
using namespace forge::optim;
namespace {
// Where store element `flat` (of parameter `info`, one of the store's infos()) lies in its fp32 weights.
int64_t fp32_index(const ParameterStore& store, const ParamInfo& info, int64_t flat) {
  return store.fp32_offset(static_cast<int>(&info - store.infos().data())) + (flat - info.offset);
}
}  // namespace

DistributedAdamW::DistributedAdamW(ParameterStore* store, optim::AdamWConfig config,
                                   std::vector<OptimizerGroup> groups, comm::Communicator* model_parallel,
                                   OptimizerOffload offload)
    : store_(store),
      config_(config),
      groups_(std::move(groups)),
      model_parallel_(model_parallel),
      offload_(offload) {
  FORGE_CHECK(store != nullptr && !groups_.empty(),
              "the distributed optimizer needs a parameter store and its groups");
  if (!store->has_grads()) fail("AdamW over a parameter store built without gradients (inference)");
  if (offloaded()) {
    if (!on_device())
      fail("optimizer offload moves a GPU's optimizer state to the host: these parameters are on the host");
    if (!store->has_bf16())
      fail(
          "optimizer offload needs bf16 weights on the device (train.dtype = bf16): with fp32 ones the fp32 "
          "weights stay on the device and only the moments would move");
    for (const OptimizerGroup& g : groups_)
      FORGE_CHECK(g.buckets != nullptr, "optimizer offload needs every group's gradient buckets");
  }
  for (size_t g = 0; g < groups_.size(); ++g) {
    const GradBuckets* buckets = groups_[g].buckets;
    comm::Communicator* dp = groups_[g].dp;
    FORGE_CHECK(dp != nullptr, "optimizer group {} has no dp group", g);
    std::vector<std::pair<int64_t, int64_t>> ranges;
    if (buckets) {
      FORGE_CHECK(&buckets->store() == store, "the gradient buckets cover another parameter store");
      if (buckets->sharded() && (buckets->dp()->size() != dp->size() || buckets->dp()->rank() != dp->rank()))
        fail("the optimizer's dp group ({} ranks, rank {}) is not the gradient buckets' ({} ranks, rank {})",
             dp->size(), dp->rank(), buckets->dp()->size(), buckets->dp()->rank());
      if (buckets->sharded()) {
        sharded_ = true;
        ranges = buckets->owned_ranges();
      } else if (auto [lo, hi] = store->group_range(buckets->group()); hi > lo) {
        ranges = {{lo, hi}};
      }
    } else {
      FORGE_CHECK(groups_.size() == 1, "an optimizer group without gradient buckets must be the only one");
      if (store->trained_numel() > 0) ranges = {{0, store->trained_numel()}};
    }
    for (const auto& r : ranges) owned_.push_back(r), range_group_.push_back(g);
  }
  // Every parameter group of the store has its optimizer group (else its weights would never move).
  for (const ParamInfo& p : store->infos()) {
    bool covered = groups_.size() == 1 && !groups_[0].buckets;
    for (const OptimizerGroup& g : groups_) covered = covered || (g.buckets && g.buckets->group() == p.group);
    if (!covered) fail("parameter '{}' of group '{}' has no optimizer group", p.name, p.group);
  }
  int64_t total = 0;
  for (auto [lo, hi] : owned_) {
    moment_offsets_.push_back(total);
    total += hi - lo;
  }
  moment_numel_ = total;
  if (offloaded()) {
    if (!dry_host()) {
      exp_avg_ = Tensor::zeros({total}, DType::f32);
      exp_avg_sq_ = Tensor::zeros({total}, DType::f32);
      host_grads_ = Tensor::empty({total}, DType::f32);
      pin(exp_avg_), pin(exp_avg_sq_), pin(host_grads_);
    }
  } else {
    exp_avg_ = Tensor::zeros({total}, DType::f32, store->device());
    exp_avg_sq_ = Tensor::zeros({total}, DType::f32, store->device());
  }
  int64_t padded = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    if (!group_sharded(g)) continue;
    for (const GradBucket& b : groups_[g].buckets->buckets())
      if (b.padded_size() != b.size()) padded = std::max(padded, b.padded_size());
  }
  if (padded > 0) gather_recv_ = Tensor::zeros({padded}, DType::f32, store->device());
  bool all_sharded = true;
  for (size_t g = 0; g < groups_.size(); ++g) all_sharded = all_sharded && group_sharded(g);
  if ((all_sharded || offloaded()) && store->has_bf16()) hold_masters();
  plan_bf16_gathers();
}

DistributedAdamW::~DistributedAdamW() {
  worker_.reset();  // the queued updates finish first
  for (void* p : pinned_) device_memory(store_->device()).unpin_host(p);
}

bool DistributedAdamW::dry_host() const { return offloaded() && EmulatedDevice::check_only(); }

void DistributedAdamW::pin(const Tensor& host) {
  if (host.numel() == 0) return;
  device_memory(store_->device()).pin_host(host.raw(), host.bytes());
  pinned_.push_back(host.raw());
}

void DistributedAdamW::hold_masters() {
  if (store_->fp32_released())
    fail("a second sharded optimizer over one parameter store: its fp32 master weights are already held");
  // The masters of the owned ranges' parameters the store does not keep (offloaded: of all of them), in
  // offset order.
  int64_t total = 0;
  for (auto [begin, end] : owned_)
    for_each_param_in_range(*store_, begin, end, [&](const ParamInfo& info, int64_t lo, int64_t hi) {
      if (info.keep_fp32 && !offloaded()) return;
      if (!master_runs_.empty() && master_runs_.back().end == lo)
        master_runs_.back().end = hi;
      else
        master_runs_.push_back({lo, hi, total});
      total += hi - lo;
    });
  master_numel_ = total;
  if (!dry_host()) {
    masters_ = Tensor::empty({total}, DType::f32, offloaded() ? Device::cpu : store_->device());
    for (const MasterRun& r : master_runs_)
      masters_.view(r.offset, {r.end - r.begin}).copy_from(store_->params().view(r.begin, {r.end - r.begin}));
    if (offloaded()) pin(masters_);
  }
  store_->release_fp32();
}

float* DistributedAdamW::master(const ParamInfo& info, int64_t flat, bool host) const {
  if (!holds_masters() || (info.keep_fp32 && !offloaded()) || !info.trainable) {
    return (host ? host_params_ : store_->params()).f32() + fp32_index(*store_, info, flat);
  }
  FORGE_CHECK(masters_.defined(), "the master weights of a dry run are not held");
  auto it = std::upper_bound(master_runs_.begin(), master_runs_.end(), flat,
                             [](int64_t f, const MasterRun& r) { return f < r.begin; });
  FORGE_CHECK(it != master_runs_.begin() && flat < std::prev(it)->end,
              "the master weight of '{}' (element {}) lies outside this rank's shards", info.name, flat);
  --it;
  return (host && !offloaded() ? host_masters_ : masters_).f32() + it->offset + (flat - it->begin);
}

template <typename Fn>
void DistributedAdamW::for_each_master_run(int64_t begin, int64_t end, Fn&& fn) const {
  const float* run = nullptr;
  int64_t run_lo = 0, run_hi = 0;
  auto flush = [&] {
    if (run_hi > run_lo) fn(run, run_lo, run_hi);
  };
  for_each_param_in_range(*store_, begin, end, [&](const ParamInfo& info, int64_t lo, int64_t hi) {
    const float* src = master(info, lo);
    if (lo != run_hi || src != run + (lo - run_lo)) {
      flush();
      run = src, run_lo = lo;
    }
    run_hi = hi;
  });
  flush();
}

void DistributedAdamW::copy_masters(int64_t begin, int64_t end, Tensor dst) const {
  if (dry_host()) return;  // nothing held, nothing moves
  // Runs of elements adjacent in their master buffer go in one copy.
  for_each_master_run(begin, end, [&](const float* src, int64_t lo, int64_t hi) {
    if (offloaded()) {  // host to device: every owned element's master is in masters_
      dst.view(lo - begin, {hi - lo}).copy_from(masters_.view(src - masters_.f32(), {hi - lo}));
      return;
    }
    ops::StridedCopyParams c;
    c.shape[2] = hi - lo;
    c.src = ConstElements(src), c.dst = dst.f32() + (lo - begin);
    ops::strided_copy(c, store_->device());
  });
}

void DistributedAdamW::write_bf16(int64_t begin, int64_t end, Tensor dst) {
  if (dry_host()) return;
  if (!offloaded()) {
    for_each_master_run(begin, end, [&](const float* src, int64_t lo, int64_t hi) {
      ops::convert_to_bf16(src, dst.bf16() + (lo - begin), hi - lo, store_->device());
    });
    return;
  }
  // On the host, then one copy of the range's bf16 (half the bytes of its fp32); the kept parameters'
  // masters go to the store's fp32 weights as they are.
  Tensor staging = host_bf16_.view(0, {end - begin});
  for_each_master_run(begin, end, [&](const float* src, int64_t lo, int64_t hi) {
    ops::convert_to_bf16(src, staging.bf16() + (lo - begin), hi - lo, Device::cpu);
  });
  dst.copy_from(staging);
  for_each_param_in_range(*store_, begin, end, [&](const ParamInfo& info, int64_t lo, int64_t hi) {
    if (!info.keep_fp32) return;
    store_->params()
        .view(fp32_index(*store_, info, lo), {hi - lo})
        .copy_from(masters_.view(master(info, lo) - masters_.f32(), {hi - lo}));
  });
}

void DistributedAdamW::plan_bf16_gathers() {
  bf16_gather_.assign(groups_.size(), false);
  kept_gathers_.assign(groups_.size(), {});
  kept_send_.assign(groups_.size(), Tensor());
  kept_recv_.assign(groups_.size(), Tensor());
  if (!holds_masters()) return;
  int64_t padded = 0, widest = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    const GradBuckets* gb = groups_[g].buckets;
    if (!gb) continue;
    // Mostly kept in fp32 (FP8 recipes keep every Linear's): the fp32 gather moves fewer bytes.
    int64_t kept = 0, total = 0;
    for (const GradBucket& b : gb->buckets()) {
      total += b.size();
      for_each_param_in_range(*store_, b.begin, b.end, [&](const ParamInfo& info, int64_t lo, int64_t hi) {
        if (info.keep_fp32) kept += hi - lo;
      });
    }
    if (2 * kept >= total) continue;
    bf16_gather_[g] = true;
    const int ranks = gb->sharded() ? gb->dp()->size() : 1;
    int64_t send = 0, recv = 0;
    for (const GradBucket& b : gb->buckets()) {
      const int bucket = static_cast<int>(&b - gb->buckets().data());
      KeptGather k;
      k.runs.resize(static_cast<size_t>(ranks));
      k.counts.assign(static_cast<size_t>(ranks), 0);
      for (int q = 0; q < ranks; ++q) {
        const auto [lo, hi] = gb->owned_range(bucket, q);
        for_each_param_in_range(*store_, lo, hi, [&](const ParamInfo& info, int64_t l, int64_t h) {
          if (!info.keep_fp32) return;
          k.runs[static_cast<size_t>(q)].push_back({fp32_index(*store_, info, l), h - l});
          k.counts[static_cast<size_t>(q)] += h - l;
        });
        k.total += k.counts[static_cast<size_t>(q)];
      }
      k.send_offset = send, k.recv_offset = recv;
      send += k.counts[static_cast<size_t>(ranks > 1 ? gb->dp()->rank() : 0)], recv += k.total;
      if (ranks > 1 && b.padded_size() != b.size()) padded = std::max(padded, b.padded_size());
      const auto [lo, hi] = gb->owned_range(bucket);
      widest = std::max(widest, hi - lo);
      kept_gathers_[g].push_back(std::move(k));
    }
    if (ranks > 1 && recv > 0) {
      kept_send_[g] = Tensor::zeros({std::max<int64_t>(send, 1)}, DType::f32, store_->device());
      kept_recv_[g] = Tensor::zeros({recv}, DType::f32, store_->device());
    }
  }
  if (padded > 0) bf16_recv_ = Tensor::zeros({padded}, DType::bf16, store_->device());
  if (!offloaded()) return;
  if (widest > 0) host_staging_bytes_ = widest * static_cast<int64_t>(sizeof(uint16_t));
  if (widest > 0 && !dry_host()) {
    host_bf16_ = Tensor::empty({widest}, DType::bf16);
    pin(host_bf16_);
  }
  // Each step: the owned gradients down in fp32, the owned weights up in bf16 (and the kept ones in fp32)
  // where the group gathers in bf16, in fp32 otherwise.
  for (size_t r = 0; r < owned_.size(); ++r) {
    offload_down_bytes_ += 4 * (owned_[r].second - owned_[r].first);
    for_each_param_in_range(*store_, owned_[r].first, owned_[r].second,
                            [&](const ParamInfo& info, int64_t lo, int64_t hi) {
                              const bool bf16 = bf16_gather_[range_group_[r]];
                              offload_up_bytes_ += (hi - lo) * (!bf16 ? 4 : info.keep_fp32 ? 6 : 2);
                            });
  }
  plan_offload_chunks();
}

void DistributedAdamW::plan_offload_chunks() {
  chunk_of_bucket_.assign(groups_.size(), {});
  for (size_t g = 0; g < groups_.size(); ++g) {
    const GradBuckets& gb = *groups_[g].buckets;
    chunk_of_bucket_[g].assign(gb.buckets().size(), -1);
    for (size_t i = gb.buckets().size(); i-- > 0;) {  // the gathers' order
      const auto [lo, hi] = gb.owned_range(static_cast<int>(i));
      if (lo == hi) continue;
      size_t r = 0;
      while (r < owned_.size() && !(range_group_[r] == g && owned_[r].first <= lo && hi <= owned_[r].second))
        ++r;
      FORGE_CHECK(r < owned_.size(), "bucket {} of optimizer group {} lies outside the owned ranges", i, g);
      chunk_of_bucket_[g][i] = static_cast<int>(chunks_.size());
      chunks_.push_back({lo, hi, moment_index(r, lo)});
    }
  }
  chunk_ticket_.assign(chunks_.size(), -1);
  if (!dry_host()) worker_ = std::make_unique<WorkerThread>();
}

void DistributedAdamW::await_update(size_t g, size_t i) {
  if (!worker_) return;
  const int c = chunk_of_bucket_[g][i];
  if (c >= 0 && chunk_ticket_[static_cast<size_t>(c)] >= 0)
    worker_->wait(chunk_ticket_[static_cast<size_t>(c)]);
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
    if (run_end > run_begin)
      ops::sum_squares_accumulate(grads + run_begin, run_end - run_begin, total, device);
    run_begin = run_end = 0;
  };
  // Each group's sum is complete once reduced over the ranks that share that group's shards.
  double total_sum = 0;
  for (size_t g = 0; g < groups_.size(); ++g) {
    sum = 0;
    if (device_sum.defined()) device_sum.fill_zero();
    for (size_t r = 0; r < owned_.size(); ++r) {
      if (range_group_[r] != g) continue;
      for_each_param_in_range(*store_, owned_[r].first, owned_[r].second,
                              [&](const ParamInfo& info, int64_t lo, int64_t hi) {
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
    if (group_sharded(g) && groups_[g].dp->size() > 1) sum = comm::all_reduce_sum(*groups_[g].dp, sum);
    if (groups_[g].parts && groups_[g].parts->size() > 1) sum = comm::all_reduce_sum(*groups_[g].parts, sum);
    total_sum = g == 0 ? sum : total_sum + sum;
  }
  sum = total_sum;
  if (model_parallel_ && model_parallel_->size() > 1) sum = comm::all_reduce_sum(*model_parallel_, sum);
  return std::sqrt(sum);
}

void DistributedAdamW::step(float lr, float grad_scale) {
  ++step_;
  if (offloaded()) {
    step_on_host(lr, grad_scale);
    gather_params();
    if (worker_) worker_->wait_all();
    std::fill(chunk_ticket_.begin(), chunk_ticket_.end(), -1);
    store_->mark_updated();
    return;
  }
  for (size_t r = 0; r < owned_.size(); ++r) {
    const int64_t m = moment_offsets_[r];
    // Sharded: the shadow is refreshed after the gather, over whole buckets.
    adamw_update_range(
        *store_, owned_[r].first, owned_[r].second,
        [this](const ParamInfo& info, int64_t flat) { return master(info, flat); }, exp_avg_.f32() + m,
        exp_avg_sq_.f32() + m, config_, lr, grad_scale, step_,
        /*write_bf16=*/!group_sharded(range_group_[r]));
  }
  gather_params();
  store_->mark_updated();
}

void DistributedAdamW::step_on_host(float lr, float grad_scale) {
  if (dry_host()) return;
  // Each chunk's gradients come down while the worker updates the previous chunk; the gathers then wait for
  // each chunk's update before sending its weights up (while the worker goes on with the next).
  for (size_t c = 0; c < chunks_.size(); ++c) {
    const OffloadChunk k = chunks_[c];
    host_grads_.view(k.moments, {k.hi - k.lo}).copy_from(store_->grads().view(k.lo, {k.hi - k.lo}));
    chunk_ticket_[c] = worker_->submit([this, k, lr, grad_scale, step = step_] {
      adamw_update_range(
          *store_, k.lo, k.hi, [this](const ParamInfo& info, int64_t flat) { return master(info, flat); },
          exp_avg_.f32() + k.moments, exp_avg_sq_.f32() + k.moments, config_, lr, grad_scale, step,
          /*write_bf16=*/false, host_grads_.f32() + k.moments, Device::cpu);
    });
  }
}

void DistributedAdamW::gather_params(size_t g) {
  if (bf16_gather_[g])
    gather_bf16(g);
  else
    gather_fp32(g);
}

void DistributedAdamW::gather_bf16(size_t g) {
  const GradBuckets& group_buckets = *groups_[g].buckets;
  const auto& buckets = group_buckets.buckets();
  comm::Communicator& group = *group_buckets.dp();
  const bool communicate = group_buckets.sharded() && group.size() > 1;
  const Tensor& bf16 = store_->params_bf16();
  const Tensor& fp32 = store_->params();
  std::vector<comm::Request> requests(buckets.size()), kept_requests(buckets.size());
  // Launch every bucket's gathers (its bf16 weights in place, its kept parameters' fp32 beside them), then
  // finish them in order.
  for (size_t i = buckets.size(); i-- > 0;) {
    const GradBucket& b = buckets[i];
    const auto [lo, hi] = group_buckets.owned_range(static_cast<int>(i));
    const bool padded = communicate && b.padded_size() != b.size();
    const int64_t at = padded ? group.rank() * b.shard_size : lo;
    const Tensor& into = padded ? bf16_recv_ : bf16;
    await_update(g, i);
    write_bf16(lo, hi, into.view(at, {hi - lo}));
    if (!communicate) continue;
    if (padded && hi - lo < b.shard_size)
      bf16_recv_.view(at + (hi - lo), {b.shard_size - (hi - lo)}).fill_zero();
    uint16_t* recv = padded ? bf16_recv_.bf16() : bf16.bf16() + b.begin;
    requests[i] = group.all_gather(recv + group.rank() * b.shard_size, recv, b.shard_size, comm::Type::bf16);
    const KeptGather& k = kept_gathers_[g][i];
    if (k.total == 0) continue;
    int64_t packed = k.send_offset;
    for (const auto& [offset, count] : k.runs[static_cast<size_t>(group.rank())]) {
      kept_send_[g].view(packed, {count}).copy_from(fp32.view(offset, {count}));
      packed += count;
    }
    kept_requests[i] = group.all_gatherv(kept_send_[g].f32() + k.send_offset,
                                         kept_recv_[g].f32() + k.recv_offset, k.counts, comm::Type::f32);
  }
  if (!communicate) return;
  for (size_t i = buckets.size(); i-- > 0;) {
    const GradBucket& b = buckets[i];
    requests[i].wait();
    if (b.padded_size() != b.size()) bf16.view(b.begin, {b.size()}).copy_from(bf16_recv_.view(0, {b.size()}));
    const KeptGather& k = kept_gathers_[g][i];
    if (k.total == 0) continue;
    kept_requests[i].wait();
    int64_t from = k.recv_offset;
    for (size_t q = 0; q < k.runs.size(); ++q)
      for (const auto& [offset, count] : k.runs[q]) {
        if (static_cast<int>(q) != group.rank())
          fp32.view(offset, {count}).copy_from(kept_recv_[g].view(from, {count}));
        from += count;
      }
  }
}

void DistributedAdamW::gather_fp32(size_t g) {
  const GradBuckets& group_buckets = *groups_[g].buckets;
  const auto& buckets = group_buckets.buckets();
  // Sharded masters gather into the gradient buffer (spent by now; the same offsets as the weights), from
  // which the bf16 weights and the kept fp32 weights are written; otherwise into the fp32 weights.
  const bool masters = holds_masters();
  const Tensor& whole = masters ? store_->grads() : store_->params();
  // The buckets' communicator: the same ranks as the group's dp (checked in the constructor), over the memory
  // the parameters live in (NCCL on GPUs, where dp carries only host scalars).
  comm::Communicator& group = *group_buckets.dp();
  // One rank owns everything: its parameters are whole already (its masters are copied to the buffer). So
  // does every rank of an unsharded group (offloaded: it updated everything on the host).
  const bool communicate = group_buckets.sharded() && group.size() > 1;
  std::vector<comm::Request> requests(buckets.size());
  // Launch every bucket's all-gather, then finish them in order, converting each to bf16 while later ones
  // are still in flight.
  for (size_t i = buckets.size(); i-- > 0;) {
    const GradBucket& b = buckets[i];
    auto [lo, hi] = group_buckets.owned_range(static_cast<int>(i));  // the whole bucket when unsharded
    await_update(g, i);
    if (!communicate) {
      if (masters) copy_masters(lo, hi, whole.view(lo, {hi - lo}));
      continue;
    }
    // In place: the send is this rank's own block of the receive buffer (the bucket itself, or the padded
    // copy of a bucket that does not split evenly), written there first unless it is already (in the
    // device's stream order, which the communicator waits for).
    const bool padded = b.padded_size() != b.size();
    float* recv = padded ? gather_recv_.f32() : whole.f32() + b.begin;
    float* mine = recv + group.rank() * b.shard_size;
    if (masters) {
      copy_masters(lo, hi,
                   padded ? gather_recv_.view(group.rank() * b.shard_size, {hi - lo})
                          : whole.view(b.begin + group.rank() * b.shard_size, {hi - lo}));
    } else if (padded) {
      Tensor own = gather_recv_.view(group.rank() * b.shard_size, {hi - lo});
      own.copy_from(whole.view(lo, {hi - lo}));
    }
    if (padded && hi - lo < b.shard_size)
      gather_recv_.view(group.rank() * b.shard_size + (hi - lo), {b.shard_size - (hi - lo)}).fill_zero();
    requests[i] = group.all_gather(mine, recv, b.shard_size, comm::Type::f32);
  }
  for (size_t i = buckets.size(); i-- > 0;) {
    const GradBucket& b = buckets[i];
    if (communicate) {
      requests[i].wait();
      if (b.padded_size() != b.size())
        whole.view(b.begin, {b.size()}).copy_from(gather_recv_.view(0, {b.size()}));
    }
    if (store_->has_bf16())
      ops::convert_to_bf16(whole.f32() + b.begin, store_->params_bf16().bf16() + b.begin, b.size(),
                           store_->device());
    if (!masters) continue;
    for_each_param_in_range(*store_, b.begin, b.end, [&](const ParamInfo& info, int64_t lo, int64_t hi) {
      if (!info.keep_fp32) return;
      store_->params().view(fp32_index(*store_, info, lo), {hi - lo}).copy_from(whole.view(lo, {hi - lo}));
    });
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
    const bool staged = on_device();  // the store's weights live there (offloaded masters on the host)
    if (params) {
      piece.name = info.name;
      piece.data = master(info, lo, staged);
      pieces.push_back(piece);
    }
    if (moments) {
      const int64_t m = moment_index(static_cast<size_t>(range), lo);
      piece.name = "exp_avg." + info.name;
      piece.data = (state_on_device() ? host_exp_avg_ : exp_avg_).f32() + m;
      pieces.push_back(piece);
      piece.name = "exp_avg_sq." + info.name;
      piece.data = (state_on_device() ? host_exp_avg_sq_ : exp_avg_sq_).f32() + m;
      pieces.push_back(piece);
    }
  });
}

std::vector<ShardPiece> DistributedAdamW::checkpoint_pieces(bool include_params) const {
  std::vector<ShardPiece> pieces;
  stage_on_host(/*download=*/true, include_params);
  for (size_t r = 0; r < owned_.size(); ++r) {
    // An unsharded group's state is the same on each of its dp ranks: dp rank 0 writes it.
    const size_t g = range_group_[r];
    if (!group_sharded(g) && groups_[g].dp->rank() != 0) continue;
    append_pieces(pieces, owned_[r].first, owned_[r].second, static_cast<int>(r), include_params,
                  /*moments=*/true,
                  /*primary_only=*/true);
  }
  // Frozen parameters (ParameterStore::freeze: no optimizer state, the same on every replica) lie past the
  // trained ranges: the dense group's dp rank 0 writes them.
  if (include_params && store_->trained_numel() < store_->numel() && !groups_.empty() &&
      groups_.front().dp->rank() == 0)
    append_pieces(pieces, store_->trained_numel(), store_->numel(), -1, /*params=*/true, /*moments=*/false,
                  /*primary_only=*/true);
  return pieces;
}

std::vector<ShardPiece> DistributedAdamW::checkpoint_pieces_for_load(bool include_params) const {
  stage_on_host(/*download=*/false, include_params);
  std::vector<ShardPiece> pieces;
  // Every rank needs its whole local weights (ZeRO gathers them after each step, so they must start equal),
  // replicated tensor-parallel copies included; the moments only where it updates. Sharded masters: the
  // masters where it updates (finish_load gathers the rest) and the frozen parameters.
  const bool masters = holds_masters();
  if (include_params && !masters)
    append_pieces(pieces, 0, store_->numel(), -1, /*params=*/true, /*moments=*/false, /*primary_only=*/false);
  if (include_params && masters && store_->trained_numel() < store_->numel())
    append_pieces(pieces, store_->trained_numel(), store_->numel(), -1, /*params=*/true, /*moments=*/false,
                  /*primary_only=*/false);
  for (size_t r = 0; r < owned_.size(); ++r)
    append_pieces(pieces, owned_[r].first, owned_[r].second, static_cast<int>(r),
                  /*params=*/include_params && masters, /*moments=*/true, /*primary_only=*/false);
  return pieces;
}

void DistributedAdamW::stage_on_host(bool download, bool with_params) const {
  if (!on_device()) return;
  host_params_ = host_masters_ = Tensor();
  // Offloaded, the masters and moments are host memory already: only the store's weights (kept, frozen)
  // are staged.
  if (download) {
    if (with_params) host_params_ = store_->params().to(Device::cpu);
    if (!state_on_device()) return;
    if (with_params && holds_masters()) host_masters_ = masters_.to(Device::cpu);
    host_exp_avg_ = exp_avg_.to(Device::cpu), host_exp_avg_sq_ = exp_avg_sq_.to(Device::cpu);
  } else {
    if (with_params) host_params_ = Tensor::zeros(store_->params().shape(), DType::f32);
    if (!state_on_device()) return;
    if (with_params && holds_masters()) host_masters_ = Tensor::zeros(masters_.shape(), DType::f32);
    host_exp_avg_ = Tensor::zeros(exp_avg_.shape(), DType::f32);
    host_exp_avg_sq_ = Tensor::zeros(exp_avg_sq_.shape(), DType::f32);
  }
}

void DistributedAdamW::finish_save() {
  host_params_ = host_exp_avg_ = host_exp_avg_sq_ = host_masters_ = Tensor();
}

void DistributedAdamW::finish_load() {
  if (on_device() && (host_exp_avg_.defined() || host_params_.defined())) {
    if (host_params_.defined()) {
      Tensor params = store_->params();
      params.copy_from(host_params_);
    }
    if (host_masters_.defined()) masters_.copy_from(host_masters_);
    if (host_exp_avg_.defined()) exp_avg_.copy_from(host_exp_avg_), exp_avg_sq_.copy_from(host_exp_avg_sq_);
    finish_save();
  }
  // Each rank loaded the masters it holds: the gather makes the weights whole again everywhere.
  if (holds_masters()) gather_params();
}

}  // namespace forge::parallel
