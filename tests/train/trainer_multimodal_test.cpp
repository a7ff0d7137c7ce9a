// The trainer on image-text data: a tiny LLaVA learns captions of forge's synthetic shapes, training stages
// by train.freeze leave the frozen parts' weights untouched, an interrupted run resumes bitwise, and
// image-text misconfigurations are refused with one line.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "forge/ckpt/safetensors.h"
#include "forge/core/file_io.h"
#include "forge/models/model.h"
#include "forge/models/pretrained.h"
#include "forge/train/trainer.h"
#include "forge/train/training_data.h"
#include "train/toy_run.h"

namespace forge::trainer_multimodal_test {
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

// sample.captions: held-out images answered greedily after training. Checked against greedy decoding written
// out here the slow way (the whole prefix prefilled again for every token, from the saved checkpoint); the
// counts, the metrics.jsonl record and the checkpoint's copy of the image processor agree.
TEST_F(TrainerMultimodal, CaptionsHeldOutImagesGreedily) {
  TrainConfig c = config("captions");
  c.train.steps = 20;
  c.train.dtype = "fp32";  // the oracle below runs in fp32: greedy choices must not hinge on bf16 rounding
  c.sample.captions = 5;
  ::testing::internal::CaptureStdout();
  const TrainResult r = Trainer(c).run();
  const std::string out = ::testing::internal::GetCapturedStdout();
  ASSERT_EQ(r.captions, 5);
  EXPECT_NE(out.find("held-out captions (greedy, 5 samples"), std::string::npos) << out;

  const fs::path checkpoint = toy::latest_checkpoint(c);
  EXPECT_EQ(read_file(checkpoint / "preprocessor_config.json", "test"),
            read_file(dir_ / "shapes" / "preprocessor_config.json", "test"));
  const auto model_config = models::read_model_config(c.model.config);
  const auto model = models::load_pretrained_model(checkpoint, nn::ComputeOptions{DType::f32});
  const auto data = open_image_text_data(c, *model_config);
  std::vector<std::string> answers, references;
  int64_t exact = 0, matched = 0, total = 0;
  for (int64_t i = 0; i < 5; ++i) {
    std::vector<int32_t> ids(88), targets(88);
    std::vector<float> pixels;
    const int64_t images = data->heldout_batch_images(i, 1, ids.data(), targets.data(), pixels);
    ASSERT_EQ(images, 1);
    const auto first = std::find_if(targets.begin(), targets.end(), [](int32_t t) { return t >= 0; });
    const auto last = std::find_if(first, targets.end(), [](int32_t t) { return t < 0; });
    std::vector<int32_t> seq(ids.begin(), ids.begin() + (first - targets.begin()) + 1);
    std::string answer, reference;
    for (auto t = first; t != last; ++t) reference += static_cast<char>(*t);
    for (size_t k = 0; k < reference.size(); ++k) {
      nn::KvCache cache = model->make_cache(1);
      const Tensor logits = model->forward_cached_images(seq.data(), 1, static_cast<int64_t>(seq.size()),
                                                         cache, pixels.data(), images);
      const int64_t vocab = logits.shape().back();
      const float* row = logits.data<float>() + (logits.numel() - vocab);
      const auto best = static_cast<int32_t>(std::max_element(row, row + vocab) - row);
      seq.push_back(best);
      answer += static_cast<char>(best);
    }
    for (size_t k = 0; k < reference.size(); ++k) matched += answer[k] == reference[k];
    total += static_cast<int64_t>(reference.size()), exact += answer == reference;
    answers.push_back(answer), references.push_back(reference);
  }
  EXPECT_EQ(r.captions_exact, exact);
  EXPECT_DOUBLE_EQ(r.caption_token_accuracy, static_cast<double>(matched) / static_cast<double>(total));
  EXPECT_GT(r.caption_token_accuracy, 0.1);  // 20 steps learn some phrasing (chance: 1/260 a token)

  std::ifstream metrics(fs::path(c.log.run_dir) / "metrics.jsonl");
  std::string line;
  bool found = false;
  while (std::getline(metrics, line)) {
    const auto record = nlohmann::json::parse(line);
    if (record.value("event", "") != "captions") continue;
    found = true;
    EXPECT_EQ(record["count"], 5);
    EXPECT_EQ(record["exact"], exact);
    ASSERT_EQ(record["examples"].size(), 5u);  // every one, the misses first
    bool right_seen = false;
    for (const auto& example : record["examples"]) {
      const auto i = example["index"].get<size_t>();
      ASSERT_LT(i, 5u);
      EXPECT_EQ(example["answer"], answers[i]) << i;
      EXPECT_EQ(example["reference"], references[i]) << i;
      const bool right = answers[i] == references[i];
      EXPECT_TRUE(right || !right_seen) << "a miss after a right answer: " << i;
      right_seen = right_seen || right;
    }
  }
  EXPECT_TRUE(found);
}

// FP8 composes: the language model's Linears run the recipe, the encoder and projector stay in the GEMM
// dtype; with fp8.vision the encoder's layers (4 Linears each) and the projector (2) run it too, the patch
// embedding excepted. Either way the losses stay those of the run without FP8 to within FP8's noise.
TEST_F(TrainerMultimodal, Fp8LanguageModelTrains) {
  TrainConfig plain = config("fp8-none");
  plain.train.steps = 20;
  const TrainResult reference = Trainer(plain).run();
  for (const char* recipe : {"delayed", "block"}) {
    size_t linears[2] = {0, 0};
    for (const bool vision : {false, true}) {
      TrainConfig c = config(std::string("fp8-") + recipe + (vision ? "-vision" : ""));
      c.fp8.recipe = recipe, c.fp8.vision = vision;
      c.train.steps = 20;
      const TrainResult r = Trainer(c).run();
      ASSERT_EQ(r.losses.size(), 20u) << recipe;
      EXPECT_LT(r.losses.back(), r.losses.front() - 1.0) << recipe;
      EXPECT_TRUE(std::isfinite(r.heldout_loss)) << recipe;
      for (size_t i = 0; i < 20; ++i)
        EXPECT_NEAR(r.losses[i], reference.losses[i], 0.02 * reference.losses[i]) << recipe << " step " << i;
      EXPECT_NEAR(r.heldout_loss, reference.heldout_loss, 0.02 * reference.heldout_loss) << recipe;
      linears[vision] = r.fp8_scales.size() / 3;
    }
    if (std::string(recipe) == "delayed") {
      EXPECT_EQ(linears[0], 2u * 4u);  // the language model's 2 layers: qkv, o, gate_up, down
      EXPECT_EQ(linears[1], linears[0] + 2 * 4 + 2);
    }
  }
}

// A run resumed with fp8.vision turned on has FP8 Linears the checkpoint holds no scaling state for: they
// start from fresh amax histories (said once), the others continue theirs.
TEST_F(TrainerMultimodal, ResumesWithTheEncoderNewlyInFp8) {
  TrainConfig c = config("fp8-resume");
  c.fp8.recipe = "delayed", c.train.steps = 4;
  Trainer(c).run();
  c.fp8.vision = true, c.train.steps = 6, c.checkpoint.resume = "auto";
  ::testing::internal::CaptureStdout();
  const TrainResult r = Trainer(c).run();
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(r.losses.size(), 2u);
  EXPECT_NE(out.find("no FP8 scaling state for 10 of this run's FP8 Linears"), std::string::npos) << out;
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
  ::testing::internal::CaptureStdout();
  const TrainResult r = Trainer(c).run();
  const std::string out = ::testing::internal::GetCapturedStdout();
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
  c = toy::llava_toy_config(dir_, "bad");  // captions need image-text data
  c.data.images = "", c.data.heldout_images = "";
  c.sample.captions = 3;
  expect_error(c, "sample.captions");
}

}  // namespace
}  // namespace forge::trainer_multimodal_test
