// FP8 training end to end on the toy model: every recipe learns and stays near the bf16 run, the delayed
// recipe's scaling state survives a checkpoint (bitwise-identical resume), inputs saved in FP8 lower the
// activation memory, a checkpoint of an FP8 run loads for inference, and bad [fp8] settings are refused.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>

#include "forge/ckpt/checkpoint.h"
#include "forge/ckpt/sharded.h"
#include "forge/models/pretrained.h"
#include "forge/train/train_state.h"
#include "forge/train/trainer.h"
#include "train/toy_run.h"

namespace forge::trainer_fp8_test {
using namespace forge::optim;
using namespace forge::models;
using namespace forge::ckpt;
using namespace forge::train;
namespace {
namespace fs = std::filesystem;

class TrainerFp8 : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = toy::fresh_test_dir("forge_trainer_fp8_test");
    toy::write_toy_run_inputs(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  // 30 steps of the toy run in bf16, FP8 per `recipe` ("off" = bf16 only).
  TrainConfig config(const std::string& run, const std::string& recipe) const {
    TrainConfig c = toy::toy_run_config(dir_, run);
    c.train.dtype = "bf16";
    c.train.steps = 30;
    c.train.warmup = 5;
    c.fp8.recipe = recipe;
    c.fp8.amax_history_len = 16;
    return c;
  }
  fs::path dir_;
};

TEST_F(TrainerFp8, EveryRecipeLearnsAndStaysNearBf16) {
  const TrainResult bf16 = Trainer(config("bf16", "off")).run();
  ASSERT_EQ(bf16.losses.size(), 30u);
  for (const char* recipe : {"delayed", "current", "block"}) {
    SCOPED_TRACE(recipe);
    const TrainResult r = Trainer(config(recipe, recipe)).run();
    ASSERT_EQ(r.losses.size(), 30u);
    EXPECT_LT(r.losses.back(), 0.6 * r.losses.front());  // it learns
    // Near the bf16 run, but not equal to it: the GEMMs really ran in FP8.
    EXPECT_NE(r.losses[5], bf16.losses[5]);
    EXPECT_LT(std::fabs(r.heldout_loss - bf16.heldout_loss) / bf16.heldout_loss, 0.03)
        << r.heldout_loss << " vs " << bf16.heldout_loss;
  }
}

TEST_F(TrainerFp8, DelayedScalingStateSurvivesACheckpoint) {
  TrainConfig straight = config("straight", "delayed");
  straight.train.steps = 8;
  const TrainResult full = Trainer(straight).run();

  TrainConfig split = config("split", "delayed");
  split.train.steps = 8;
  Trainer first(split);
  first.on_step([](int64_t step) {
    if (step == 4) Trainer::stop_flag() = true;
  });
  const TrainResult a = first.run();
  ASSERT_TRUE(a.interrupted);
  const std::vector<std::string> names =
      checkpoint_tensor_names((fs::path(split.log.run_dir) / "checkpoint").string());
  // Saved per FP8 Linear, under its name, so that another pipeline layout can load it.
  int histories = 0;
  for (const std::string& n : names) {
    if (!n.starts_with("fp8.") || !n.ends_with(".amax_history")) continue;
    ++histories;
    const std::string scales = n.substr(0, n.size() - std::string(".amax_history").size()) + ".scales";
    EXPECT_TRUE(std::binary_search(names.begin(), names.end(), scales)) << scales;
  }
  EXPECT_GT(histories, 0);
  EXPECT_TRUE(
      std::binary_search(names.begin(), names.end(), "fp8.model.layers.1.mlp.down_proj.weight.amax_history"));
  EXPECT_EQ(TrainState::fp8_format_of(names), TrainState::Fp8Format::by_linear);
  EXPECT_EQ(TrainState::fp8_format_of({"fp8.amax_history", "fp8.scales", "model.norm.weight"}),
            TrainState::Fp8Format::whole);  // the format of older checkpoints
  EXPECT_EQ(TrainState::fp8_format_of({"model.norm.weight"}), TrainState::Fp8Format::none);
  // Resumed, the scales are those of the uninterrupted run (fresh ones would start at 1 and differ).
  split.checkpoint.resume = "auto";
  const TrainResult b = Trainer(split).run();
  ASSERT_EQ(b.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(b.losses[i], full.losses[4 + i]) << "step " << 5 + i;
  EXPECT_EQ(b.heldout_loss, full.heldout_loss);
}

TEST_F(TrainerFp8, ResumingABf16CheckpointUnderFp8StartsFreshScales) {
  TrainConfig c = config("mixed", "off");
  c.train.steps = 4;
  Trainer(c).run();
  c.train.steps = 8;
  c.fp8.recipe = "delayed";
  c.checkpoint.resume = "auto";
  const TrainResult r = Trainer(c).run();
  EXPECT_EQ(r.losses.size(), 4u);
  EXPECT_TRUE(std::isfinite(r.heldout_loss));
}

TEST_F(TrainerFp8, InputsSavedInFp8LowerActivationMemory) {
  auto peak = [&](const std::string& run, const std::string& recipe, bool save_fp8) {
    TrainConfig c = config(run, recipe);
    c.train.steps = 1;
    c.fp8.save_fp8_inputs = save_fp8;
    // Like for like: the FP8 Linears' inputs against bf16 ones, every other activation fp32 in all three
    // (an FP8 MLP keeps fp32 activations so far; a bf16 one would halve its gate|up as well).
    c.train.activation_dtype = "fp32";
    return Trainer(c).run().peak_activation_bytes;
  };
  const int64_t bf16 = peak("bf16", "off", true);
  const int64_t fp8_saved = peak("fp8", "current", true);
  const int64_t bf16_saved = peak("fp8_high", "current", false);
  // The four Linear inputs of each layer drop from 2 bytes per element to 1.
  EXPECT_LT(fp8_saved, bf16);
  EXPECT_LT(fp8_saved, bf16_saved);
}

TEST_F(TrainerFp8, CheckpointOfAnFp8RunLoadsForInference) {
  TrainConfig c = config("infer", "block");
  c.train.steps = 3;
  Trainer(c).run();
  auto model = load_pretrained_model(fs::path(c.log.run_dir) / "checkpoint", nn::ComputeOptions{});
  EXPECT_EQ(model->config().shape().layers, 2);
}

TEST_F(TrainerFp8, Bf16LayersAtBothEndsAndAccumulatorEmulationRun) {
  TrainConfig c = config("ends", "delayed");
  c.train.steps = 4;
  c.fp8.bf16_first_layers = 1;  // layer 0 in bf16, layer 1 in FP8
  c.fp8.accumulator_bits = 14;
  c.fp8.promote_every = 128;
  const TrainResult r = Trainer(c).run();
  EXPECT_EQ(r.losses.size(), 4u);
  EXPECT_TRUE(std::isfinite(r.heldout_loss));
  // Only layer 1's four Linears (q|k|v, o, gate|up, down) are in FP8, each with three scaled operands.
  EXPECT_EQ(r.fp8_scales.size(), 4u * 3);
  c.fp8.bf16_first_layers = 0;
  c.log.run_dir = (dir_ / "all").string();
  EXPECT_EQ(Trainer(c).run().fp8_scales.size(), 2u * 4 * 3);
}

TEST_F(TrainerFp8, RefusesSettingsThatLeaveNoLayerInFp8) {
  TrainConfig c = config("none", "current");
  c.fp8.bf16_first_layers = 1;
  c.fp8.bf16_last_layers = 1;
  try {
    Trainer(c).run();
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("keep all 2 layers out of FP8"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace forge::trainer_fp8_test
