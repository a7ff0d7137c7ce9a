// Resilience across ranks (docs/resilience.md), under mpirun with 2 and 4 ranks (tensor x data parallel, with
// ZeRO-1): an anomaly on one rank is everyone's verdict in the same step; a transient one rolls every rank
// back and the run ends bit for bit on the clean run (same layout) that skips the same window; a persistent
// one stops every rank with the same line naming the rank; asynchronous checkpoints commit only once every
// rank's shard is written and are byte-identical to synchronous ones.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "forge/ckpt/checkpoint.h"
#include "forge/ckpt/checkpoint_dir.h"
#include "forge/comm/comm.h"
#include "forge/core/error.h"
#include "forge/kernels/emulated_device.h"
#include "forge/train/device_emulation.h"
#include "forge/train/train_state.h"
#include "forge/train/trainer.h"
#include "test_files.h"
#include "train/toy_run.h"

namespace forge::resilience_mpi_test {
using namespace forge::ckpt;
using namespace forge::train;
namespace {
using testing::read_file;
using toy::host_weights;
namespace fs = std::filesystem;

// What a clean run does to skip the samples of steps s.step + 1 .. to: step s.step + 1 reads the samples
// step to + 1 would have.
void skip_to(TrainState& s, int64_t to) {
  const int64_t resume_at = s.first_sample_of(to);
  s.base_step = s.step;
  s.base_samples = resume_at;
}

class ResilienceRuns : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = toy::make_shared_test_dir(comm::world(), "forge_resilience_mpi"); }
  void TearDown() override { toy::remove_shared_test_dir(comm::world(), dir_); }
  // tp 2 x dp (world / 2) with ZeRO-1, 8 steps, a snapshot every 2.
  TrainConfig config(const std::string& run) const {
    TrainConfig c = toy::toy_run_config(dir_, run);
    c.data.seq_len = 16;
    c.train.dtype = "fp32";
    c.train.steps = 8;
    c.parallel.tp = 2;
    c.parallel.distributed_optimizer = true;
    c.parallel.bucket_mb = 0.01;
    c.parallel.make_vocab_size_divisible_by = 48;
    c.parallel.timeout_s = 60;
    c.resilience.snapshot_every = 2;
    return c;
  }
  // This rank's final weights (its shards), with an optional hook on the state after each step.
  std::vector<float> final_weights(const TrainConfig& c, TrainResult* result = nullptr,
                                   std::function<void(TrainState&)> on_state = {}) {
    std::vector<float> final;
    Trainer t(c, &comm::world());
    t.on_state([&](TrainState& s) {
      if (on_state) on_state(s);
      if (s.step == c.train.steps) final = host_weights(s);
    });
    const TrainResult r = t.run();
    if (result) *result = r;
    return final;
  }
  fs::path dir_;
};

// A NaN in the loss of the last rank only, at step 5: every rank rolls back to step 4 and skips step 5's
// samples, and ends bitwise on the clean run skipping them; the spike on rank 1 alone likewise (its tp peer
// never sees it: the verdict is agreed).
TEST_F(ResilienceRuns, AnomalyOnOneRankRollsEveryRankBackToTheCleanRunThatSkips) {
  comm::Communicator& world = comm::world();
  const std::vector<float> clean = final_weights(config("clean"), nullptr, [](TrainState& s) {
    if (s.step == 4) skip_to(s, 5);
  });
  TrainConfig c = config("nan");
  c.resilience.inject = "nan_loss step=5 rank=" + std::to_string(world.size() - 1);
  TrainResult got;
  EXPECT_EQ(final_weights(c, &got), clean);
  EXPECT_EQ(got.rollbacks, 1);

  TrainConfig spike = config("spike");
  spike.resilience.window = 10;
  spike.resilience.spike_after = 0;
  spike.resilience.loss_spike = 1.5;
  // Ten accepted steps are needed before spikes are judged: a 16-step run with the spike at step 13.
  spike.train.steps = 16;
  spike.resilience.inject = "spike step=13 rank=1";
  TrainConfig clean16 = config("clean16");
  clean16.train.steps = 16;
  const std::vector<float> want = final_weights(clean16, nullptr, [](TrainState& s) {
    if (s.step == 12) skip_to(s, 13);
  });
  EXPECT_EQ(final_weights(spike, &got), want);
  EXPECT_EQ(got.rollbacks, 1);
}

// Reading the step's data fails on one rank only: every rank refuses the step (none is left waiting in its
// collectives) and rolls back together, to the clean run that skips it.
TEST_F(ResilienceRuns, DataErrorOnOneRankRollsEveryRankBack) {
  comm::Communicator& world = comm::world();
  const std::vector<float> clean = final_weights(config("clean"), nullptr, [](TrainState& s) {
    if (s.step == 4) skip_to(s, 5);
  });
  TrainConfig c = config("data");
  c.resilience.inject = "data_error step=5 rank=" + std::to_string(world.size() - 1);
  TrainResult got;
  EXPECT_EQ(final_weights(c, &got), clean);
  EXPECT_EQ(got.rollbacks, 1);
}

// skip = none: the rollback replays the same samples, and the run ends bitwise on the uninterrupted one.
TEST_F(ResilienceRuns, ReplayingTheWindowEqualsTheUninterruptedRun) {
  const std::vector<float> straight = final_weights(config("straight"));
  TrainConfig c = config("replay");
  c.resilience.skip = "none";
  c.resilience.inject = "nan_loss step=5 rank=1";
  EXPECT_EQ(final_weights(c), straight);
}

// A persistent NaN gradient on one rank: every rank stops at the same step with the same line, naming it.
TEST_F(ResilienceRuns, PersistentNanOnOneRankStopsEveryRankNamingIt) {
  comm::Communicator& world = comm::world();
  TrainConfig c = config("persistent");
  c.resilience.max_retries = 1;
  const int bad = world.size() - 1;
  c.resilience.inject = "nan_grad step=3 times=0 rank=" + std::to_string(bad);
  std::string error;
  try {
    Trainer(c, &world).run();
  } catch (const Error& e) {
    error = e.what();
  }
  EXPECT_NE(error.find("step 3:"), std::string::npos) << error;
  EXPECT_NE(error.find("first on rank " + std::to_string(bad) + ": gradient of"), std::string::npos) << error;
  EXPECT_NE(error.find("1 rollbacks in a row did not get past it"), std::string::npos) << error;
  // Every rank says the same.
  const std::vector<std::string> all = comm::all_gather_strings(world, error);
  for (const std::string& e : all) EXPECT_EQ(e, all[0]);
}

// Background saves under tp x dp: the same bytes as synchronous saves, every step, every rank's shard.
TEST_F(ResilienceRuns, AsynchronousCheckpointsMatchSynchronousOnesOnEveryRank) {
  comm::Communicator& world = comm::world();
  TrainConfig sync = config("sync");
  sync.checkpoint.every = 1, sync.checkpoint.keep_last = 0, sync.checkpoint.async = false;
  TrainConfig async = config("async");
  async.checkpoint.every = 1, async.checkpoint.keep_last = 0;
  EXPECT_EQ(final_weights(sync), final_weights(async));
  world.barrier().wait();
  const std::string shard = shard_file_name(world.rank(), world.size());
  for (int step = 1; step <= 8; ++step) {
    const fs::path a = sync.checkpoint_dir() / checkpoint_step_name(step),
                   b = async.checkpoint_dir() / checkpoint_step_name(step);
    ASSERT_TRUE(fs::exists(b / "manifest.json")) << b;
    EXPECT_EQ(read_file(a / shard), read_file(b / shard)) << step;
  }
}

// On (emulated) GPUs: the snapshot is staged to host memory and restored to the devices, and a background
// save copies the state to the host at the save (AsyncCheckpointSave::Source::copy). A rollback still ends
// bitwise on the clean run that skips the window, and background saves write the same bytes as synchronous
// ones. Data parallel with ZeRO-1 over every rank, one (emulated) device each.
TEST_F(ResilienceRuns, OnEmulatedGpusRollbackAndBackgroundSavesAreExact) {
  comm::Communicator& world = comm::world();
  DeviceEmulation emulation;
  auto gpu = [&](const std::string& run) {
    TrainConfig c = config(run);
    c.train.device = "cuda";
    c.parallel.tp = 1;
    return c;
  };
  const std::vector<float> clean = final_weights(gpu("clean"), nullptr, [](TrainState& s) {
    if (s.step == 4) skip_to(s, 5);
  });
  TrainConfig nan = gpu("nan");
  nan.resilience.inject = "nan_grad step=5 rank=" + std::to_string(world.size() - 1);
  TrainResult got;
  EXPECT_EQ(final_weights(nan, &got), clean);
  EXPECT_EQ(got.rollbacks, 1);

  TrainConfig sync = gpu("sync");
  sync.checkpoint.every = 1, sync.checkpoint.keep_last = 0, sync.checkpoint.async = false;
  TrainConfig async = gpu("async");
  async.checkpoint.every = 1, async.checkpoint.keep_last = 0;
  EXPECT_EQ(final_weights(sync), final_weights(async));
  world.barrier().wait();
  const std::string shard = shard_file_name(world.rank(), world.size());
  for (int step = 1; step <= 8; ++step)
    EXPECT_EQ(read_file(sync.checkpoint_dir() / checkpoint_step_name(step) / shard),
              read_file(async.checkpoint_dir() / checkpoint_step_name(step) / shard))
        << step;
  EXPECT_EQ(EmulatedDevice::live_allocations(), 0);
}

}  // namespace
}  // namespace forge::resilience_mpi_test
