// The trainer on image-text data: a tiny LLaVA learns captions of forge's synthetic shapes, training stages
// by train.freeze leave the frozen parts' weights untouched, an interrupted run resumes bitwise, and
// image-text misconfigurations are refused with one line.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>

#include "forge/ckpt/safetensors.h"
#include "forge/models/model.h"
#include "forge/train/trainer.h"
#include "train/toy_run.h"

namespace forge {
using namespace forge::train;
namespace {
namespace fs = std::filesystem;

class TrainerMultimodal : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = toy::fresh_test_dir("forge_trainer_multimodal");
    toy::write_llava_toy_inputs(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  TrainConfig config(const std::string& run) const { return toy::llava_toy_config(dir_, run); }
  fs::path dir_;
};

TEST_F(TrainerMultimodal, CaptionLossFallsAndIsEvaluatedOnHeldOutImages) {
  TrainConfig c = config("learn");
  c.train.steps = 30;
  const TrainResult r = Trainer(c).run();
  ASSERT_EQ(r.losses.size(), 30u);
  EXPECT_LT(r.losses.back(), r.losses.front() - 1.0);  // ln(260) = 5.56 at the start
  EXPECT_GT(r.heldout_loss, 0);
  EXPECT_LT(r.heldout_loss, r.losses.front());
}

// FP8 composes: the language model's Linears run the recipe, the encoder and projector stay in the GEMM
// dtype.
TEST_F(TrainerMultimodal, Fp8LanguageModelTrains) {
  for (const char* recipe : {"delayed", "block"}) {
    TrainConfig c = config(std::string("fp8-") + recipe);
    c.fp8.recipe = recipe;
    c.train.steps = 20;
    const TrainResult r = Trainer(c).run();
    ASSERT_EQ(r.losses.size(), 20u) << recipe;
    EXPECT_LT(r.losses.back(), r.losses.front() - 1.0) << recipe;
    EXPECT_TRUE(std::isfinite(r.heldout_loss)) << recipe;
  }
}

// LLaVA's first stage: only the projector trains. Every encoder and language-model weight of the final
// checkpoint is the initial one, bit for bit; the projector's moved.
TEST_F(TrainerMultimodal, FrozenPartsKeepTheirWeights) {
  TrainConfig c = config("stage1");
  c.train.freeze = "vision,language";
  Trainer(c).run();
  // The initial weights: initialisation depends only on (model.seed, name, element).
  const auto model_config = models::read_model_config(c.model.config);
  auto initial = models::build_model(*model_config, nn::ComputeOptions{DType::f32, nn::Recompute::none});
  initial->initialize(c.model.seed);
  auto b =
      ckpt::SafetensorsFile::open((toy::latest_checkpoint(c) / "shard-00000-of-00001.safetensors").string());
  int frozen = 0, trained = 0;
  for (const ckpt::SafetensorsEntry& entry : b.entries()) {
    const std::string& name = entry.name;
    if (name.starts_with("exp_avg")) {
      EXPECT_TRUE(name.find("multi_modal_projector.") != std::string::npos) << name;  // no state when frozen
      continue;
    }
    const Tensor x = initial->params().param(initial->params().find(name)), y = b.read(name);
    const bool same = std::memcmp(x.raw(), y.raw(), static_cast<size_t>(x.numel()) * 4) == 0;
    if (name.starts_with("multi_modal_projector.")) {
      EXPECT_FALSE(same) << name;
      ++trained;
    } else {
      EXPECT_TRUE(same) << name;
      ++frozen;
    }
  }
  EXPECT_EQ(trained, 4);
  EXPECT_GT(frozen, 20);
}

TEST_F(TrainerMultimodal, InterruptedRunResumesBitwise) {
  const TrainResult full = Trainer(config("straight")).run();
  TrainConfig split = config("split");
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

// A line naming a missing image stops the run with one line naming the file and line, or, with
// data.skip_bad_samples, is skipped and counted.
TEST_F(TrainerMultimodal, BadLinesStopTheRunOrAreSkipped) {
  {
    std::ofstream jsonl(dir_ / "shapes" / "train.jsonl", std::ios::app);
    jsonl << R"({"image": "images/missing.png", "caption": "a red circle"})"
          << "\n";
  }
  TrainConfig c = config("bad-line");
  try {
    Trainer(c).run();
    ADD_FAILURE() << "expected an error";
  } catch (const Error& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("train.jsonl:217"), std::string::npos) << m;
    EXPECT_NE(m.find("missing.png"), std::string::npos) << m;
  }
  c.data.skip_bad_samples = true;
  c.train.steps = 2;
  testing::internal::CaptureStdout();
  const TrainResult r = Trainer(c).run();
  const std::string out = testing::internal::GetCapturedStdout();
  EXPECT_EQ(r.losses.size(), 2u);
  EXPECT_NE(out.find("skipped 1 bad"), std::string::npos) << out;
}

TEST_F(TrainerMultimodal, RefusesMisconfigurationsWithOneLine) {
  auto expect_error = [](TrainConfig c, const std::string& culprit) {
    try {
      Trainer(c).run();
      ADD_FAILURE() << "expected an error naming " << culprit;
    } catch (const Error& e) {
      const std::string m = e.what();
      EXPECT_NE(m.find(culprit), std::string::npos) << m;
      EXPECT_EQ(m.find('\n'), std::string::npos) << m;
    }
  };
  TrainConfig c = config("bad");
  c.data.images = (dir_ / "missing.jsonl").string();
  expect_error(c, "missing.jsonl");
  c = config("bad");
  c.data.seq_len = 3;  // not even the 4 image tokens fit
  expect_error(c, "train.jsonl");
  c = config("bad");
  c.train.freeze = "encoder";
  expect_error(c, "train.freeze");
  c = config("bad");
  c.data.tokenizer = "train";
  expect_error(c, "data.tokenizer");
  c = config("bad");
  c.data.image_processor = (dir_ / "nope.json").string();
  expect_error(c, "nope.json");
}

}  // namespace
}  // namespace forge
