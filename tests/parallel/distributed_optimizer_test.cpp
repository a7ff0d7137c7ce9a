#include "forge/parallel/distributed_optimizer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "parallel/dp_test_util.h"

namespace forge::parallel::distributed_optimizer_test {
using namespace forge::optim;
namespace {

using testing::FakeGroup;

constexpr int64_t kSmallBucket = 160;

enum class Mode { no_buckets, unsharded, sharded };

class OneRank : public ::testing::TestWithParam<Mode> {};

// With one dp rank, the distributed optimizer is forge::optim::AdamW bitwise: weights, moments, bf16 shadow
// and gradient norm, whether it updates through buckets, unsharded or sharded.
TEST_P(OneRank, MatchesAdamWBitwise) {
  const Mode mode = GetParam();
  ParameterStore store, reference;
  testing::build_toy_store(store, true, /*replica_primary=*/true);
  testing::build_toy_store(reference, true, /*replica_primary=*/true);
  auto self = comm::make_self("dp");
  std::unique_ptr<GradBuckets> buckets;
  if (mode != Mode::no_buckets)
    buckets = std::make_unique<GradBuckets>(&store, self.get(),
                                            BucketOptions{kSmallBucket, mode == Mode::sharded, true});
  const AdamWConfig config{0.9f, 0.95f, 1e-8f, 0.1f};
  DistributedAdamW optimizer(&store, config, self.get(), nullptr, buckets.get());
  AdamW expected(&reference, config);
  EXPECT_EQ(optimizer.sharded(), mode == Mode::sharded);
  const int64_t n = store.numel();
  for (int step = 1; step <= 5; ++step) {
    testing::fill_toy_grads(reference.grads().f32(), 0, step, 0, n);
    if (buckets) buckets->begin_step();
    for (int p = store.count() - 1; p >= 0; --p) {
      const int64_t begin = store.info(p).offset, end = begin + shape_numel(store.info(p).shape);
      testing::fill_toy_grads(store.grads().f32(), 0, step, begin, end);
      if (buckets) buckets->ready_from(begin);
    }
    if (buckets) buckets->finish();
    const double norm = optimizer.grad_norm();
    ASSERT_EQ(norm, global_grad_norm(reference)) << "step " << step;
    const float scale = clip_coefficient(norm, 20.0f);
    optimizer.step(1e-2f, scale);
    expected.step(1e-2f, scale);
    ASSERT_EQ(
        std::memcmp(testing::master_weights(store, optimizer, *self).data(), reference.params().f32(), n * 4),
        0)
        << "step " << step;
    ASSERT_EQ(std::memcmp(store.params_bf16().bf16(), reference.params_bf16().bf16(), n * 2), 0);
    ASSERT_EQ(std::memcmp(optimizer.exp_avg().f32(), expected.exp_avg().f32(), n * 4), 0);
    ASSERT_EQ(std::memcmp(optimizer.exp_avg_sq().f32(), expected.exp_avg_sq().f32(), n * 4), 0);
  }
  EXPECT_EQ(optimizer.steps_taken(), 5);
  // Sharded with the bf16 shadow the optimizer holds the fp32 masters (the store none: nothing is kept).
  EXPECT_EQ(optimizer.holds_masters(), mode == Mode::sharded);
  EXPECT_EQ(optimizer.state_bytes(), (mode == Mode::sharded ? 3 : 2) * n * 4);
  EXPECT_EQ(store.params().numel(), mode == Mode::sharded ? 0 : n);
}

INSTANTIATE_TEST_SUITE_P(Modes, OneRank, ::testing::Values(Mode::no_buckets, Mode::unsharded, Mode::sharded));

// The masters move out of the store once: a second sharded optimizer over it is refused (it would take the
// kept parameters' buffer for the whole fp32 weights), with one line saying so.
TEST(DistributedAdamW, ASecondShardedOptimizerOverOneStoreIsRefused) {
  ParameterStore store;
  testing::build_toy_store(store, true);
  auto self = comm::make_self("dp");
  GradBuckets buckets(&store, self.get(), BucketOptions{kSmallBucket, true, true});
  DistributedAdamW first(&store, AdamWConfig{}, self.get(), nullptr, &buckets);
  ASSERT_TRUE(first.holds_masters());
  try {
    DistributedAdamW second(&store, AdamWConfig{}, self.get(), nullptr, &buckets);
    ADD_FAILURE() << "a second optimizer took the released store";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("already held"), std::string::npos) << e.what();
  }
}

// Offload moves a device's state to the host: over a store on the host it is refused with one line (the
// offloaded update itself runs on emulated GPUs in trainer_mpi_test).
TEST(DistributedAdamW, OffloadOfAHostStoreIsRefused) {
  ParameterStore store;
  testing::build_toy_store(store, true);
  auto self = comm::make_self("dp");
  GradBuckets buckets(&store, self.get(), BucketOptions{kSmallBucket, false, true});
  try {
    DistributedAdamW offloaded(&store, AdamWConfig{}, {{&buckets, self.get()}}, nullptr,
                               OptimizerOffload::host);
    ADD_FAILURE() << "a host store was offloaded";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("these parameters are on the host"), std::string::npos) << e.what();
  }
}

TEST(DistributedAdamW, GradNormSkipsReplicatedCopies) {
  ParameterStore store;
  testing::build_toy_store(store, false, /*replica_primary=*/false);
  auto self = comm::make_self("dp");
  DistributedAdamW optimizer(&store, AdamWConfig{}, self.get(), nullptr, nullptr);
  testing::fill_toy_grads(store.grads().f32(), 0, 1, 0, store.numel());
  const auto& replica = store.info(store.find("layer.0.replica"));
  double sum = 0;
  for (int64_t i = 0; i < store.numel(); ++i) {
    const bool in_replica = i >= replica.offset && i < replica.offset + shape_numel(replica.shape);
    if (!in_replica) sum += double(store.grads().f32()[i]) * store.grads().f32()[i];
  }
  EXPECT_NEAR(optimizer.grad_norm(), std::sqrt(sum), 1e-12 * std::sqrt(sum));
  store.grads().f32()[replica.offset] = 1e6f;
  EXPECT_NEAR(optimizer.grad_norm(), std::sqrt(sum), 1e-12 * std::sqrt(sum));
}

// Per tensor name, how many times each local element is covered by the pieces.
std::map<std::string, std::vector<int>> coverage(const ParameterStore& store,
                                                 const std::vector<ShardPiece>& pieces) {
  std::map<std::string, std::vector<int>> covered;
  for (const auto& piece : pieces) {
    std::string param = piece.name;
    for (const char* prefix : {"exp_avg_sq.", "exp_avg."})
      if (param.rfind(prefix, 0) == 0) param = param.substr(std::strlen(prefix));
    const int id = store.find(param);
    EXPECT_GE(id, 0) << piece.name;
    if (id < 0) continue;
    const auto& info = store.info(id);
    EXPECT_EQ(piece.local_shape, info.shape) << piece.name;
    EXPECT_EQ(piece.global_shape, info.global_shape()) << piece.name;
    EXPECT_EQ(piece.split_dim, info.shard.dim) << piece.name;
    EXPECT_LT(piece.flat_begin, piece.flat_end) << piece.name;
    EXPECT_LE(piece.flat_end, shape_numel(info.shape)) << piece.name;
    if (piece.name == param) {
      EXPECT_EQ(piece.data, store.params().f32() + info.offset + piece.flat_begin);
    }
    auto& counts = covered[piece.name];
    counts.resize(shape_numel(info.shape), 0);
    for (int64_t i = piece.flat_begin; i < piece.flat_end; ++i) ++counts[i];
  }
  return covered;
}

void add_coverage(std::map<std::string, std::vector<int>>& total,
                  const std::map<std::string, std::vector<int>>& c) {
  for (const auto& [name, counts] : c) {
    auto& t = total[name];
    t.resize(counts.size(), 0);
    for (size_t i = 0; i < counts.size(); ++i) t[i] += counts[i];
  }
}

// Every element of every primary tensor exactly `times` times; no replicated copy unless `replicas`.
void expect_coverage(const ParameterStore& store, const std::map<std::string, std::vector<int>>& covered,
                     bool params, bool moments, bool replicas, int times, const std::string& what) {
  size_t names = 0;
  for (const auto& info : store.infos()) {
    const bool wanted = info.shard.primary || replicas;
    std::vector<std::string> kinds;
    if (params) kinds.push_back(info.name);
    if (moments) kinds.push_back("exp_avg." + info.name), kinds.push_back("exp_avg_sq." + info.name);
    for (const auto& name : kinds) {
      auto it = covered.find(name);
      if (!wanted) {
        EXPECT_TRUE(it == covered.end()) << what << ": " << name << " saved";
        continue;
      }
      ++names;
      ASSERT_TRUE(it != covered.end()) << what << ": " << name << " missing";
      for (size_t i = 0; i < it->second.size(); ++i)
        ASSERT_EQ(it->second[i], times) << what << ": " << name << " element " << i;
    }
  }
  EXPECT_EQ(covered.size(), names) << what;
}

TEST(DistributedAdamW, CheckpointPiecesOnOneRank) {
  ParameterStore store;
  testing::build_toy_store(store, false);
  auto self = comm::make_self("dp");
  for (bool shard : {false, true}) {
    GradBuckets buckets(&store, self.get(), {kSmallBucket, shard, true});
    DistributedAdamW optimizer(&store, AdamWConfig{}, self.get(), nullptr, &buckets);
    expect_coverage(store, coverage(store, optimizer.checkpoint_pieces(true)), true, true, false, 1, "save");
    expect_coverage(store, coverage(store, optimizer.checkpoint_pieces(false)), false, true, false, 1,
                    "save moments");
    expect_coverage(store, coverage(store, optimizer.checkpoint_pieces_for_load(true)), true, true, true, 1,
                    "load");
  }
}

TEST(DistributedAdamW, CheckpointPiecesAcrossDataParallelRanks) {
  ParameterStore store;
  testing::build_toy_store(store, false);
  const int dp = 3;
  for (bool shard : {false, true}) {
    std::map<std::string, std::vector<int>> saved, loaded_moments;
    for (int r = 0; r < dp; ++r) {
      FakeGroup group(r, dp);
      GradBuckets buckets(&store, &group, {kSmallBucket, shard, true});
      DistributedAdamW optimizer(&store, AdamWConfig{}, &group, nullptr, &buckets);
      add_coverage(saved, coverage(store, optimizer.checkpoint_pieces(true)));
      // Every rank loads its whole weights; the moments where it updates.
      const auto load = coverage(store, optimizer.checkpoint_pieces_for_load(true));
      std::map<std::string, std::vector<int>> params, moments;
      for (const auto& [name, counts] : load)
        (name.rfind("exp_avg", 0) == 0 ? moments : params)[name] = counts;
      expect_coverage(store, params, true, false, true, 1, "load weights");
      add_coverage(loaded_moments, moments);
    }
    // Each element saved once: by its owner under ZeRO, by rank 0 otherwise.
    expect_coverage(store, saved, true, true, false, 1, shard ? "sharded save" : "unsharded save");
    expect_coverage(store, loaded_moments, false, true, true, shard ? 1 : dp, "load moments");
  }
}

TEST(DistributedAdamW, RejectsMismatchedBuckets) {
  ParameterStore store, other;
  testing::build_toy_store(store, false);
  testing::build_toy_store(other, false);
  FakeGroup two(0, 2), four(0, 4);
  GradBuckets buckets(&store, &two, {kSmallBucket, true, true});
  EXPECT_THROW(DistributedAdamW(&other, AdamWConfig{}, &two, nullptr, &buckets), Error);
  EXPECT_THROW(DistributedAdamW(&store, AdamWConfig{}, &four, nullptr, &buckets), Error);
}

}  // namespace
}  // namespace forge::parallel::distributed_optimizer_test
