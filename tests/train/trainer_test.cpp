// Trainer behaviour on a toy model and corpus: bitwise-exact resume after an interruption (the Ctrl-C
// path: stop flag, checkpoint, exit), learning, and refused inputs.
#include "forge/train/trainer.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "forge/ckpt/checkpoint.h"
#include "forge/core/device.h"
#include "forge/kernels/profiler.h"
#include "test_files.h"
#include "train/toy_run.h"

namespace forge::trainer_test {
using namespace forge::optim;
using namespace forge::ckpt;
using namespace forge::train;
namespace {
using testing::read_file;
namespace fs = std::filesystem;

class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = toy::fresh_test_dir("forge_trainer_test");
    toy::write_toy_run_inputs(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  TrainConfig config(const std::string& run) const { return toy::toy_run_config(dir_, run); }
  fs::path dir_;
};

class TrainerResume : public TrainerTest, public ::testing::WithParamInterface<const char*> {};

// The parameter: the GEMM dtype, and "+dropout" for hidden dropout (whose masks follow the samples, so a
// resumed run draws the ones the uninterrupted run drew).
TEST_P(TrainerResume, InterruptedRunResumesTheIdenticalLossSequenceBitwise) {
  const std::string param = GetParam();
  const std::string dtype = param.substr(0, param.find('+'));
  const double dropout = param.find("+dropout") != std::string::npos ? 0.2 : 0.0;
  TrainConfig straight = config("straight");
  straight.train.dtype = dtype;
  straight.train.hidden_dropout = dropout;
  TrainResult full = Trainer(straight).run();
  ASSERT_EQ(full.losses.size(), 6u);
  EXPECT_FALSE(full.interrupted);

  // The same run interrupted after step 3 (as Ctrl-C does: stop flag, checkpoint, return) ...
  TrainConfig split = config("split");
  split.train.dtype = dtype;
  split.train.hidden_dropout = dropout;
  Trainer first(split);
  first.on_step([](int64_t step) {
    if (step == 3) Trainer::stop_flag() = true;
  });
  TrainResult a = first.run();
  EXPECT_TRUE(a.interrupted);
  ASSERT_EQ(a.losses.size(), 3u);
  ASSERT_TRUE(checkpoint_exists((fs::path(split.log.run_dir) / "checkpoint").string()));
  EXPECT_EQ(read_checkpoint_manifest((fs::path(split.log.run_dir) / "checkpoint").string()).step, 3);

  // ... and resumed: steps 4..6 repeat the uninterrupted run's losses and weights bit for bit.
  split.checkpoint.resume = "auto";
  TrainResult b = Trainer(split).run();
  ASSERT_EQ(b.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(a.losses[i], full.losses[i]) << "step " << i;
    EXPECT_EQ(b.losses[i], full.losses[3 + i]) << "step " << 3 + i;
  }
  EXPECT_EQ(b.steps_done, 6);
  EXPECT_EQ(b.heldout_loss, full.heldout_loss);
  EXPECT_EQ(read_file(toy::latest_checkpoint(split) / "shard-00000-of-00001.safetensors"),
            read_file(toy::latest_checkpoint(straight) / "shard-00000-of-00001.safetensors"));
}

INSTANTIATE_TEST_SUITE_P(Dtypes, TrainerResume, ::testing::Values("fp32", "bf16", "fp32+dropout"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::replace(name.begin(), name.end(), '+', '_');
                           return name;
                         });

// Hidden dropout acts in training steps (the first step's loss differs from the run without it) and not in
// evaluation: the held-out loss of the same weights, evaluated by a run that trains no step, is the one a
// run without dropout computes.
TEST_F(TrainerTest, HiddenDropoutActsInTrainingNotInEvaluation) {
  TrainConfig plain = config("plain"), dropped = config("dropped");
  dropped.train.hidden_dropout = 0.2;
  const TrainResult a = Trainer(plain).run(), b = Trainer(dropped).run();
  ASSERT_FALSE(a.losses.empty());
  ASSERT_FALSE(b.losses.empty());
  EXPECT_NE(a.losses[0], b.losses[0]);
  // Both evaluate the dropout run's final weights.
  TrainConfig eval_plain = config("eval-plain"), eval_dropped = config("eval-dropped");
  for (TrainConfig* c : {&eval_plain, &eval_dropped}) {
    c->checkpoint.resume = (fs::path(dropped.log.run_dir) / "checkpoint").string();
    c->checkpoint.overwrite = true;
  }
  eval_dropped.train.hidden_dropout = 0.2;
  const TrainResult pe = Trainer(eval_plain).run(), de = Trainer(eval_dropped).run();
  EXPECT_TRUE(pe.losses.empty());
  EXPECT_EQ(pe.heldout_loss, de.heldout_loss);
  EXPECT_EQ(pe.heldout_loss, b.heldout_loss);
}

TEST_F(TrainerTest, LossFallsAndMetricsAreWritten) {
  TrainConfig c = config("learn");
  c.train.steps = 40;
  c.train.warmup = 5;
  c.log.every = 10;
  c.sample.tokens = 20;
  c.sample.prompt = "In the";
  TrainResult r = Trainer(c).run();
  ASSERT_EQ(r.losses.size(), 40u);
  EXPECT_LT(r.losses.back(), r.losses.front() - 1.0);
  EXPECT_GT(r.heldout_bits_per_byte, 0);
  EXPECT_EQ(r.sample.size(), 6u + 20u);
  std::ifstream metrics(fs::path(c.log.run_dir) / "metrics.jsonl");
  int lines = 0;
  for (std::string line; std::getline(metrics, line);) {
    ++lines;
    EXPECT_NE(line.find("\"step\""), std::string::npos);
  }
  EXPECT_GE(lines, 5);  // steps 1, 10, 20, 30, 40 and the final evaluation
  EXPECT_TRUE(fs::exists(fs::path(c.log.run_dir) / "config.toml"));
}

// log.profile_step times that step's ops into <run_dir>/profile.json without changing a single bit of
// training.
TEST_F(TrainerTest, ProfileStepWritesTheStepsOpsAndChangesNothing) {
  const TrainResult plain = Trainer(config("plain")).run();
  TrainConfig c = config("profiled");
  c.log.profile_step = 3;
  const TrainResult profiled = Trainer(c).run();
  EXPECT_EQ(profiled.losses, plain.losses);
  EXPECT_FALSE(ops::profiling());
  const nlohmann::json j = nlohmann::json::parse(read_file(fs::path(c.log.run_dir) / "profile.json"));
  EXPECT_EQ(j["device"], "cpu");
  int64_t gemms = 0;
  for (const auto& row : j["rows"])
    if (row["op"] == "gemm") gemms += row["calls"].get<int64_t>();
  EXPECT_EQ(gemms, 12 * 2 * 2);  // 12 per layer and micro-batch; 2 layers, grad_accum 2
  EXPECT_GT(j["wall_seconds"].get<double>(), 0);
  EXPECT_FALSE(fs::exists(fs::path(config("plain").log.run_dir) / "profile.json"));
}

// steps = 0 with a time budget: the schedule length is planned from the first steps' speed and the
// run completes that plan (its LR reaches the end of the decay) inside the budget.
TEST_F(TrainerTest, TimeBudgetPlansTheScheduleLength) {
  TrainConfig c = config("budget");
  c.train.steps = 0;
  c.train.max_minutes = 0.05;  // 3 seconds
  c.train.warmup = 5;
  TrainResult r = Trainer(c).run();
  EXPECT_FALSE(r.interrupted);
  EXPECT_GE(r.steps_done, 3);  // planning starts after 3 steps; a slow machine plans few
  EXPECT_EQ(static_cast<int64_t>(r.losses.size()), r.steps_done);
  CheckpointState state = read_checkpoint_manifest((fs::path(c.log.run_dir) / "checkpoint").string());
  // The plan keeps 3% in reserve; only a machine that slows down sharply mid-run hits the hard limit.
  if (!r.time_limit_reached) {
    EXPECT_EQ(state.extra.at("planned_steps").get<int64_t>(), r.steps_done);
  }
  EXPECT_GE(state.extra.at("planned_steps").get<int64_t>(), r.steps_done);
}

TEST_F(TrainerTest, RefusesBadInputsWithOneClearLine) {
  auto expect_error = [](TrainConfig c, const std::string& culprit) {
    try {
      Trainer(c).run();
      ADD_FAILURE() << "expected an error naming " << culprit;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(culprit), std::string::npos) << e.what();
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    }
  };
  TrainConfig missing_corpus = config("bad1");
  missing_corpus.data.corpus = (dir_ / "nope.txt").string();
  expect_error(missing_corpus, "nope.txt");
  TrainConfig missing_model = config("bad2");
  missing_model.model.config = (dir_ / "absent.json").string();
  expect_error(missing_model, "absent.json");
  TrainConfig long_seq = config("bad3");
  long_seq.data.seq_len = 128;  // > max_position_embeddings 64
  expect_error(long_seq, "max_position_embeddings");
  TrainConfig bad_resume = config("bad4");
  bad_resume.checkpoint.resume = (dir_ / "no_checkpoint").string();
  expect_error(bad_resume, "no_checkpoint");
  std::ofstream(dir_ / "heads.json")
      << R"({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
      "num_attention_heads": 4, "num_key_value_heads": 3, "vocab_size": 256})";
  TrainConfig heads = config("bad5");
  heads.model.config = (dir_ / "heads.json").string();
  expect_error(heads, "num_key_value_heads");
  // 2^32 + 2 layers used to train a 2-layer model; a model too big for the machine is refused before any
  // allocation (2^48 parameters: 4 PiB to train), not by bad_alloc or the OOM killer.
  std::ofstream(dir_ / "layers.json") << R"({"hidden_size": 32, "intermediate_size": 64,
      "num_hidden_layers": 4294967298, "num_attention_heads": 4, "vocab_size": 256})";
  TrainConfig layers = config("bad7");
  layers.model.config = (dir_ / "layers.json").string();
  expect_error(layers, "layers.json: key 'num_hidden_layers' is 4294967298, above forge's limit of 65536");
  std::ofstream(dir_ / "huge.json") << R"({"hidden_size": 65536, "intermediate_size": 262144,
      "num_hidden_layers": 4096, "num_attention_heads": 512, "vocab_size": 1048576})";
  TrainConfig huge = config("bad8");
  huge.model.config = (dir_ / "huge.json").string();
  // The size depends on the CPU: with native bf16 (train.dtype auto) the bf16 shadow adds to it.
  expect_error(huge, "huge.json: the model needs ");
  expect_error(huge, " PiB for its weights, gradients and optimizer state");
  // What a family does not support yet is refused by the family, not trained half-way: DeepSeek-V2's greedy
  // top-k (DeepSeek-V3 routes noaux_tc).
  TrainConfig deepseek = config("bad9");
  toy::write_toy_deepseek_config(dir_);
  {
    std::ifstream in(dir_ / "deepseek.json");
    nlohmann::json greedy = nlohmann::json::parse(in);
    greedy["topk_method"] = "greedy", greedy["n_group"] = 1, greedy["topk_group"] = 1;
    std::ofstream(dir_ / "greedy.json") << greedy.dump();
  }
  deepseek.model.config = (dir_ / "greedy.json").string();
  expect_error(deepseek, "topk_method 'greedy' is not supported yet");
  if (!device_usable(Device::cuda)) {  // no GPU here: a CUDA run is refused up front, naming the key
    TrainConfig gpu = config("bad6");
    gpu.train.device = "cuda";
    expect_error(gpu, "train.device = cuda, but no GPU is usable here");
  }
}

TEST_F(TrainerTest, IncompleteCheckpointIsRefused) {
  TrainConfig c = config("incomplete");
  c.train.steps = 2;
  Trainer(c).run();
  const fs::path ckpt = toy::latest_checkpoint(c);
  // Corrupt one shard: the manifest's checksum catches it.
  {
    std::fstream f(ckpt / "shard-00000-of-00001.safetensors",
                   std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-4, std::ios::end);
    f.write("\x01\x02\x03\x04", 4);
  }
  TrainConfig resume = c;
  resume.checkpoint.resume = ckpt.string();
  resume.log.run_dir = (dir_ / "elsewhere").string();
  EXPECT_THROW(Trainer(resume).run(), Error);
  // Without a manifest the checkpoint reads as incomplete.
  fs::remove(ckpt / "manifest.json");
  try {
    Trainer(resume).run();
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("incomplete"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace forge::trainer_test
