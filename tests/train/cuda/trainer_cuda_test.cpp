// `forge train` with train.device = cuda against the same run on the CPU, and a GPU run interrupted and
// resumed (also under ZeRO-1): the toy run of toy_run.h (2 layers of hidden 32, head_dim 8, byte vocabulary).
// The GPU's attention rounds its tensor-core operands to bf16, which moves each loss by ~1e-3 relative at
// most (see tests/models/cuda/llama_cuda_test.cpp); the GPU kernels are deterministic, so a resumed GPU run
// repeats the uninterrupted one bit for bit. Each case runs on the GPU (skipped without one) and under the
// device emulation (device_backends.h), where the "device" runs the CPU kernels and faults on host access to
// its memory.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>

#include "device_backends.h"
#include "forge/ckpt/checkpoint.h"
#include "forge/train/trainer.h"
#include "train/toy_run.h"

namespace forge::trainer_cuda_test {
using namespace forge::optim;
using namespace forge::ckpt;
using namespace forge::train;
namespace {

namespace fs = std::filesystem;

class TrainerCuda : public DeviceBackendTest {
 protected:
  void SetUp() override {
    DeviceBackendTest::SetUp();
    if (IsSkipped()) return;
    dir_ = toy::fresh_test_dir("forge_trainer_cuda_test");
    toy::write_toy_run_inputs(dir_);
  }
  void TearDown() override {
    if (!dir_.empty()) fs::remove_all(dir_);
    DeviceBackendTest::TearDown();
  }
  TrainConfig config(const std::string& run, const char* device) const {
    TrainConfig c = toy::toy_run_config(dir_, run);
    c.train.device = device;
    c.train.dtype = "bf16";
    return c;
  }
  fs::path dir_;
};

TEST_P(TrainerCuda, FollowsTheCpuRunAndSamples) {
  TrainConfig gpu = config("gpu", "cuda"), cpu = config("cpu", "cpu");
  gpu.sample.tokens = cpu.sample.tokens = 8;
  const TrainResult g = Trainer(gpu).run(), c = Trainer(cpu).run();
  ASSERT_EQ(g.losses.size(), c.losses.size());
  for (size_t i = 0; i < g.losses.size(); ++i)
    EXPECT_NEAR(g.losses[i], c.losses[i], 2e-3 * c.losses[i]) << "step " << i;
  EXPECT_NEAR(g.heldout_loss, c.heldout_loss, 2e-3 * c.heldout_loss);
  EXPECT_EQ(g.sample.size(), c.sample.size());  // generated on the GPU, through its KV cache
}

TEST_P(TrainerCuda, ResumedRunRepeatsTheLossesBitwise) {
  const TrainResult full = Trainer(config("straight", "cuda")).run();
  TrainConfig split = config("split", "cuda");
  Trainer first(split);
  first.on_step([](int64_t step) {
    if (step == 3) Trainer::stop_flag() = true;
  });
  const TrainResult a = first.run();
  ASSERT_TRUE(a.interrupted);
  split.checkpoint.resume = "auto";
  const TrainResult b = Trainer(split).run();
  ASSERT_EQ(b.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(b.losses[i], full.losses[3 + i]) << "step " << 3 + i;
  EXPECT_EQ(b.heldout_loss, full.heldout_loss);
}

// ZeRO-1 on one GPU: the optimizer's sharded path (device shards, bf16 refresh per bucket, checkpoint staging
// of the sharded state) with one owner of everything updates exactly as the replicated optimizer, and an
// interrupted sharded run resumes onto the same losses.
TEST_P(TrainerCuda, ShardedOptimizerOnOneGpuIsThePlainOneAndResumes) {
  const TrainResult plain = Trainer(config("plain", "cuda")).run();
  TrainConfig zero = config("zero", "cuda");
  zero.parallel.distributed_optimizer = true;
  zero.parallel.bucket_mb = 0.01;  // several buckets
  Trainer first(zero);
  first.on_step([](int64_t step) {
    if (step == 3) Trainer::stop_flag() = true;
  });
  const TrainResult a = first.run();
  ASSERT_TRUE(a.interrupted);
  ASSERT_EQ(a.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(a.losses[i], plain.losses[i]) << "step " << i;
    EXPECT_EQ(a.grad_norms[i], plain.grad_norms[i]) << "step " << i;
  }
  zero.checkpoint.resume = "auto";
  const TrainResult b = Trainer(zero).run();
  ASSERT_EQ(b.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(b.losses[i], plain.losses[3 + i]) << "step " << 3 + i;
  EXPECT_EQ(b.heldout_loss, plain.heldout_loss);
}

FORGE_INSTANTIATE_DEVICE_BACKENDS(TrainerCuda);

}  // namespace
}  // namespace forge::trainer_cuda_test
