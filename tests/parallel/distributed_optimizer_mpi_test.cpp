// The data-parallel AdamW (ZeRO-1 when sharded) across MPI ranks (run by mpirun with 2 and 4 ranks).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "forge/core/dtype.h"
#include "forge/core/error.h"
#include "forge/parallel/distributed_optimizer.h"
#include "parallel/dp_test_util.h"

namespace forge::parallel::distributed_optimizer_mpi_test {
using namespace forge::optim;
namespace {

constexpr int64_t kSmallBucket = 160;

// Sum of squares of `grads` over the primary parameters of `store`, in double.
double primary_sum_squares(const ParameterStore& store, const std::vector<float>& grads) {
  double sum = 0;
  for (const auto& info : store.infos()) {
    if (!info.shard.primary) continue;
    for (int64_t i = info.offset; i < info.offset + shape_numel(info.shape); ++i)
      sum += double(grads[i]) * grads[i];
  }
  return sum;
}

// The toy store with two parameters that modules would read in fp32 (a norm, a bias).
void build_toy_store_with_kept(ParameterStore& store, bool bf16_shadow) {
  testing::build_toy_store(store, bf16_shadow);
  store.keep_fp32(store.find("layer.0.norm"));
  store.keep_fp32(store.find("layer.1.b"));
}

// One step of backward emulated parameter by parameter from the last, then the reduction.
void backward(ParameterStore& store, GradBuckets& buckets, int rank, int step) {
  store.zero_grads();
  buckets.begin_step();
  for (int p = store.count() - 1; p >= 0; --p) {
    const int64_t begin = store.info(p).offset, end = begin + shape_numel(store.info(p).shape);
    testing::fill_toy_grads(store.grads().f32(), rank, step, begin, end);
    buckets.ready_from(begin);
  }
  buckets.ready_from(0);
  buckets.finish();
}

class Steps : public ::testing::TestWithParam<bool> {};

// Over several steps, the data-parallel optimizer (each rank its own gradients) follows forge::optim::AdamW
// on the summed gradients. The toy gradients are dyadic, so the reduced gradients are exactly the sum
// whatever the reduction order, and the update is the same elementwise kernel on the same inputs: weights and
// moments must agree to within 1e-6 relative (a few fp32 ulps, for a kernel whose vector body and scalar tail
// may contract differently where ranges are cut); in practice they agree bitwise. Sharded with the bf16
// shadow the fp32 masters are sharded too (Megatron's distributed optimizer): the store keeps only the kept
// parameters in fp32, and the weights (gathered in bf16, the kept parameters' fp32 beside them) are the same.
TEST_P(Steps, FollowAdamWOnTheSummedGradients) {
  const bool shard = GetParam();
  comm::Communicator& world = comm::world();
  ParameterStore store, reference;
  build_toy_store_with_kept(store, true);
  testing::build_toy_store(reference, true);
  const int64_t n = store.numel();
  GradBuckets buckets(&store, &world, {kSmallBucket, shard, true});
  const AdamWConfig config{0.9f, 0.95f, 1e-8f, 0.1f};
  DistributedAdamW optimizer(&store, config, &world, nullptr, &buckets);
  AdamW expected(&reference, config);
  EXPECT_EQ(optimizer.holds_masters(), shard);
  EXPECT_EQ(store.fp32_released(), shard);
  if (shard) {
    // Masters and moments: 12 bytes per owned element (kept ones: 8); the store keeps 8 + 1 fp32 values.
    const int64_t kept = 7 + 1;
    EXPECT_EQ(store.params().numel(), kept);
    int64_t owned = 0;
    for (auto [lo, hi] : optimizer.owned_ranges()) owned += hi - lo;
    EXPECT_EQ(optimizer.state_bytes(), 2 * owned * 4 + optimizer.master_numel() * 4);
    EXPECT_LE(optimizer.master_numel(), owned);
    EXPECT_LT(optimizer.state_bytes(), 3 * n * 4 / world.size() + 3 * 4 * kSmallBucket);
    // A parameter whose fp32 weights went to the optimizer is refused by name.
    try {
      (void)store.param(store.find("layer.0.w"));
      ADD_FAILURE() << "released fp32 weights read";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("'layer.0.w'"), std::string::npos) << e.what();
    }
  }
  auto close = [](float got, float want) {
    return std::abs(got - want) <= 1e-6f * std::max(1.0f, std::abs(want));
  };
  for (int step = 1; step <= 4; ++step) {
    backward(store, buckets, world.rank(), step);
    const auto summed = testing::summed_toy_grads(world.size(), step, n, [](int r) { return r; });
    std::memcpy(reference.grads().f32(), summed.data(), n * sizeof(float));
    const double want_norm = std::sqrt(primary_sum_squares(reference, summed));
    const double norm = optimizer.grad_norm();
    ASSERT_NEAR(norm, want_norm, 1e-12 * want_norm) << "step " << step;
    const float scale = clip_coefficient(want_norm, 50.0f);
    optimizer.step(1e-2f, scale);
    expected.step(1e-2f, scale);
    const std::vector<float> weights = testing::master_weights(store, optimizer, world);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_TRUE(close(weights[i], reference.params().f32()[i]))
          << "step " << step << " element " << i << ": " << weights[i] << " vs "
          << reference.params().f32()[i];
    }
  }
  // The moments, through the checkpoint pieces (which also checks where they point).
  for (const auto& piece : optimizer.checkpoint_pieces(false)) {
    const bool first = piece.name.rfind("exp_avg.", 0) == 0;
    const std::string param = piece.name.substr(first ? 8 : 11);
    const auto& info = store.info(store.find(param));
    const float* want = (first ? expected.exp_avg() : expected.exp_avg_sq()).f32() + info.offset;
    for (int64_t i = piece.flat_begin; i < piece.flat_end; ++i)
      ASSERT_TRUE(close(piece.data[i - piece.flat_begin], want[i])) << piece.name << " element " << i;
  }
  // Every rank ends with the same fp32 weights (whole, or the kept ones), bitwise, and the same shadow, which
  // matches the masters.
  const int64_t held = store.params().numel();
  std::vector<float> all(held * world.size());
  world.all_gather(store.params().f32(), all.data(), held, comm::Type::f32).wait();
  std::vector<uint16_t> shadows(n * world.size());
  world.all_gather(store.params_bf16().bf16(), shadows.data(), n, comm::Type::bf16).wait();
  for (int r = 1; r < world.size(); ++r) {
    ASSERT_EQ(std::memcmp(all.data(), all.data() + r * held, held * sizeof(float)), 0) << "rank " << r;
    ASSERT_EQ(std::memcmp(shadows.data(), shadows.data() + r * n, n * sizeof(uint16_t)), 0) << "rank " << r;
  }
  const std::vector<float> weights = testing::master_weights(store, optimizer, world);
  for (int64_t i = 0; i < n; ++i)
    ASSERT_EQ(store.params_bf16().bf16()[i], f32_to_bf16_bits(weights[i])) << "element " << i;
  EXPECT_EQ(optimizer.steps_taken(), 4);
}

INSTANTIATE_TEST_SUITE_P(ZeroOrNot, Steps, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "sharded" : "unsharded"; });

class Norm : public ::testing::TestWithParam<bool> {};

// dp x model-parallel: ranks pair up into model-parallel groups holding different parts of the model (their
// gradients differ), and the replicated copy is primary on model-parallel rank 0 only. The norm counts every
// element of the model once.
TEST_P(Norm, CountsEachElementOfTheModelOnce) {
  const bool shard = GetParam();
  comm::Communicator& world = comm::world();
  if (world.size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
  const int mp_rank = world.rank() % 2, dp_rank = world.rank() / 2, dp_size = world.size() / 2;
  auto dp = world.split(mp_rank, dp_rank, "dp");
  auto mp = world.split(dp_rank, mp_rank, "mp");
  ASSERT_EQ(dp->size(), dp_size);
  ParameterStore store;
  testing::build_toy_store(store, false, /*replica_primary=*/mp_rank == 0);
  GradBuckets buckets(&store, dp.get(), {kSmallBucket, shard, true});
  DistributedAdamW optimizer(&store, AdamWConfig{}, dp.get(), mp.get(), &buckets);
  backward(store, buckets, world.rank(), 3);
  const double norm = optimizer.grad_norm();

  double want = 0;
  for (int m = 0; m < 2; ++m) {
    ParameterStore part;
    testing::build_toy_store(part, false, m == 0);
    const auto summed = testing::summed_toy_grads(dp_size, 3, part.numel(), [m](int d) { return d * 2 + m; });
    want += primary_sum_squares(part, summed);
  }
  want = std::sqrt(want);
  EXPECT_NEAR(norm, want, 1e-12 * want);
  // The same value on every rank (the clipping coefficient must agree).
  EXPECT_EQ(comm::all_reduce_max(world, norm), norm);
  EXPECT_EQ(-comm::all_reduce_max(world, -norm), norm);
}

INSTANTIATE_TEST_SUITE_P(ZeroOrNot, Norm, ::testing::Bool(),
                         [](const auto& info) { return info.param ? "sharded" : "unsharded"; });

// Across the dp ranks the saved pieces hold each primary element once (per tensor: weight, exp_avg,
// exp_avg_sq); the load pieces give every rank its whole weights, or with sharded masters (a bf16 shadow)
// each element's master to its owner alone.
TEST(DistributedAdamWMpi, CheckpointPiecesSaveEachElementOnce) {
  comm::Communicator& world = comm::world();
  for (auto [shard, shadow] : {std::pair{false, false}, {true, false}, {false, true}, {true, true}}) {
    ParameterStore store;
    build_toy_store_with_kept(store, shadow);
    const int64_t n = store.numel();
    GradBuckets buckets(&store, &world, {kSmallBucket, shard, true});
    DistributedAdamW optimizer(&store, AdamWConfig{}, &world, nullptr, &buckets);
    const bool masters = shard && shadow;
    ASSERT_EQ(optimizer.holds_masters(), masters);
    // Counts per kind (weight, exp_avg, exp_avg_sq) and flat element of the store.
    auto count = [&](const std::vector<ShardPiece>& pieces) {
      std::vector<float> counts(3 * n, 0.0f);
      for (const auto& piece : pieces) {
        const int kind = piece.name.rfind("exp_avg_sq.", 0) == 0 ? 2
                         : piece.name.rfind("exp_avg.", 0) == 0  ? 1
                                                                 : 0;
        const std::string param = kind == 0 ? piece.name : piece.name.substr(kind == 1 ? 8 : 11);
        const int id = store.find(param);
        EXPECT_GE(id, 0) << piece.name;
        if (id < 0) continue;
        for (int64_t i = piece.flat_begin; i < piece.flat_end; ++i)
          counts[kind * n + store.info(id).offset + i] += 1;
      }
      return counts;
    };
    auto saved = count(optimizer.checkpoint_pieces(true));
    comm::all_reduce_sum(world, saved.data(), 3 * n);
    const auto load = count(optimizer.checkpoint_pieces_for_load(true));
    auto loaded = load;
    comm::all_reduce_sum(world, loaded.data(), 3 * n);
    for (const auto& info : store.infos()) {
      for (int64_t i = info.offset; i < info.offset + shape_numel(info.shape); ++i) {
        for (int kind = 0; kind < 3; ++kind)
          ASSERT_EQ(saved[kind * n + i], info.shard.primary ? 1.0f : 0.0f) << info.name << " kind " << kind;
        if (masters) {
          ASSERT_EQ(loaded[i], 1.0f) << info.name;  // each master on its owner
        } else {
          ASSERT_EQ(load[i], 1.0f) << info.name;  // this rank's whole weights
        }
        for (int kind = 1; kind < 3; ++kind)
          ASSERT_EQ(loaded[kind * n + i], shard ? 1.0f : static_cast<float>(world.size())) << info.name;
      }
    }
  }
}

// Parameter groups (dense and experts), each with its own gradient buckets and ZeRO-1 shards: the optimizer
// over both groups follows the one over a store holding the same parameters as one group, bitwise (the update
// is elementwise; the norm's sum is split per group, so it agrees to rounding), and its checkpoint pieces
// still save each element once.
TEST(DistributedAdamWMpi, ParameterGroupsShardAndUpdateLikeOneGroup) {
  comm::Communicator& world = comm::world();
  auto build = [](ParameterStore& store, bool two_groups) {
    const std::string experts = two_groups ? "expert" : "dense";
    store.add("embed", {13, 7}, true, Init::normal, 0.5f);
    store.add("layer.0.w", {11, 7}, true, Init::normal, 0.5f);
    store.add("layer.0.norm", {7}, false, Init::ones);
    store.add("experts.0.w", {9, 7}, true, Init::normal, 0.5f, {}, experts);
    store.add("experts.1.w", {5, 7}, true, Init::normal, 0.5f, {}, experts);
    store.allocate(true);
    store.initialize(99);
  };
  ParameterStore grouped, single;
  build(grouped, true), build(single, false);
  const int64_t n = grouped.numel();
  ASSERT_EQ(n, single.numel());
  BucketOptions dense_options{kSmallBucket, true, true}, expert_options{kSmallBucket, true, true};
  expert_options.group = "expert";
  GradBuckets dense(&grouped, &world, dense_options), experts(&grouped, &world, expert_options);
  GradBuckets whole(&single, &world, dense_options);
  const optim::AdamWConfig config{0.9f, 0.95f, 1e-8f, 0.1f};
  DistributedAdamW two(&grouped, config, {{&dense, &world}, {&experts, &world}}, nullptr);
  DistributedAdamW one(&single, config, &world, nullptr, &whole);
  EXPECT_TRUE(two.sharded());
  for (int step = 1; step <= 3; ++step) {
    for (ParameterStore* store : {&grouped, &single}) {
      store->zero_grads();
      testing::fill_toy_grads(store->grads().f32(), world.rank(), step, 0, n);
    }
    dense.begin_step(), experts.begin_step(), whole.begin_step();
    dense.finish(), experts.finish(), whole.finish();
    const double norm_two = two.grad_norm(), norm_one = one.grad_norm();
    EXPECT_NEAR(norm_two, norm_one, 1e-12 * norm_one) << "step " << step;
    two.step(1e-2f, 1.0f), one.step(1e-2f, 1.0f);
    ASSERT_EQ(testing::master_weights(grouped, two, world), testing::master_weights(single, one, world))
        << "step " << step;
    ASSERT_EQ(std::memcmp(grouped.params_bf16().bf16(), single.params_bf16().bf16(), n * sizeof(uint16_t)),
              0);
  }
  // Each element of each moment is saved by exactly one rank.
  std::vector<double> counts(2 * n, 0.0);
  for (const auto& piece : two.checkpoint_pieces(false)) {
    const bool first = piece.name.rfind("exp_avg.", 0) == 0;
    const auto& info = grouped.info(grouped.find(piece.name.substr(first ? 8 : 11)));
    for (int64_t i = piece.flat_begin; i < piece.flat_end; ++i)
      counts[(first ? 0 : n) + info.offset + i] += 1;
  }
  comm::all_reduce_sum(world, counts.data(), static_cast<int64_t>(counts.size()));
  for (int64_t i = 0; i < 2 * n; ++i) ASSERT_EQ(counts[i], 1.0) << "moment element " << i;
  // A parameter group the optimizer was not given is refused.
  EXPECT_THROW(DistributedAdamW(&grouped, config, {{&dense, &world}}, nullptr), Error);
}

}  // namespace
}  // namespace forge::parallel::distributed_optimizer_mpi_test
