#include "forge/parallel/grad_buckets.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "op_harness.h"
#include "parallel/dp_test_util.h"

namespace forge::parallel::grad_buckets_test {
namespace {

using testing::FakeGroup;

// 160 bytes = 40 floats: rounded to whole 16-float shards, several buckets over the 421-element toy store.
constexpr int64_t kSmallBucket = 160;

TEST(GradBuckets, PartitionIsContiguousAlignedAndCoversTheBuffer) {
  ParameterStore store;
  testing::build_toy_store(store, false);
  const int64_t n = store.numel();
  for (bool shard : {false, true}) {
    for (int dp : {1, 2, 3, 4}) {
      FakeGroup group(0, dp);
      GradBuckets buckets(&store, &group, {kSmallBucket, shard, true});
      const auto& b = buckets.buckets();
      const int shards = shard ? dp : 1;
      ASSERT_GE(b.size(), 4u) << "shard " << shard << " dp " << dp;
      EXPECT_EQ(b.front().begin, 0);
      EXPECT_EQ(b.back().end, n);
      const int64_t size = b.front().size();
      for (size_t i = 0; i < b.size(); ++i) {
        if (i > 0) {
          EXPECT_EQ(b[i].begin, b[i - 1].end);
        }
        // Every bucket but the top one has the common size: a multiple of 16 floats per shard.
        if (i + 1 < b.size()) {
          EXPECT_EQ(b[i].size(), size);
        }
        EXPECT_EQ(b[i].shards, shards);
        EXPECT_GE(b[i].padded_size(), b[i].size());
        EXPECT_LT(b[i].padded_size() - b[i].size(), shards);
        if (i + 1 < b.size()) {
          EXPECT_EQ(b[i].shard_size % 16, 0);
        }
      }
      EXPECT_EQ(size % (16 * shards), 0);
      EXPECT_GE(size, 40);
      // The top bucket is at least half a bucket and less than one and a half.
      EXPECT_GE(b.back().size() * 2, size);
      EXPECT_LT(b.back().size(), size + size / 2);
    }
  }
}

TEST(GradBuckets, BoundariesFallInsideParameters) {
  ParameterStore store;
  testing::build_toy_store(store, false);
  FakeGroup group(0, 2);
  GradBuckets buckets(&store, &group, {kSmallBucket, true, true});
  int inside = 0;
  for (const auto& b : buckets.buckets()) {
    bool at_parameter_start = false;
    for (const auto& p : store.infos()) at_parameter_start |= p.offset == b.begin;
    inside += !at_parameter_start;
  }
  EXPECT_GE(inside, 3);
}

TEST(GradBuckets, ShardedOwnedRangesOfAllRanksPartitionTheBuffer) {
  ParameterStore store;
  testing::build_toy_store(store, false);
  for (int dp : {2, 3, 4}) {
    std::vector<int> owners(store.numel(), 0);
    for (int r = 0; r < dp; ++r) {
      FakeGroup group(r, dp);
      GradBuckets buckets(&store, &group, {kSmallBucket, true, true});
      for (auto [lo, hi] : buckets.owned_ranges()) {
        ASSERT_LT(lo, hi);
        for (int64_t i = lo; i < hi; ++i) ++owners[i];
      }
      // Rank r owns shard r of every bucket.
      for (int i = 0; i < static_cast<int>(buckets.buckets().size()); ++i) {
        const auto& b = buckets.buckets()[i];
        auto [lo, hi] = buckets.owned_range(i);
        EXPECT_EQ(lo, std::min(b.end, b.begin + r * b.shard_size));
        EXPECT_EQ(hi, std::min(b.end, lo + b.shard_size));
      }
    }
    for (int64_t i = 0; i < store.numel(); ++i) ASSERT_EQ(owners[i], 1) << "dp " << dp << " element " << i;
  }
}

TEST(GradBuckets, UnshardedOwnsEverything) {
  ParameterStore store;
  testing::build_toy_store(store, false);
  FakeGroup group(1, 4);
  GradBuckets buckets(&store, &group, {kSmallBucket, false, true});
  using Ranges = std::vector<std::pair<int64_t, int64_t>>;
  EXPECT_EQ(buckets.owned_ranges(), (Ranges{{0, store.numel()}}));
  // One rank under ZeRO: the shards are the buckets, which join into one range.
  FakeGroup one(0, 1);
  GradBuckets single(&store, &one, {kSmallBucket, true, true});
  EXPECT_EQ(single.owned_ranges(), (Ranges{{0, store.numel()}}));
}

TEST(GradBuckets, OneBucketWhenTheBufferIsSmall) {
  ParameterStore store;
  testing::build_toy_store(store, false);
  auto self = comm::make_self("dp");
  GradBuckets buckets(&store, self.get(), {1 << 20, false, true});
  ASSERT_EQ(buckets.buckets().size(), 1u);
  EXPECT_EQ(buckets.buckets()[0].begin, 0);
  EXPECT_EQ(buckets.buckets()[0].end, store.numel());
}

// With overlap, ready_from(x) launches exactly the buckets lying wholly at or above x, top first.
TEST(GradBuckets, ReadyFromLaunchesTheBucketsAboveTheOffset) {
  ParameterStore store;
  testing::build_toy_store(store, false);
  auto self = comm::make_self("dp");
  for (bool shard : {false, true}) {
    GradBuckets buckets(&store, self.get(), {kSmallBucket, shard, true});
    const auto& b = buckets.buckets();
    for (int step = 0; step < 2; ++step) {
      testing::fill_toy_grads(store.grads().f32(), 0, step, 0, store.numel());
      std::vector<float> expected(store.grads().f32(), store.grads().f32() + store.numel());
      buckets.begin_step();
      EXPECT_EQ(buckets.buckets_launched(), 0);
      for (int p = store.count() - 1; p >= 0; --p) {
        const int64_t offset = store.info(p).offset;
        buckets.ready_from(offset);
        int above = 0;
        for (const auto& bucket : b) above += bucket.begin >= offset;
        EXPECT_EQ(buckets.buckets_launched(), above) << "offset " << offset;
      }
      buckets.ready_from(0);
      EXPECT_EQ(buckets.buckets_launched(), static_cast<int>(b.size()));
      buckets.finish();
      // One rank: the sum is the rank's own gradient.
      EXPECT_EQ(std::memcmp(expected.data(), store.grads().f32(), expected.size() * sizeof(float)), 0);
    }
    EXPECT_EQ(buckets.total_stats().steps, 2);
    EXPECT_EQ(buckets.last_step_stats().bytes, store.numel() * 4);
  }
}

// Readiness by count: whatever order the weight gradients arrive in (the schedule's), a bucket launches
// exactly when the last parameter overlapping it has received its last gradient of the step, and not before.
TEST(GradBuckets, ReadinessByCountLaunchesEachBucketWhenItsLastParameterIsFinal) {
  ParameterStore store;
  testing::build_toy_store(store, false);
  auto self = comm::make_self("dp");
  const int n = store.count();
  std::vector<std::vector<int>> orders(3);
  for (int p = 0; p < n; ++p) orders[0].push_back(p), orders[1].push_back(n - 1 - p);
  for (int p = 0; p < n; ++p)
    orders[2].push_back((p * 5 + 3) % n);  // 5 is coprime with the toy store's count
  ASSERT_EQ(n % 5 == 0, false);
  for (bool shard : {false, true})
    for (const std::vector<int>& order : orders) {
      GradBuckets buckets(&store, self.get(), {kSmallBucket, shard, true});
      const auto& b = buckets.buckets();
      constexpr int kMicroBatches = 2;
      store.begin_grad_step(kMicroBatches);
      buckets.begin_step();
      std::vector<int> seen(n, 0);
      for (int m = 0; m < kMicroBatches; ++m)
        for (int p : order) {
          store.note_grad(p);
          ++seen[p];
          int ready = 0;
          for (const GradBucket& bucket : b) {
            bool all = true;
            for (int q = 0; q < n; ++q) {
              const int64_t lo = store.info(q).offset, hi = lo + shape_numel(store.info(q).shape);
              if (lo < bucket.end && bucket.begin < hi && seen[q] < kMicroBatches) all = false;
            }
            ready += all;
          }
          EXPECT_EQ(buckets.buckets_launched(), ready) << "after parameter " << p << " of micro-batch " << m;
        }
      EXPECT_FALSE(store.grad_step_active());
      EXPECT_EQ(buckets.buckets_launched(), static_cast<int>(b.size()));
      buckets.finish();
    }
}

// A group's buckets cover only that group's parameters.
TEST(GradBuckets, CoverOneParameterGroup) {
  ParameterStore store;
  store.add("dense.a", {40}, true, Init::zeros);
  store.add("dense.b", {24}, true, Init::zeros);
  store.add("expert.a", {32}, true, Init::zeros, 0.02f, {}, "expert");
  store.add("expert.b", {8}, true, Init::zeros, 0.02f, {}, "expert");
  store.allocate(false);
  EXPECT_EQ(store.group_range("dense"), std::make_pair(int64_t{0}, int64_t{64}));
  EXPECT_EQ(store.group_range("expert"), std::make_pair(int64_t{64}, int64_t{104}));
  auto self = comm::make_self("dp");
  BucketOptions options{1 << 20, false, true};
  options.group = "expert";
  GradBuckets experts(&store, self.get(), options);
  ASSERT_EQ(experts.buckets().size(), 1u);
  EXPECT_EQ(experts.buckets()[0].begin, 64);
  EXPECT_EQ(experts.buckets()[0].end, 104);
  store.begin_grad_step(1);
  experts.begin_step();
  store.note_grad(2), store.note_grad(0), store.note_grad(1);
  EXPECT_EQ(experts.buckets_launched(), 0);  // the dense parameters do not count for the expert bucket
  store.note_grad(3);
  EXPECT_EQ(experts.buckets_launched(), 1);
  experts.finish();
}

TEST(GradBuckets, WithoutOverlapEverythingWaitsForFinish) {
  ParameterStore store;
  testing::build_toy_store(store, false);
  auto self = comm::make_self("dp");
  GradBuckets buckets(&store, self.get(), {kSmallBucket, true, false});
  buckets.begin_step();
  buckets.ready_from(store.info(3).offset);
  buckets.ready_from(0);
  EXPECT_EQ(buckets.buckets_launched(), 0);
  buckets.finish();
  EXPECT_EQ(buckets.buckets_launched(), static_cast<int>(buckets.buckets().size()));
  const auto& stats = buckets.last_step_stats();
  EXPECT_GE(stats.exposed_seconds, 0);
  EXPECT_GE(stats.communication_seconds, 0);
  // Everything happened inside finish(): nothing was hidden.
  EXPECT_LE(stats.communication_seconds, stats.exposed_seconds);
  EXPECT_EQ(stats.overlap_ratio(), 0.0);
}

TEST(GradBuckets, OverlapRatio) {
  GradReductionStats s;
  EXPECT_EQ(s.overlap_ratio(), 0.0);
  s.communication_seconds = 4, s.exposed_seconds = 1;
  EXPECT_DOUBLE_EQ(s.overlap_ratio(), 0.75);
  s.exposed_seconds = 5;
  EXPECT_EQ(s.overlap_ratio(), 0.0);
}

TEST(GradBuckets, MisuseFailsWithAMessage) {
  ParameterStore store;
  testing::build_toy_store(store, false);
  auto self = comm::make_self("dp");
  GradBuckets buckets(&store, self.get(), {kSmallBucket, false, true});
  EXPECT_THROW(buckets.ready_from(0), Error);
  EXPECT_THROW(buckets.finish(), Error);
  buckets.begin_step();
  EXPECT_THROW(buckets.begin_step(), Error);
  EXPECT_THROW(buckets.ready_from(store.numel() + 1), Error);
  buckets.finish();
  EXPECT_THROW(GradBuckets(&store, self.get(), {0, false, true}), Error);
  ParameterStore inference;
  inference.add("w", {4}, true, Init::zeros);
  inference.allocate(false, /*with_grads=*/false);
  EXPECT_THROW(GradBuckets(&inference, self.get(), {kSmallBucket, false, true}), Error);
  // Reductions run in fp32 or bf16 only: anything else is one line naming the dtype.
  BucketOptions fp16{kSmallBucket, false, true};
  fp16.reduce_dtype = DType::f16;
  testing::expect_error_containing([&] { GradBuckets(&store, self.get(), fp16); },
                                   {"gradient reductions run in fp32 or bf16", dtype_name(DType::f16)});
}

TEST(GradBuckets, DefaultSizeFollowsTheDevice) {
  // Host memory over MPI: 4 MiB. Device memory: Megatron's max(40M, 1M x dp) fp32 elements.
  EXPECT_EQ(default_bucket_bytes(false, 1), 4ll << 20);
  EXPECT_EQ(default_bucket_bytes(false, 512), 4ll << 20);
  EXPECT_EQ(default_bucket_bytes(true, 1), 160'000'000);
  EXPECT_EQ(default_bucket_bytes(true, 40), 160'000'000);
  EXPECT_EQ(default_bucket_bytes(true, 64), 256'000'000);
  // An explicit size wins on either device; 0 asks for the default.
  EXPECT_EQ(bucket_bytes_of(0.25, true, 8), 262144);
  EXPECT_EQ(bucket_bytes_of(0, true, 8), 160'000'000);
  EXPECT_EQ(bucket_bytes_of(0, false, 8), 4ll << 20);
}

}  // namespace
}  // namespace forge::parallel::grad_buckets_test
