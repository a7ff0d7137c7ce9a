// TrainState: a snapshot to host memory at step k, training on to k + n, a restore and the same n steps again
// give bitwise the losses and weights of the first time, and of a run that was never rolled back: with the
// FP8 delayed recipe's amax histories too. (The same state through a disk checkpoint is the bitwise resume of
// trainer_test.cpp; under tp x dp with ZeRO-1 both are in trainer_mpi_test.cpp.)
#include "forge/train/train_state.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "forge/train/trainer.h"
#include "train/toy_run.h"

namespace forge::train_state_test {
using namespace forge::optim;
using namespace forge::ckpt;
using namespace forge::train;
namespace {
using toy::host_weights;

class TrainStateRollback : public ::testing::TestWithParam<const char*> {};

TEST_P(TrainStateRollback, RestoreAndRetrainAreBitwiseTheFirstPass) {
  const auto dir = toy::fresh_test_dir("forge_train_state");
  toy::write_toy_run_inputs(dir);
  TrainConfig c = toy::toy_run_config(dir, "straight");
  c.train.steps = 8;
  c.fp8.recipe = GetParam();
  c.fp8.bf16_first_layers = c.fp8.bf16_last_layers = 0;  // both layers in FP8: their histories are live

  std::vector<float> straight_final;
  Trainer straight(c);
  straight.on_state([&](TrainState& s) {
    if (s.step == 8) straight_final = host_weights(s);
  });
  const TrainResult want = straight.run();

  c.log.run_dir = (dir / "rolled_back").string();
  TrainState::Snapshot at3;
  std::vector<float> first_at6, second_at6, rolled_final;
  int passes_at6 = 0;
  Trainer rolled(c);
  rolled.on_state([&](TrainState& s) {
    if (s.step == 3 && passes_at6 == 0) at3 = s.snapshot();
    if (s.step == 6 && passes_at6++ == 0) {
      first_at6 = host_weights(s);
      s.restore(at3);  // back to step 3: the loop runs steps 4..6 again
      EXPECT_EQ(s.step, 3);
      EXPECT_EQ(host_weights(s), at3.params);
    } else if (s.step == 6) {
      second_at6 = host_weights(s);
    }
    if (s.step == 8) rolled_final = host_weights(s);
  });
  const TrainResult got = rolled.run();

  ASSERT_EQ(want.losses.size(), 8u);
  ASSERT_EQ(got.losses.size(), 11u);  // 1..6, then 4..8
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(got.losses[3 + i], got.losses[6 + i]) << "step " << 4 + i << " again";
    EXPECT_EQ(got.losses[3 + i], want.losses[3 + i]) << "step " << 4 + i;
  }
  for (int i = 0; i < 8; ++i) EXPECT_EQ(got.losses[i < 6 ? i : i + 3], want.losses[i]) << "step " << i + 1;
  EXPECT_EQ(first_at6, second_at6);
  EXPECT_EQ(rolled_final, straight_final);
  EXPECT_EQ(got.fp8_scales, want.fp8_scales);
  EXPECT_EQ(got.steps_done, 8);
}

INSTANTIATE_TEST_SUITE_P(Fp8, TrainStateRollback, ::testing::Values("off", "delayed"),
                         [](const auto& info) { return std::string(info.param); });

}  // namespace
}  // namespace forge::train_state_test
