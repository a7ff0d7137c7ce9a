// What the trainer does so that a run never loses its last good state (issue: checkpoint safety): a
// non-finite step is never applied or saved; resume = auto takes the newest complete checkpoint or refuses;
// a fresh run does not write over checkpoints; two runs do not share a directory; a resume compares the
// tokenizer by content and continues at the exact sample; Ctrl-C during the final evaluation still ends
// with the final checkpoint; and keep_last prunes.
#include <gtest/gtest.h>
#include <omp.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "forge/ckpt/checkpoint.h"
#include "forge/ckpt/checkpoint_dir.h"
#include "forge/core/error.h"
#include "forge/core/parameters.h"
#include "forge/data/text/indexed_dataset.h"
#include "forge/data/tokenizer/bpe_trainer.h"
#include "forge/models/llama/llama_model.h"
#include "forge/train/run_directory.h"
#include "forge/train/trainer.h"
#include "test_files.h"
#include "train/toy_run.h"

namespace forge::trainer_safety_test {
using namespace forge::optim;
using namespace forge::models;
using namespace forge::data;
using namespace forge::ckpt;
using namespace forge::train;
namespace {
using testing::read_file;
namespace fs = std::filesystem;

std::string error_of(TrainConfig c, std::function<void(Trainer&)> setup = {}) {
  try {
    Trainer t(c);
    if (setup) setup(t);
    t.run();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    return e.what();
  }
  return "";
}

class TrainerSafety : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = toy::fresh_test_dir("forge_trainer_safety");
    toy::write_toy_run_inputs(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  TrainConfig config(const std::string& run) const { return toy::toy_run_config(dir_, run); }
  fs::path dir_;
};

// A NaN in one gradient (finite loss) at step 4: the run stops naming the step, the rank and the tensor; the
// update is not applied and the checkpoint of step 3 is neither replaced nor joined by one of step 4.
TEST_F(TrainerSafety, NonFiniteGradientIsNeverAppliedNorSaved) {
  TrainConfig c = config("nan");
  c.checkpoint.every = 1;
  c.resilience.rollback = false;  // the refusal itself (rollback: resilience_test)
  c.checkpoint.keep_last = 0;
  const std::string e = error_of(c, [](Trainer& t) {
    t.on_gradients([](int64_t step, ParameterStore& params) {
      if (step == 4) params.grads().f32()[params.info(params.find("model.norm.weight")).offset] = NAN;
    });
  });
  EXPECT_NE(e.find("step 4: the gradient norm is nan"), std::string::npos) << e;
  EXPECT_NE(e.find("first on rank 0: gradient of 'model.norm.weight' (nan)"), std::string::npos) << e;
  EXPECT_NE(e.find("the update was not applied and nothing was saved"), std::string::npos) << e;
  EXPECT_NE(e.find("the last checkpoint is step 3"), std::string::npos) << e;
  const std::string root = c.checkpoint_dir().string();
  EXPECT_EQ(read_checkpoint_manifest(root).step, 3);
  EXPECT_FALSE(fs::exists(c.checkpoint_dir() / "step-00000004"));
  // The checkpoint of step 3 is the clean run's, bit for bit, and its weights are finite.
  TrainConfig clean = config("clean");
  clean.train.steps = 3;
  Trainer(clean).run();
  EXPECT_EQ(read_file(toy::latest_checkpoint(c) / "shard-00000-of-00001.safetensors"),
            read_file(toy::latest_checkpoint(clean) / "shard-00000-of-00001.safetensors"));
  const std::string metrics = read_file(fs::path(c.log.run_dir) / "metrics.jsonl");
  EXPECT_NE(metrics.find("\"event\":\"anomaly\""), std::string::npos) << metrics;

  // A non-finite loss is refused the same way, as the loss.
  TrainConfig inf = config("inf");
  inf.resilience.rollback = false;
  const std::string l = error_of(inf, [](Trainer& t) {
    t.on_gradients([](int64_t step, ParameterStore& params) {
      if (step == 2) params.grads().f32()[0] = std::numeric_limits<float>::infinity();
    });
  });
  EXPECT_NE(l.find("step 2: the gradient norm is inf"), std::string::npos) << l;
  EXPECT_NE(l.find("no checkpoint of this run was saved"), std::string::npos) << l;
}

// Shards without a manifest (a save of the old single-folder layout killed midway, or a copy cut short):
// resume = auto refuses as incomplete and leaves metrics.jsonl alone; it never starts over.
TEST_F(TrainerSafety, ResumeAutoNeverStartsOverCheckpointData) {
  TrainConfig c = config("partial");
  fs::create_directories(c.checkpoint_dir());
  std::ofstream(c.checkpoint_dir() / "shard-00000-of-00001.safetensors") << "half a shard";
  std::ofstream(fs::path(c.log.run_dir) / "metrics.jsonl") << "{\"step\": 1, \"loss\": 5.0}\n";
  c.checkpoint.resume = "auto";
  const std::string e = error_of(c);
  EXPECT_NE(e.find("is incomplete: it has no manifest.json"), std::string::npos) << e;
  EXPECT_EQ(read_file(fs::path(c.log.run_dir) / "metrics.jsonl"), "{\"step\": 1, \"loss\": 5.0}\n");
  EXPECT_TRUE(fs::exists(c.checkpoint_dir() / "shard-00000-of-00001.safetensors"));

  // Step folders none of which is complete: refused too, naming the newest.
  TrainConfig s = config("steps");
  fs::create_directories(s.checkpoint_dir() / "step-00000002");
  s.checkpoint.resume = "auto";
  const std::string f = error_of(s);
  EXPECT_NE(f.find("no step folder holds a complete checkpoint (the newest, step-00000002: it has no "
                   "manifest.json)"),
            std::string::npos)
      << f;

  // An empty directory is a fresh start; a crashed first save (a staging folder only) too.
  TrainConfig fresh = config("fresh");
  fs::create_directories(fresh.checkpoint_dir() / ".step-00000001.partial");
  fresh.checkpoint.resume = "auto";
  EXPECT_EQ(Trainer(fresh).run().steps_done, 6);
}

// The latest checkpoint damaged so that it no longer reads as complete (its manifest gone): resume = auto
// says so and continues from the newest complete one, and ends on the same weights as a straight run.
TEST_F(TrainerSafety, ResumeAutoFallsBackToTheNewestCompleteCheckpoint) {
  TrainConfig straight = config("straight");
  Trainer(straight).run();
  TrainConfig c = config("fallback");
  c.checkpoint.every = 1;
  Trainer first(c);
  first.on_step([](int64_t step) {
    if (step == 4) Trainer::stop_flag() = true;
  });
  EXPECT_TRUE(first.run().interrupted);
  fs::remove(c.checkpoint_dir() / "step-00000004" / "manifest.json");
  c.checkpoint.resume = "auto";
  ::testing::internal::CaptureStdout();
  const TrainResult r = Trainer(c).run();
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("passed over step-00000004: it has no manifest.json"), std::string::npos) << out;
  EXPECT_NE(out.find("at step 3"), std::string::npos) << out;
  EXPECT_EQ(r.losses.size(), 3u);
  EXPECT_EQ(read_file(toy::latest_checkpoint(c) / "shard-00000-of-00001.safetensors"),
            read_file(toy::latest_checkpoint(straight) / "shard-00000-of-00001.safetensors"));
  // Only the newest keep_last (3) checkpoints remain, and metrics.jsonl has each step once.
  EXPECT_FALSE(fs::exists(c.checkpoint_dir() / "step-00000003"));
  EXPECT_TRUE(fs::exists(c.checkpoint_dir() / "step-00000004"));
  EXPECT_TRUE(fs::exists(c.checkpoint_dir() / "step-00000006"));
}

// A `latest` that is not text (not valid UTF-8) is noted in one line naming the file, and the run resumes
// from the newest step folder (it used to end with a JSON library error naming no file).
TEST_F(TrainerSafety, ResumeAutoNotesALatestThatIsNotText) {
  TrainConfig c = config("latest");
  c.train.steps = 4;
  Trainer(c).run();
  std::ofstream(c.checkpoint_dir() / "latest", std::ios::binary | std::ios::trunc) << "\xff\xfe\n";
  c.train.steps = 6;
  c.checkpoint.resume = "auto";
  ::testing::internal::CaptureStdout();
  const TrainResult r = Trainer(c).run();
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find((c.checkpoint_dir() / "latest").string() + " is not text (not valid UTF-8)"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("step-00000004 at step 4"), std::string::npos) << out;
  EXPECT_EQ(r.steps_done, 6);
  const std::vector<nlohmann::json> records = [&] {
    std::vector<nlohmann::json> all;
    std::ifstream in(fs::path(c.log.run_dir) / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) all.push_back(nlohmann::json::parse(line));
    return all;
  }();
  ASSERT_FALSE(records.empty());
  EXPECT_EQ(records.back()["event"], "end");
  EXPECT_EQ(records.back()["status"], "completed");
  EXPECT_EQ(records.back()["step"], 6);
}

// What a step would allocate beyond memory is refused before anything runs, in one line naming the key: the
// token buffers of the batch, and the activations every layer must keep at the least.
TEST_F(TrainerSafety, AStepLargerThanMemoryIsRefusedUpFront) {
  TrainConfig c = config("huge");
  c.train.micro_batch = 100000000000;
  std::string e = error_of(c);
  EXPECT_NE(e.find("train.micro_batch = 100000000000 x train.grad_accum = 2: a step's token ids and targets"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("this machine's"), std::string::npos) << e;
  c.train.micro_batch = 100000;
  c.train.memory_limit_mb = 100;
  e = error_of(c);
  EXPECT_NE(e.find("train.micro_batch = 100000: one micro-batch's activations need at least"),
            std::string::npos)
      << e;
  EXPECT_NE(e.find("train.memory_limit_mb's 0.1 GiB"), std::string::npos) << e;
  EXPECT_FALSE(fs::exists(fs::path(c.log.run_dir) / "metrics.jsonl"));
}

// An error that would recur identically ends the run at once instead of rolling back to meet it again: the
// step's memory over the limit, a token id outside the vocabulary.
TEST_F(TrainerSafety, ErrorsThatRecurIdenticallyStopAtOnceWithoutRollingBack) {
  TrainConfig c = config("oom");
  c.train.micro_batch = 512;
  c.train.memory_limit_mb = 40;
  std::string e = error_of(c);
  EXPECT_NE(e.find("step 1: out of memory"), std::string::npos) << e;
  EXPECT_EQ(e.find("rollback"), std::string::npos) << e;

  {
    data::IndexedDatasetWriter writer((dir_ / "wide").string(), data::IndexedDType::u16);
    std::vector<int32_t> tokens(4000, 'a');
    for (size_t i = 0; i < tokens.size(); i += 31) tokens[i] = 300;  // outside "bytes"' 256, in every window
    writer.add_document(tokens);
    writer.add_document(std::vector<int32_t>(1000, 'b'));
    writer.finalize();
  }
  c = config("vocab");
  c.data.dataset = (dir_ / "wide").string();
  c.data.split = "50,50,0";
  e = error_of(c);
  EXPECT_NE(e.find("token id 300 is outside"), std::string::npos) << e;
  EXPECT_EQ(e.find("rollback"), std::string::npos) << e;
  std::ifstream metrics(fs::path(c.log.run_dir) / "metrics.jsonl");
  std::string last;
  for (std::string line; std::getline(metrics, line); last = line)
    EXPECT_EQ(line.find("\"rollback\""), std::string::npos) << line;
  // The run's last record says it failed, and why.
  EXPECT_NE(last.find("\"event\":\"end\""), std::string::npos) << last;
  EXPECT_NE(last.find("\"status\":\"failed\""), std::string::npos) << last;
  EXPECT_NE(last.find("token id 300 is outside"), std::string::npos) << last;
}

// A fresh run into a run directory that holds a checkpoint is refused (its metrics and checkpoints would be
// overwritten), unless told to overwrite; a resume from another run's checkpoint into it likewise.
TEST_F(TrainerSafety, FreshRunOverCheckpointsIsRefusedUnlessOverwrite) {
  TrainConfig c = config("used");
  c.train.steps = 2;
  Trainer(c).run();
  const std::string before = read_file(fs::path(c.log.run_dir) / "metrics.jsonl");
  const std::string e = error_of(c);
  EXPECT_NE(e.find("already holds checkpoints (its latest complete checkpoint is step 2)"), std::string::npos)
      << e;
  EXPECT_NE(e.find("checkpoint.resume=auto"), std::string::npos) << e;
  EXPECT_NE(e.find("checkpoint.overwrite=true"), std::string::npos) << e;
  EXPECT_EQ(read_file(fs::path(c.log.run_dir) / "metrics.jsonl"), before);

  TrainConfig other = config("other");
  other.train.steps = 1;
  Trainer(other).run();
  TrainConfig mixed = c;
  mixed.checkpoint.resume = toy::latest_checkpoint(other).string();
  const std::string m = error_of(mixed);
  EXPECT_NE(m.find("holds other checkpoints"), std::string::npos) << m;

  c.checkpoint.overwrite = true;
  c.train.steps = 3;
  EXPECT_EQ(Trainer(c).run().steps_done, 3);
  EXPECT_FALSE(fs::exists(c.checkpoint_dir() / "step-00000002"));
  EXPECT_EQ(read_checkpoint_manifest(c.checkpoint_dir().string()).step, 3);
}

// Two runs in one run directory would overwrite each other: the second is refused while the first holds it.
TEST_F(TrainerSafety, TwoRunsCannotShareARunDirectory) {
  TrainConfig c = config("shared");
  DirectoryLock held(c.log.run_dir, "log.run_dir");
  const std::string e = error_of(c);
  EXPECT_NE(e.find("log.run_dir " + c.log.run_dir + " is in use by another forge run (pid "),
            std::string::npos)
      << e;
  TrainConfig elsewhere = config("own");
  elsewhere.checkpoint.dir = (dir_ / "shared_checkpoints").string();
  DirectoryLock held_checkpoints(elsewhere.checkpoint.dir, "checkpoint.dir");
  EXPECT_NE(error_of(elsewhere).find("checkpoint.dir"), std::string::npos);
}

// The tokenizer is compared by content: the same tokenizer.json at another path resumes, another tokenizer at
// the same path is refused.
TEST_F(TrainerSafety, ResumeComparesTheTokenizerByContent) {
  std::string text;
  for (int i = 0; i < 50; ++i) text += "the light and the word " + std::to_string(i % 5) + "\n";
  BpeTrainerOptions small, large;
  small.vocab_size = 270;
  large.vocab_size = 300;
  train_bpe(text, small).save(dir_ / "tok.json");
  std::ofstream(dir_ / "wide.json") << R"({"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
      "num_attention_heads": 4, "vocab_size": 512, "max_position_embeddings": 64})";
  TrainConfig c = config("tok");
  c.model.config = (dir_ / "wide.json").string();
  c.data.tokenizer = (dir_ / "tok.json").string();
  c.train.steps = 2;
  Trainer(c).run();
  fs::copy_file(dir_ / "tok.json", dir_ / "moved.json");
  TrainConfig moved = c;
  moved.data.tokenizer = (dir_ / "moved.json").string();
  moved.checkpoint.resume = "auto";
  moved.train.steps = 3;
  EXPECT_EQ(Trainer(moved).run().steps_done, 3);
  train_bpe(text, large).save(dir_ / "tok.json");
  TrainConfig other = c;
  other.checkpoint.resume = "auto";
  other.train.steps = 4;
  const std::string e = error_of(other);
  EXPECT_NE(e.find("was trained with another tokenizer"), std::string::npos) << e;
}

// Another micro_batch x grad_accum split of the same global batch continues at the exact next sample, so the
// losses match the straight run's up to summation order; another seq_len is refused.
TEST_F(TrainerSafety, ResumeContinuesAtTheExactSample) {
  const TrainResult straight = Trainer(config("straight")).run();  // micro 2 x accum 2
  TrainConfig c = config("split");
  Trainer first(c);
  first.on_step([](int64_t step) {
    if (step == 3) Trainer::stop_flag() = true;
  });
  first.run();
  c.checkpoint.resume = "auto";
  c.train.micro_batch = 1;
  c.train.grad_accum = 4;
  const TrainResult resumed = Trainer(c).run();
  ASSERT_EQ(resumed.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_NEAR(resumed.losses[i], straight.losses[3 + i], 1e-5) << i;
  EXPECT_EQ(read_checkpoint_manifest(c.checkpoint_dir().string()).extra.at("samples_seen"), 6 * 4);

  // Half the global batch: the next samples are still the next ones (24, 25), not those of step 6 x 2.
  TrainConfig half = c;
  half.train.micro_batch = 2;
  half.train.grad_accum = 1;
  half.train.steps = 8;
  Trainer(half).run();
  EXPECT_EQ(read_checkpoint_manifest(half.checkpoint_dir().string()).extra.at("samples_seen"), 24 + 2 * 2);

  TrainConfig longer = c;
  longer.data.seq_len = 16;
  longer.train.steps = 9;
  const std::string e = error_of(longer);
  EXPECT_NE(e.find("was trained with data.seq_len = 32, this run has 16"), std::string::npos) << e;
}

// Saving a state already committed (Ctrl-C right after a resume) is skipped; a checkpoint holding weights
// only is refused for resuming, pointing at model.init_from.
TEST_F(TrainerSafety, ResumeEdgeCases) {
  TrainConfig c = config("edge");
  c.train.steps = 2;
  Trainer(c).run();
  const auto written = fs::last_write_time(toy::latest_checkpoint(c) / "manifest.json");
  c.checkpoint.resume = "auto";
  Trainer again(c);
  Trainer::stop_flag() = true;  // stops before the first step
  ::testing::internal::CaptureStdout();
  EXPECT_TRUE(again.run().interrupted);
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_NE(out.find("checkpoint of step 2 is already saved"), std::string::npos) << out;
  EXPECT_EQ(fs::last_write_time(toy::latest_checkpoint(c) / "manifest.json"), written);

  LlamaModel model(LlamaConfig::from_json_file(c.model.config), nn::ComputeOptions{}, 0.02f);
  model.initialize(1);
  CheckpointState state;
  state.model_config = model.config().to_json();
  save_checkpoint((dir_ / "weights").string(), model.params(), nullptr, state);
  TrainConfig w = config("w");
  w.checkpoint.resume = (dir_ / "weights").string();
  const std::string e = error_of(w);
  EXPECT_NE(e.find("holds weights only"), std::string::npos) << e;
  EXPECT_NE(e.find("model.init_from"), std::string::npos) << e;
}

TEST_F(TrainerSafety, ThreadsBeyondTheCoresAreRefused) {
  TrainConfig c = config("threads");
  c.train.threads = omp_get_num_procs() + 1;
  const std::string e = error_of(c);
  EXPECT_NE(e.find("train.threads = " + std::to_string(omp_get_num_procs() + 1) + " exceeds the"),
            std::string::npos)
      << e;
}

// Ctrl-C during the final evaluation: the final checkpoint is saved before it, and the run ends as
// interrupted (exit 130) without a final evaluation record.
TEST_F(TrainerSafety, CtrlCDuringTheFinalEvaluationEndsInterruptedWithTheFinalCheckpoint) {
  TrainConfig c = config("late");
  Trainer t(c);
  t.on_saved([](int64_t, const std::string& why) {
    if (why == "final") Trainer::stop_flag() = true;
  });
  const TrainResult r = t.run();
  EXPECT_TRUE(r.interrupted);
  EXPECT_EQ(r.steps_done, 6);
  EXPECT_EQ(read_checkpoint_manifest(c.checkpoint_dir().string()).extra.at("reason"), "final");
  EXPECT_EQ(read_file(fs::path(c.log.run_dir) / "metrics.jsonl").find("\"final\":true"), std::string::npos);
  EXPECT_FALSE(Trainer::stop_flag().load());
}

}  // namespace
}  // namespace forge::trainer_safety_test

namespace forge::trainer_safety_test {
namespace {

// A run of forge before step folders kept one checkpoint folder at <run_dir>/checkpoint itself (manifest
// version 2, no checksum): it resumes, and the first save writes a step folder and `latest` and then removes
// the old files.
TEST_F(TrainerSafety, OldSingleFolderLayoutResumesAndIsReplaced) {
  TrainConfig straight = config("straight");
  Trainer(straight).run();
  TrainConfig c = config("old");
  Trainer first(c);
  first.on_step([](int64_t step) {
    if (step == 3) Trainer::stop_flag() = true;
  });
  first.run();
  const fs::path root = c.checkpoint_dir(), step3 = root / "step-00000003";
  for (const auto& entry : fs::directory_iterator(step3))
    fs::rename(entry.path(), root / entry.path().filename());
  fs::remove(step3);
  fs::remove(root / "latest");
  nlohmann::json manifest = nlohmann::json::parse(read_file(root / "manifest.json"));
  manifest.erase("checksum");
  manifest["version"] = 2;
  std::ofstream(root / "manifest.json") << manifest.dump(2);
  EXPECT_EQ(read_checkpoint_manifest(root.string()).step, 3);

  c.checkpoint.resume = "auto";
  const TrainResult r = Trainer(c).run();
  EXPECT_EQ(r.losses.size(), 3u);
  EXPECT_FALSE(fs::exists(root / "manifest.json"));
  EXPECT_FALSE(fs::exists(root / "shard-00000-of-00001.safetensors"));
  EXPECT_EQ(read_file(toy::latest_checkpoint(c) / "shard-00000-of-00001.safetensors"),
            read_file(toy::latest_checkpoint(straight) / "shard-00000-of-00001.safetensors"));
}

}  // namespace
}  // namespace forge::trainer_safety_test
