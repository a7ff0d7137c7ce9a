// Shared by the data-parallel tests (gradient buckets, distributed optimizer): a toy parameter store with
// odd sizes, a replicated tensor-parallel copy and a split tensor; gradients that depend only on (rank,
// step, element) and are dyadic, so that their sum over ranks is exact in any order; and a fake
// communicator that only has a rank and a size (for layouts, without MPI).
#pragma once

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "forge/comm/comm.h"
#include "forge/core/error.h"
#include "forge/core/parameters.h"
#include "forge/parallel/distributed_optimizer.h"

namespace forge::testing {

// 421 elements: bucket boundaries fall inside parameters for any small bucket size.
inline void build_toy_store(ParameterStore& store, bool bf16_shadow, bool replica_primary = false) {
  store.add("embed", {13, 7}, true, Init::normal, 0.5f);
  store.add("layer.0.norm", {7}, false, Init::ones);
  store.add("layer.0.w", {11, 7}, true, Init::normal, 0.5f);
  // A copy a lower tensor-parallel rank also holds: excluded from the norm and from checkpoints.
  ShardSpec replica;
  replica.primary = replica_primary;
  store.add("layer.0.replica", {5}, false, Init::normal, 0.5f, replica);
  store.add("layer.1.w", {3, 29}, true, Init::normal, 0.5f);
  store.add("layer.1.b", {1}, false, Init::zeros);
  // The first half of a [34, 9] tensor split along rows.
  ShardSpec split;
  split.dim = 0;
  split.global_shape = {34, 9};
  store.add("head", {17, 9}, true, Init::normal, 0.5f, split);
  store.allocate(bf16_shadow);
  store.initialize(1234);
}

// A multiple of 1/256 in [-3.9, 3.9]: sums of up to 2^11 of them are exact in fp32.
inline float toy_grad(int rank, int step, int64_t index) {
  uint64_t h =
      (static_cast<uint64_t>(rank) * 1000003u + static_cast<uint64_t>(step)) * 0x9E3779B97F4A7C15ull +
      static_cast<uint64_t>(index) * 0xBF58476D1CE4E5B9ull;
  h ^= h >> 31;
  h *= 0x94D049BB133111EBull;
  h ^= h >> 29;
  return static_cast<float>(static_cast<int>(h % 2001) - 1000) / 256.0f;
}

inline void fill_toy_grads(float* grads, int rank, int step, int64_t begin, int64_t end) {
  for (int64_t i = begin; i < end; ++i) grads[i] = toy_grad(rank, step, i);
}

// The exact sum over ranks [0, ranks) of toy_grad (rank ids through `rank_of`).
template <typename RankOf>
std::vector<float> summed_toy_grads(int ranks, int step, int64_t n, RankOf rank_of) {
  std::vector<float> sum(n, 0.0f);
  for (int r = 0; r < ranks; ++r)
    for (int64_t i = 0; i < n; ++i) sum[i] += toy_grad(rank_of(r), step, i);
  return sum;
}

// The fp32 weights the optimizer steps, whole on every rank: the store's (unsharded masters), or with
// sharded masters each element from its owner (summed over dp: the others add zeros) and the kept
// parameters from the store.
inline std::vector<float> master_weights(const ParameterStore& store,
                                         const parallel::DistributedAdamW& optimizer,
                                         comm::Communicator& dp) {
  const int64_t n = store.numel();
  std::vector<float> w(n, 0.0f);
  if (!optimizer.holds_masters()) {
    std::memcpy(w.data(), store.params().f32(), n * sizeof(float));
    return w;
  }
  for (auto [begin, end] : optimizer.owned_ranges())
    optim::for_each_param_in_range(store, begin, end, [&](const ParamInfo& info, int64_t lo, int64_t hi) {
      if (!info.keep_fp32)
        for (int64_t i = lo; i < hi; ++i) w[i] = *optimizer.master(info, i);
    });
  comm::all_reduce_sum(dp, w.data(), n);
  for (int id = 0; id < store.count(); ++id)
    if (store.info(id).keep_fp32)
      std::memcpy(w.data() + store.info(id).offset, store.param(id).f32(), store.param(id).bytes());
  return w;
}

// A communicator with a rank and a size and no transport: enough to lay out buckets and owned ranges.
class FakeGroup : public comm::Communicator {
 public:
  FakeGroup(int rank, int size) {
    rank_ = rank, size_ = size, world_rank_ = rank;
    name_ = "fake";
  }
  const char* backend() const override { return "fake"; }
  comm::Request all_reduce(void*, int64_t, comm::Type, comm::ReduceOp) override { none("all_reduce"); }
  comm::Request all_gather(const void*, void*, int64_t, comm::Type) override { none("all_gather"); }
  comm::Request all_gatherv(const void*, void*, std::span<const int64_t>, comm::Type) override {
    none("all_gatherv");
  }
  comm::Request reduce_scatter(const void*, void*, int64_t, comm::Type, comm::ReduceOp) override {
    none("reduce_scatter");
  }
  comm::Request all_to_all(const void*, void*, int64_t, comm::Type) override { none("all_to_all"); }
  comm::Request all_to_allv(const void*, std::span<const int64_t>, std::span<const int64_t>, void*,
                            std::span<const int64_t>, std::span<const int64_t>, comm::Type) override {
    none("all_to_allv");
  }
  comm::Request send(const void*, int64_t, comm::Type, int, int) override { none("send"); }
  comm::Request recv(void*, int64_t, comm::Type, int, int) override { none("recv"); }
  comm::Request broadcast(void*, int64_t, comm::Type, int) override { none("broadcast"); }
  comm::Request barrier() override { none("barrier"); }
  std::unique_ptr<comm::Communicator> split(int, int, std::string) override { none("split"); }
  [[noreturn]] void abort(const std::string& message) override { fail("fake group aborted: {}", message); }

 private:
  [[noreturn]] static void none(const char* op) { fail("fake group: no transport for {}", op); }
};

}  // namespace forge::testing
