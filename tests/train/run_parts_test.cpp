// The trainer's parts one by one, on the toy run's setup and state, without the loop: checkpointing,
// recovery, evaluation and the progress log. The whole loop is trainer_test.cpp's.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "forge/ckpt/checkpoint_dir.h"
#include "forge/ckpt/sharded.h"
#include "forge/comm/comm.h"
#include "forge/core/error.h"
#include "forge/train/checkpointing.h"
#include "forge/train/evaluation.h"
#include "forge/train/progress_log.h"
#include "forge/train/recovery.h"
#include "forge/train/run_directory.h"
#include "forge/train/setup.h"
#include "forge/train/step.h"
#include "toy_run.h"

namespace forge::train::run_parts_test {
namespace {
namespace fs = std::filesystem;

// One toy run's setup, state and parts, built the way the loop builds them (trainer.cpp).
struct ToyParts {
  TrainConfig c;
  comm::Communicator& world = comm::world();
  RunLog log{false};
  RunRecords records;
  FaultPlan faults;
  std::unique_ptr<TrainSetup> setup;
  TrainState state;
  NoPipelining schedule;
  std::unique_ptr<Checkpointing> checkpoints;
  std::unique_ptr<Recovery> recovery;
  StepHooks hooks;

  explicit ToyParts(TrainConfig config, const std::string& faults_text = "") : c(std::move(config)) {
    c.validate();
    faults = FaultPlan::parse(faults_text, "test");
    setup = std::make_unique<TrainSetup>(c, world);
    state.params = &setup->model->params();
    state.optimizer = setup->optimizer.get();
    state.samples_per_step = setup->micro * setup->accum * setup->dp;
    state.total_steps = c.train.steps;
    records.open(c.log.run_dir, /*truncate=*/true);
    checkpoints = std::make_unique<Checkpointing>(c, world, log, records, faults, *setup, state);
    recovery = std::make_unique<Recovery>(c, world, log, records, faults, state, *checkpoints);
    hooks = recovery->step_hooks();
  }
  StepResult step() { return train_step(*setup, state, schedule, hooks); }
  void steps(int n) {
    for (int i = 0; i < n; ++i) {
      const StepResult r = step();
      ASSERT_TRUE(r.applied) << "step " << state.step + 1;
      recovery->accept(r.loss, r.grad_norm);
    }
  }
  std::vector<float> weights() const {
    const Tensor& p = state.params->params();
    return std::vector<float>(p.f32(), p.f32() + p.numel());
  }
  // The records of metrics.jsonl with "event" == event ("" : those without an event).
  std::vector<nlohmann::json> events(const std::string& event) const {
    std::vector<nlohmann::json> out;
    std::ifstream in(fs::path(c.log.run_dir) / "metrics.jsonl");
    for (std::string line; std::getline(in, line);) {
      nlohmann::json j = nlohmann::json::parse(line);
      if (j.value("event", std::string()) == event) out.push_back(std::move(j));
    }
    return out;
  }
};

class RunParts : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = toy::fresh_test_dir("forge_run_parts");
    toy::write_toy_run_inputs(dir_);
    config_ = toy::toy_run_config(dir_, "run");
  }
  void TearDown() override { fs::remove_all(dir_); }
  fs::path dir_;
  TrainConfig config_;
};

// ---- Checkpointing

TEST_F(RunParts, CheckpointingSavesAStepOnceAndLoadsItBackBitwise) {
  ToyParts run(config_);
  run.steps(2);
  run.checkpoints->save("periodic");
  EXPECT_EQ(run.checkpoints->committed_step(), 2);
  const std::vector<float> at_two = run.weights();
  ASSERT_EQ(run.events("checkpoint").size(), 1u);
  run.checkpoints->save("final");  // the same step: already committed, not written again
  EXPECT_EQ(run.events("checkpoint").size(), 1u);

  run.steps(1);
  ASSERT_NE(run.weights(), at_two);
  const ckpt::CheckpointState saved = run.checkpoints->load(toy::latest_checkpoint(run.c));
  EXPECT_EQ(saved.step, 2);
  EXPECT_EQ(run.state.step, 2);
  EXPECT_EQ(run.state.samples_seen(), 2 * run.state.samples_per_step);
  EXPECT_EQ(run.weights(), at_two);
}

TEST_F(RunParts, CheckpointingCommitsABackgroundSaveWhenAsked) {
  ToyParts run(config_);
  run.steps(1);
  run.checkpoints->save("periodic", /*background=*/true);
  EXPECT_TRUE(run.checkpoints->pending());
  EXPECT_EQ(run.checkpoints->committed_step(), -1);
  run.checkpoints->commit_pending();
  EXPECT_FALSE(run.checkpoints->pending());
  EXPECT_EQ(run.checkpoints->committed_step(), 1);
  const std::vector<nlohmann::json> saves = run.events("checkpoint");
  ASSERT_EQ(saves.size(), 1u);
  EXPECT_EQ(saves[0]["reason"], "periodic");
  EXPECT_TRUE(saves[0].contains("blocked_s"));
  EXPECT_EQ(ckpt::complete_checkpoints(run.checkpoints->dir().string()).size(), 1u);
}

TEST_F(RunParts, CheckpointingGoesOnAfterAFailedPeriodicSaveButNotAFinalOne) {
  ToyParts run(config_, "disk_full step=1 times=0");
  run.steps(1);
  EXPECT_NO_THROW(run.checkpoints->save("periodic"));
  EXPECT_EQ(run.checkpoints->committed_step(), -1);
  const std::vector<nlohmann::json> failed = run.events("checkpoint_failed");
  ASSERT_EQ(failed.size(), 1u);
  EXPECT_NE(failed[0]["error"].get<std::string>().find("No space left on device"), std::string::npos);
  EXPECT_EQ(run.checkpoints->newest_description(), "no checkpoint of this run is saved yet");
  EXPECT_THROW(run.checkpoints->save("final"), Error);
}

TEST_F(RunParts, CheckpointingResumesPastADamagedNewestCheckpoint) {
  config_.checkpoint.resume = "auto";
  {
    ToyParts run(config_);
    run.steps(2);
    run.checkpoints->save("periodic");
    run.steps(2);
    run.checkpoints->save("periodic");
  }
  const fs::path newest = toy::latest_checkpoint(config_);
  corrupt_file((newest / ckpt::shard_file_name(0, 1)).string(), /*truncate=*/false);
  ToyParts run(config_);
  const ResumeDecision decision = decide_resume(run.c);
  ASSERT_EQ(decision.checkpoint, newest);
  const ResumeOutcome outcome = run.checkpoints->resume(decision);
  EXPECT_EQ(run.state.step, 2);
  EXPECT_EQ(outcome.from.filename(), "step-00000002");
  ASSERT_EQ(outcome.skipped.size(), 1u);
  EXPECT_NE(outcome.skipped[0].find(newest.string()), std::string::npos) << outcome.skipped[0];
  // The step resumed from is committed: saving it again is skipped.
  EXPECT_EQ(run.checkpoints->committed_step(), 2);
}

// ---- Recovery

TEST_F(RunParts, RecoveryFirstSkipsTheAnomalousStepInPlace) {
  ToyParts run(config_);
  run.recovery->start();
  run.steps(2);
  const std::vector<float> at_two = run.weights();
  const int64_t samples = run.state.samples_seen();
  EXPECT_EQ(run.recovery->roll_back("test anomaly"), 2);
  EXPECT_EQ(run.weights(), at_two);
  // The samples of step 3 are skipped: step 3 continues at step 4's.
  EXPECT_EQ(run.state.first_sample_of(2), samples + run.state.samples_per_step);
  const std::vector<nlohmann::json> rollbacks = run.events("rollback");
  ASSERT_EQ(rollbacks.size(), 1u);
  EXPECT_EQ(rollbacks[0]["step"], 3);
  EXPECT_EQ(rollbacks[0]["cause"], "test anomaly");
  EXPECT_EQ(run.events("anomaly").size(), 1u);
}

TEST_F(RunParts, RecoveryRestoresTheNewestSnapshotBitwise) {
  config_.resilience.skip_first = false;
  config_.resilience.snapshot_every = 2;
  ToyParts run(config_);
  run.recovery->start();
  run.steps(2);  // a snapshot after step 2
  const std::vector<float> at_two = run.weights();
  run.steps(1);
  EXPECT_EQ(run.recovery->roll_back("test anomaly"), 2);
  EXPECT_EQ(run.state.step, 2);
  EXPECT_EQ(run.weights(), at_two);
  EXPECT_EQ(run.checkpoints->committed_step(), -1);
}

TEST_F(RunParts, RecoveryWithoutSnapshotsRestoresTheNewestCheckpointThatLoads) {
  config_.resilience.skip_first = false;
  config_.resilience.snapshot_every = 0;
  ToyParts run(config_);
  run.recovery->start();
  run.steps(2);
  run.checkpoints->save("periodic");
  const std::vector<float> at_two = run.weights();
  run.steps(1);
  EXPECT_EQ(run.recovery->roll_back("test anomaly"), 2);
  EXPECT_EQ(run.weights(), at_two);
  EXPECT_NE(run.events("rollback")[0]["restored"].get<std::string>().find("checkpoint"), std::string::npos);
}

TEST_F(RunParts, RecoveryStopsWithAnAccountOnceTheRetriesAreSpent) {
  config_.resilience.max_retries = 1;
  ToyParts run(config_);
  run.recovery->start();
  run.steps(1);
  run.recovery->roll_back("first anomaly");
  try {
    run.recovery->roll_back("second anomaly");
    FAIL() << "a second rollback in a row was allowed";
  } catch (const Error& e) {
    const std::string what = e.what();
    EXPECT_NE(what.find("second anomaly"), std::string::npos) << what;
    EXPECT_NE(what.find("resilience.max_retries = 1"), std::string::npos) << what;
    EXPECT_NE(what.find("rollback 1 at step 2 to step 1"), std::string::npos) << what;
  }
}

TEST_F(RunParts, RecoveryWithRollbackOffEndsTheRun) {
  config_.resilience.rollback = false;
  ToyParts run(config_);
  run.steps(1);
  try {
    run.recovery->roll_back("test anomaly");
    FAIL() << "rolled back with resilience.rollback = false";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no checkpoint of this run was saved"), std::string::npos)
        << e.what();
  }
}

// ---- Evaluation

TEST_F(RunParts, EvaluationReportsBitsPerByteOfTheHeldOutLoss) {
  ToyParts run(config_);
  const int64_t windows = run.setup->data->heldout_windows();
  ASSERT_GT(windows, 2);
  const HeldOut all = evaluate(*run.setup, nullptr, windows, run.world);
  // Byte tokens: one byte per predicted token.
  EXPECT_EQ(all.bytes, all.loss.tokens);
  EXPECT_DOUBLE_EQ(all.bits_per_byte(), all.loss.sum / std::log(2.0) / static_cast<double>(all.bytes));
  EXPECT_GT(all.bits_per_byte(), 4.0);  // untrained: about log2(256) = 8 bits per byte

  Evaluation evaluation(run.c, run.world, run.log, run.records, *run.setup, nullptr, run.checkpoints->dir());
  run.c.eval.batches = 1;
  ASSERT_TRUE(evaluation.periodic(0));
  const std::vector<nlohmann::json> records = run.events("");
  ASSERT_EQ(records.size(), 1u);
  const HeldOut first = evaluate(*run.setup, nullptr, run.setup->micro, run.world);
  EXPECT_DOUBLE_EQ(records[0]["eval_bits_per_byte"].get<double>(), first.bits_per_byte());

  Trainer::stop_flag().store(true);
  EXPECT_FALSE(evaluation.periodic(0));
  EXPECT_TRUE(evaluate(*run.setup, nullptr, windows, run.world).interrupted);
  Trainer::stop_flag().store(false);
}

// ---- Progress log

TEST_F(RunParts, ProgressLogRecordsTheFirstEveryNthAndTheLastStep) {
  config_.log.every = 4;
  ToyParts run(config_);
  ProgressLog progress(run.c, run.world, run.log, run.records, *run.setup, run.state,
                       ProgressLog::Clock::now());
  progress.banner();
  progress.start();
  for (int i = 0; i < 6; ++i) {
    progress.before_step();
    const StepResult r = run.step();
    ASSERT_TRUE(r.applied);
    progress.step(r, 0.01);
  }
  const std::vector<nlohmann::json> records = run.events("");
  ASSERT_EQ(records.size(), 3u);
  EXPECT_EQ(records[0]["step"], 1);
  EXPECT_EQ(records[1]["step"], 4);
  EXPECT_EQ(records[2]["step"], 6);
  const int64_t step_tokens = run.c.tokens_per_step();
  for (const nlohmann::json& r : records) {
    EXPECT_EQ(r["tokens"].get<int64_t>(), r["step"].get<int64_t>() * step_tokens);
    // MFU against the given peak (log.peak_gflops = 100).
    EXPECT_NEAR(r["mfu"].get<double>(), r["tflops"].get<double>() * 1e12 / 100e9, 1e-12);
    EXPECT_GT(r["peak_memory_bytes"].get<double>(), 0);
  }
}

}  // namespace
}  // namespace forge::train::run_parts_test
