// Bucketed data-parallel gradient reduction across MPI ranks (run by mpirun with 2 and 4 ranks).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

#include "forge/parallel/grad_buckets.h"
#include "parallel/dp_test_util.h"

namespace forge::parallel::grad_buckets_mpi_test {
namespace {

// 160 bytes: several buckets over the 421-element toy store, boundaries inside parameters, a padded top
// bucket.
constexpr int64_t kSmallBucket = 160;

class Reduction : public ::testing::TestWithParam<std::tuple<bool, bool>> {};

// Backward emulated parameter by parameter from the last: each gradient is written just before
// ready_from() reports it final, so a bucket launched too early would reduce stale values.
TEST_P(Reduction, EqualsAPlainAllReduceInTheOwnedRanges) {
  const auto [shard, overlap] = GetParam();
  comm::Communicator& world = comm::world();
  ParameterStore store;
  testing::build_toy_store(store, false);
  const int64_t n = store.numel();
  GradBuckets buckets(&store, &world, {kSmallBucket, shard, overlap});
  ASSERT_GE(buckets.buckets().size(), 4u);
  for (int step = 0; step < 3; ++step) {
    store.zero_grads();
    float* grads = store.grads().f32();
    buckets.begin_step();
    for (int p = store.count() - 1; p >= 0; --p) {
      const int64_t begin = store.info(p).offset, end = begin + shape_numel(store.info(p).shape);
      testing::fill_toy_grads(grads, world.rank(), step, begin, end);
      buckets.ready_from(begin);
      int above = 0;
      for (const auto& b : buckets.buckets()) above += b.begin >= begin;
      ASSERT_EQ(buckets.buckets_launched(), overlap ? above : 0);
    }
    buckets.ready_from(0);
    buckets.finish();

    std::vector<float> plain(n);
    testing::fill_toy_grads(plain.data(), world.rank(), step, 0, n);
    comm::all_reduce_sum(world, plain.data(), n);
    // The toy gradients are dyadic: every summation order gives the exact sum, so equality is bitwise.
    const auto exact = testing::summed_toy_grads(world.size(), step, n, [](int r) { return r; });
    for (auto [lo, hi] : buckets.owned_ranges()) {
      for (int64_t i = lo; i < hi; ++i) {
        ASSERT_EQ(grads[i], plain[i]) << "step " << step << " element " << i;
        ASSERT_EQ(grads[i], exact[i]) << "step " << step << " element " << i;
      }
    }
  }
  const auto& stats = buckets.last_step_stats();
  EXPECT_EQ(buckets.total_stats().steps, 3);
  EXPECT_GE(stats.exposed_seconds, 0);
  EXPECT_GE(stats.communication_seconds, 0);
  EXPECT_GE(stats.overlap_ratio(), 0);
  EXPECT_LE(stats.overlap_ratio(), 1);
  if (!overlap) {
    EXPECT_EQ(stats.overlap_ratio(), 0);
  }
}

// Reductions in bf16 (Megatron's grad_reduce_in_bf16): each rank's gradients rounded to bf16 once, summed by
// the communicator with a rounding per addition (ranks - 1 of them, in whatever order it takes), widened
// back into the fp32 buffer: within `ranks` bf16 units (2^-8) of the magnitude sum of the rounded values,
// and the bytes reduced are half of fp32's.
TEST_P(Reduction, InBf16WithinItsRoundingsAtHalfTheBytes) {
  const auto [shard, overlap] = GetParam();
  comm::Communicator& world = comm::world();
  ParameterStore store;
  testing::build_toy_store(store, false);
  const int64_t n = store.numel();
  BucketOptions options{kSmallBucket, shard, overlap};
  options.reduce_dtype = DType::bf16;
  GradBuckets buckets(&store, &world, options);
  store.zero_grads();
  float* grads = store.grads().f32();
  testing::fill_toy_grads(grads, world.rank(), 1, 0, n);
  buckets.begin_step();
  buckets.ready_from(0);
  buckets.finish();
  std::vector<double> sum(n, 0.0), magnitude(n, 0.0);
  for (int r = 0; r < world.size(); ++r)
    for (int64_t i = 0; i < n; ++i) {
      const double x = bf16_to_float(float_to_bf16(testing::toy_grad(r, 1, i)));
      sum[i] += x, magnitude[i] += std::abs(x);
    }
  int64_t checked = 0;
  for (auto [lo, hi] : buckets.owned_ranges())
    for (int64_t i = lo; i < hi; ++i, ++checked)
      ASSERT_NEAR(grads[i], sum[i], world.size() * std::ldexp(magnitude[i], -8)) << "element " << i;
  EXPECT_GT(checked, 0);
  EXPECT_EQ(buckets.last_step_stats().bytes, 2 * n);
  // The toy gradients need 10 significant bits: in bf16 some sums differ from fp32's exact ones.
  const auto exact = testing::summed_toy_grads(world.size(), 1, n, [](int r) { return r; });
  int64_t rounded = 0;
  for (auto [lo, hi] : buckets.owned_ranges())
    for (int64_t i = lo; i < hi; ++i) rounded += grads[i] != exact[i];
  EXPECT_GT(rounded, 0) << "the bf16 reduction gave fp32's exact sums: did it run in fp32?";
}

INSTANTIATE_TEST_SUITE_P(ShardOverlap, Reduction, ::testing::Combine(::testing::Bool(), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) ? "sharded" : "allreduce") +
                                  (std::get<1>(info.param) ? "_overlapped" : "_at_finish");
                         });

// Under ZeRO the owned ranges of the ranks partition the buffer: every element has exactly one owner.
TEST(GradBucketsMpi, OwnedRangesPartitionTheBufferAcrossRanks) {
  comm::Communicator& world = comm::world();
  ParameterStore store;
  testing::build_toy_store(store, false);
  for (bool shard : {false, true}) {
    GradBuckets buckets(&store, &world, {kSmallBucket, shard, true});
    std::vector<float> owners(store.numel(), 0.0f);
    for (auto [lo, hi] : buckets.owned_ranges())
      for (int64_t i = lo; i < hi; ++i) owners[i] += 1;
    comm::all_reduce_sum(world, owners.data(), store.numel());
    const float expected = shard ? 1.0f : static_cast<float>(world.size());
    for (int64_t i = 0; i < store.numel(); ++i) ASSERT_EQ(owners[i], expected) << "element " << i;
  }
}

// A sub-group as the dp group: ranks pair up, each pair reduces on its own.
TEST(GradBucketsMpi, ReducesOverASubGroup) {
  comm::Communicator& world = comm::world();
  if (world.size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  auto dp = world.split(world.rank() / 2, world.rank(), "dp");
  ASSERT_EQ(dp->size(), 2);
  ParameterStore store;
  testing::build_toy_store(store, false);
  GradBuckets buckets(&store, dp.get(), {kSmallBucket, true, true});
  testing::fill_toy_grads(store.grads().f32(), world.rank(), 7, 0, store.numel());
  buckets.begin_step();
  buckets.ready_from(0);
  buckets.finish();
  const int first = world.rank() / 2 * 2;
  const auto exact = testing::summed_toy_grads(2, 7, store.numel(), [first](int r) { return first + r; });
  for (auto [lo, hi] : buckets.owned_ranges())
    for (int64_t i = lo; i < hi; ++i) ASSERT_EQ(store.grads().f32()[i], exact[i]) << "element " << i;
}

}  // namespace
}  // namespace forge::parallel::grad_buckets_mpi_test
