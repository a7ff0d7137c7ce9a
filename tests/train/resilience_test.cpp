// Resilience on one process (docs/resilience.md): every fault a run can inject into itself is recovered
// automatically or refused with one line, and nothing is lost. A transient NaN (in the loss or a gradient),
// a loss spike or an exception in a step rolls back to the last stable state (an in-memory snapshot, or the
// newest checkpoint on disk) and skips the data window, ending bit for bit on the weights of a clean run
// that skips the same samples; a persistent one stops after resilience.max_retries with an account. A full
// disk fails a periodic save without stopping training; a damaged newest checkpoint is skipped by
// resume = auto. Asynchronous saves write byte-identical checkpoints to synchronous ones.
#include "forge/train/resilience.h"

#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <nlohmann/json.hpp>
#include <sstream>

#include "forge/ckpt/checkpoint.h"
#include "forge/ckpt/checkpoint_dir.h"
#include "forge/core/error.h"
#include "forge/train/faults.h"
#include "forge/train/trainer.h"
#include "test_files.h"
#include "train/toy_run.h"

namespace forge::resilience_test {
using namespace forge::ckpt;
using namespace forge::train;
namespace {
using testing::read_file;
using toy::host_weights;
namespace fs = std::filesystem;

std::string error_of(const TrainConfig& c) {
  try {
    Trainer(c).run();
  } catch (const Error& e) {
    EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos) << e.what();
    return e.what();
  }
  return "";
}

std::vector<nlohmann::json> events(const TrainConfig& c, const std::string& kind) {
  std::vector<nlohmann::json> out;
  std::ifstream in(fs::path(c.log.run_dir) / "metrics.jsonl");
  for (std::string line; std::getline(in, line);) {
    const nlohmann::json j = nlohmann::json::parse(line);
    if (j.value("event", std::string()) == kind) out.push_back(j);
  }
  return out;
}

// ---- The pieces.

TEST(FaultPlan, ParsesEveryKindAndRefusesBadSpecsInOneLine) {
  const FaultPlan plan = FaultPlan::parse(
      "nan_loss step=5 rank=1; nan_grad step=2 times=0 ;spike step=3 factor=10; kill step=9 attempt=any;"
      "corrupt_checkpoint step=4",
      "FORGE_FAULT");
  ASSERT_EQ(plan.faults().size(), 5u);
  EXPECT_EQ(plan.faults()[0].kind, FaultKind::nan_loss);
  EXPECT_EQ(plan.faults()[0].rank, 1);
  EXPECT_EQ(plan.faults()[1].times, 0);
  EXPECT_EQ(plan.faults()[1].rank, -1);
  EXPECT_EQ(plan.faults()[2].factor, 10);
  EXPECT_EQ(plan.faults()[3].attempt, -1);
  EXPECT_EQ(plan.faults()[4].rank, 0);  // checkpoint faults default to rank 0
  EXPECT_TRUE(FaultPlan::parse("", "x").empty());

  auto refusal = [](const std::string& text) {
    try {
      (void)FaultPlan::parse(text, "resilience.inject");
    } catch (const Error& e) {
      EXPECT_EQ(std::string(e.what()).find('\n'), std::string::npos);
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_NE(refusal("nan_los step=3")
                .find("resilience.inject: fault 1 'nan_los step=3': unknown kind 'nan_los'; "
                      "did you mean 'nan_loss'?"),
            std::string::npos);
  EXPECT_NE(refusal("kill rank=1").find("step=<k> is missing"), std::string::npos);
  EXPECT_NE(refusal("kill step=0").find("step = '0' is not an integer >= 1"), std::string::npos);
  EXPECT_NE(refusal("kill step=2 when=now").find("unknown key 'when'"), std::string::npos);
  EXPECT_NE(refusal("spike step=2 factor=-1").find("factor = '-1'"), std::string::npos);
  // The trainer's config refuses a bad spec when validated, naming the key.
  TrainConfig c;
  c.resilience.inject = "hang";
  try {
    c.validate();
    ADD_FAILURE() << "validated";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("resilience.inject"), std::string::npos) << e.what();
  }
}

TEST(FaultPlan, FiresAtItsStepAndRankAsOftenAsAsked) {
  FaultPlan plan =
      FaultPlan::parse("nan_loss step=3 rank=1; nan_grad step=4 times=0; spike step=5 times=2", "t");
  EXPECT_EQ(plan.take(FaultKind::nan_loss, 3, 0), nullptr);  // another rank
  EXPECT_NE(plan.take(FaultKind::nan_loss, 3, 1), nullptr);
  EXPECT_EQ(plan.take(FaultKind::nan_loss, 3, 1), nullptr);  // transient: once
  for (int i = 0; i < 5; ++i) EXPECT_NE(plan.take(FaultKind::nan_grad, 4, i % 2), nullptr);  // persistent
  EXPECT_NE(plan.take(FaultKind::spike, 5, 0), nullptr);
  EXPECT_NE(plan.take(FaultKind::spike, 5, 0), nullptr);
  EXPECT_EQ(plan.take(FaultKind::spike, 5, 0), nullptr);
  EXPECT_EQ(plan.take(FaultKind::spike, 6, 0), nullptr);
}

TEST(SpikeDetector, JudgesAgainstTheWindowAfterWarmup) {
  TrainConfig::Resilience r;
  r.loss_spike = 2.0, r.grad_norm_spike = 3.0, r.window = 10, r.spike_after = -1;
  const SpikeDetector ratio(r, /*warmup=*/5);
  TrainState s;
  for (int i = 0; i < 9; ++i) ratio.accept(s, 3.0 + 0.01 * i, 1.0);
  EXPECT_EQ(ratio.judge(s, 20, 100.0, 1.0), "");  // 9 values: too few to judge
  ratio.accept(s, 3.0, 1.0);
  EXPECT_EQ(ratio.judge(s, 20, 5.9, 1.0), "");
  EXPECT_NE(
      ratio.judge(s, 20, 6.5, 1.0).find("loss spike: 6.5 is 2.14x the median 3.04 of the last 10 steps"),
      std::string::npos)
      << ratio.judge(s, 20, 6.5, 1.0);
  EXPECT_NE(ratio.judge(s, 20, 3.0, 3.5).find("gradient norm spike"), std::string::npos);
  EXPECT_EQ(ratio.judge(s, 5, 100.0, 100.0), "");  // in warmup
  for (int i = 0; i < 20; ++i) ratio.accept(s, 1.0, 1.0);
  EXPECT_EQ(s.recent_losses.size(), 10u);  // the window keeps its length

  r.spike_metric = "zscore", r.loss_spike = 4.0, r.spike_after = 0;
  const SpikeDetector z(r, 5);
  TrainState t;
  for (int i = 0; i < 20; ++i) z.accept(t, 3.0 + (i % 2 ? 0.1 : -0.1), 1.0);  // mean 3, std ~0.103
  EXPECT_EQ(z.judge(t, 1, 3.3, 1.0), "");
  EXPECT_NE(z.judge(t, 1, 3.5, 1.0).find("standard deviations above the mean"), std::string::npos);
  TrainState flat;
  for (int i = 0; i < 20; ++i) z.accept(flat, 3.0, 1.0);
  EXPECT_EQ(z.judge(flat, 1, 30.0, 1.0), "");  // std 0 judges nothing
}

// A loss near zero (a model that has learned its data) doubles in ordinary batch-to-batch noise: a spike must
// also rise loss_spike_min nats above the window. The default 0.1 leaves a pretraining loss's 2x untouched.
TEST(SpikeDetector, NearZeroLossesNeedAnAbsoluteRise) {
  TrainConfig::Resilience r;
  r.loss_spike = 2.0, r.window = 10, r.spike_after = 0;
  ASSERT_EQ(r.loss_spike_min, 0.1);
  const SpikeDetector ratio(r, 0);
  TrainState s;
  for (int i = 0; i < 10; ++i) ratio.accept(s, 0.005, 1.0);
  EXPECT_EQ(ratio.judge(s, 20, 0.012, 1.0), "");  // 2.4x, but 0.007 nats
  EXPECT_EQ(ratio.judge(s, 20, 0.1, 1.0), "");    // 20x, 0.095 nats
  EXPECT_NE(ratio.judge(s, 20, 0.2, 1.0).find("loss spike: 0.2 is 40.00x the median 0.005"),
            std::string::npos);
  r.loss_spike_min = 0;  // ratio alone
  EXPECT_NE(SpikeDetector(r, 0).judge(s, 20, 0.012, 1.0).find("loss spike"), std::string::npos);

  r.spike_metric = "zscore", r.loss_spike = 4.0, r.loss_spike_min = 0.1;
  const SpikeDetector z(r, 0);
  TrainState t;
  for (int i = 0; i < 20; ++i) z.accept(t, 0.005 + (i % 2 ? 0.001 : -0.001), 1.0);
  EXPECT_EQ(z.judge(t, 1, 0.05, 1.0), "");  // 40 standard deviations, 0.045 nats
  EXPECT_NE(z.judge(t, 1, 0.5, 1.0).find("standard deviations above the mean"), std::string::npos);
}

TEST(SkipDataWindow, ContinuesAtTheSampleAfterTheAnomalousStep) {
  TrainState s;
  s.samples_per_step = 4, s.base_step = 0, s.base_samples = 0;
  s.step = 7;  // the anomaly strikes step 8, which reads samples 28..31
  const int64_t at_anomaly = s.first_sample_of(s.step);
  EXPECT_EQ(at_anomaly, 28);
  s.step = 5;                                            // restored
  EXPECT_EQ(skip_data_window(s, 5, 8, at_anomaly), 12);  // steps 6, 7, 8
  EXPECT_EQ(s.first_sample_of(5), 32);
  EXPECT_EQ(s.first_sample_of(6), 36);
}

// ---- The trainer.

class Resilience : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = toy::fresh_test_dir("forge_resilience");
    toy::write_toy_run_inputs(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }
  TrainConfig config(const std::string& run) const {
    TrainConfig c = toy::toy_run_config(dir_, run);
    c.train.steps = 8;
    c.resilience.snapshot_every = 2;
    return c;
  }
  // The clean run that skips the samples of steps from+1 .. to (1-based), as a rollback from step `to` to the
  // state of step `from` does: its final weights.
  std::vector<float> clean_skipping(const std::string& run, int64_t from, int64_t to,
                                    TrainResult* result = nullptr) {
    TrainConfig c = config(run);
    std::vector<float> final;
    Trainer t(c);
    t.on_state([&](TrainState& s) {
      if (s.step == from) {
        const int64_t resume_at = s.first_sample_of(to);
        s.base_step = from, s.base_samples = resume_at;
      }
      if (s.step == c.train.steps) final = host_weights(s);
    });
    const TrainResult r = t.run();
    if (result) *result = r;
    return final;
  }
  std::vector<float> final_weights(TrainConfig c, TrainResult* result = nullptr) {
    std::vector<float> final;
    Trainer t(c);
    t.on_state([&](TrainState& s) {
      if (s.step == c.train.steps) final = host_weights(s);
    });
    const TrainResult r = t.run();
    if (result) *result = r;
    return final;
  }
  fs::path dir_;
};

// A NaN in the loss at step 5, once: rolled back to the snapshot of step 4, step 5's samples skipped, and
// the run ends bitwise on the clean run that skips them, losses included; metrics.jsonl records it.
TEST_F(Resilience, TransientNanLossRollsBackToTheSnapshotAndEqualsTheCleanRunThatSkips) {
  TrainResult want;
  const std::vector<float> clean = clean_skipping("clean", 4, 5, &want);
  TrainConfig c = config("nan");
  c.resilience.inject = "nan_loss step=5";
  ::testing::internal::CaptureStdout();
  TrainResult got;
  const std::vector<float> rolled = final_weights(c, &got);
  const std::string out = ::testing::internal::GetCapturedStdout();
  EXPECT_EQ(rolled, clean);
  EXPECT_EQ(got.losses, want.losses);
  EXPECT_EQ(got.rollbacks, 1);
  EXPECT_NE(out.find("rollback 1 of at most 3 at step 5 (the training loss is nan"), std::string::npos)
      << out;
  EXPECT_NE(out.find("restored nothing (the state of step 4: the update was not applied), skipped 4 samples "
                     "(steps 5-5)"),
            std::string::npos)
      << out;
  const std::vector<nlohmann::json> rollbacks = events(c, "rollback");
  ASSERT_EQ(rollbacks.size(), 1u);
  EXPECT_EQ(rollbacks[0]["step"], 5);
  EXPECT_EQ(rollbacks[0]["restored_step"], 4);
  EXPECT_EQ(rollbacks[0]["skipped_samples"], 4);
  EXPECT_EQ(rollbacks[0]["skipped_steps"], 1);
  EXPECT_NE(rollbacks[0]["cause"].get<std::string>().find("loss is nan"), std::string::npos);
  EXPECT_EQ(events(c, "anomaly").size(), 1u);
}

// A NaN gradient at step 6 with the newest snapshot at step 4: by default (skip_first) only step 6's samples
// are skipped, the state kept; with skip_first off, the snapshot is restored and steps 5 and 6 skipped.
TEST_F(Resilience, TransientNanGradientSkipsTheStepOrTheWholeWindowSinceTheSnapshot) {
  TrainConfig first = config("nan_grad_first");
  first.resilience.snapshot_every = 4;
  first.resilience.inject = "nan_grad step=6";
  TrainResult in_place;
  EXPECT_EQ(final_weights(first, &in_place), clean_skipping("clean_step", 5, 6));
  EXPECT_EQ(in_place.rollbacks, 1);
  EXPECT_EQ(events(first, "rollback").at(0)["skipped_samples"], 4);

  const std::vector<float> clean = clean_skipping("clean", 4, 6);
  TrainConfig c = config("nan_grad");
  c.resilience.skip_first = false;
  c.resilience.snapshot_every = 4;
  c.resilience.inject = "nan_grad step=6";
  TrainResult got;
  EXPECT_EQ(final_weights(c, &got), clean);
  EXPECT_EQ(got.rollbacks, 1);
  EXPECT_EQ(events(c, "rollback").at(0)["skipped_samples"], 8);
}

// skip = none trains on the same samples again: a transient fault then leaves no trace at all.
TEST_F(Resilience, SkipNoneReplaysTheWindowAndEqualsTheUninterruptedRun) {
  const std::vector<float> straight = final_weights(config("straight"));
  TrainConfig c = config("replay");
  c.resilience.skip = "none";
  c.resilience.inject = "inf_loss step=3";
  EXPECT_EQ(final_weights(c), straight);
}

// An exception inside a step's compute (as the schedule takes its first micro-batch) on one process is an
// anomaly like a NaN.
TEST_F(Resilience, ExceptionInAStepRollsBackOnOneProcess) {
  const std::vector<float> clean = clean_skipping("clean", 2, 3);
  TrainConfig c = config("throw");
  c.resilience.inject = "throw step=3";
  TrainResult got;
  EXPECT_EQ(final_weights(c, &got), clean);
  EXPECT_EQ(got.rollbacks, 1);
  EXPECT_NE(events(c, "rollback")
                .at(0)["cause"]
                .get<std::string>()
                .find("an exception in the step: throw at step 3: injected exception"),
            std::string::npos);
}

// Reading a step's data fails (a damaged dataset file): the step is refused before anything changes, and
// rolled back like any anomaly.
TEST_F(Resilience, DataErrorRollsBack) {
  const std::vector<float> clean = clean_skipping("clean", 4, 5);
  TrainConfig c = config("data");
  c.resilience.inject = "data_error step=5";
  TrainResult got;
  EXPECT_EQ(final_weights(c, &got), clean);
  EXPECT_EQ(got.rollbacks, 1);
  EXPECT_NE(events(c, "rollback")
                .at(0)["cause"]
                .get<std::string>()
                .find("the step's data could not be read: data_error at step 5: injected error reading the "
                      "step's data"),
            std::string::npos);
}

// Without in-memory snapshots the rollback target is the newest valid checkpoint on disk.
TEST_F(Resilience, WithoutSnapshotsTheNewestCheckpointIsRestored) {
  const std::vector<float> clean = clean_skipping("clean", 4, 5);
  TrainConfig c = config("disk");
  c.resilience.skip_first = false;
  c.resilience.snapshot_every = 0;
  c.checkpoint.every = 2;
  c.resilience.inject = "nan_loss step=5";
  TrainResult got;
  EXPECT_EQ(final_weights(c, &got), clean);
  const nlohmann::json rollback = events(c, "rollback").at(0);
  EXPECT_NE(rollback["restored"].get<std::string>().find("step-00000004"), std::string::npos) << rollback;
  // The final checkpoint holds the rolled-back run's weights and resumes past the skipped window.
  EXPECT_EQ(read_checkpoint_manifest(c.checkpoint_dir().string()).extra["samples_seen"], 8 * 4 + 4);
}

// A loss spike (the loss x100 at step 14) is judged against the window and rolled back; with lr_factor the
// learning rate is lowered for lr_steps steps after the rollback.
TEST_F(Resilience, LossSpikeRollsBackAndLowersTheLearningRate) {
  TrainConfig c = config("spike");
  c.resilience.skip_first = false;  // the snapshot of step 12, so that steps 13 and 14 run at half the rate
  c.train.steps = 16;
  c.resilience.window = 10;
  c.resilience.snapshot_every = 4;
  c.resilience.lr_factor = 0.5;
  c.resilience.lr_steps = 2;
  c.resilience.inject = "spike step=14";
  c.log.every = 1;
  TrainResult got;
  final_weights(c, &got);
  EXPECT_EQ(got.rollbacks, 1);
  const nlohmann::json rollback = events(c, "rollback").at(0);
  EXPECT_NE(rollback["cause"].get<std::string>().find("loss spike"), std::string::npos) << rollback;
  EXPECT_EQ(rollback["restored_step"], 12);
  EXPECT_EQ(rollback["lr_scale"], 0.5);
  // Steps 13 and 14 after the rollback ran at half the schedule's rate, step 15 at the full one.
  TrainConfig plain = config("plain");
  plain.train.steps = 16;
  plain.log.every = 1;
  final_weights(plain);
  const std::vector<nlohmann::json> a = toy::step_records(c), b = toy::step_records(plain);
  auto lr_of = [](const std::vector<nlohmann::json>& records, int64_t step) {
    double lr = -1;  // the last record of the step (a rolled-back step is logged again)
    for (const nlohmann::json& r : records)
      if (r["step"] == step) lr = r["lr"].get<double>();
    return lr;
  };
  EXPECT_FLOAT_EQ(lr_of(a, 13), 0.5 * lr_of(b, 13));
  EXPECT_FLOAT_EQ(lr_of(a, 14), 0.5 * lr_of(b, 14));
  EXPECT_FLOAT_EQ(lr_of(a, 15), lr_of(b, 15));
}

// A gradient-norm spike (the gradients x100 at step 14) with grad_norm_spike on, judged as a z-score.
TEST_F(Resilience, GradientNormSpikeRollsBack) {
  TrainConfig c = config("grad_spike");
  c.train.steps = 16;
  c.resilience.window = 10;
  c.resilience.snapshot_every = 4;
  c.resilience.spike_metric = "zscore";
  c.resilience.loss_spike = 0;
  c.resilience.grad_norm_spike = 6;
  c.resilience.inject = "grad_spike step=14";
  TrainResult got;
  final_weights(c, &got);
  EXPECT_EQ(got.rollbacks, 1);
  const nlohmann::json rollback = events(c, "rollback").at(0);
  EXPECT_NE(rollback["cause"].get<std::string>().find("gradient norm spike"), std::string::npos) << rollback;
  EXPECT_NE(rollback["cause"].get<std::string>().find("standard deviations above the mean"),
            std::string::npos)
      << rollback;
  EXPECT_EQ(rollback["restored_step"], 13);  // skip_first: the state kept, step 14's samples skipped
}

// A persistent NaN (every time step 5 runs) stops after max_retries rollbacks, naming step, rank and cause,
// with the account of each rollback; nothing of step 5 is saved.
TEST_F(Resilience, PersistentNanStopsAfterTheRetryLimit) {
  TrainConfig c = config("persistent");
  c.resilience.max_retries = 2;
  c.checkpoint.every = 2;
  c.resilience.inject = "nan_grad step=5 times=0";
  const std::string e = error_of(c);
  EXPECT_NE(e.find("step 5: the gradient norm is nan"), std::string::npos) << e;
  EXPECT_NE(e.find("first on rank 0: gradient of"), std::string::npos) << e;
  EXPECT_NE(e.find("2 rollbacks in a row did not get past it (resilience.max_retries = 2)"),
            std::string::npos)
      << e;
  // The first rollback keeps the state and skips step 5's samples; the NaN comes back, and the second
  // restores the newest snapshot (step 4).
  EXPECT_NE(e.find("rollback 1 at step 5 to step 4; rollback 2 at step 5 to step 4"), std::string::npos) << e;
  EXPECT_EQ(events(c, "rollback").size(), 2u);
  EXPECT_EQ(events(c, "anomaly").size(), 3u);
  EXPECT_LT(read_checkpoint_manifest(c.checkpoint_dir().string()).step, 5);
}

// With the FP8 delayed recipe, a refused step's amaxes are forgotten with it (and the weights cast again): a
// rollback, keeping the state or restoring a snapshot, ends bitwise on the clean run that skips the step,
// amax histories and scales included.
TEST_F(Resilience, Fp8DelayedScalingForgetsTheRefusedStep) {
  auto fp8 = [&](const std::string& run) {
    TrainConfig c = config(run);
    c.fp8.recipe = "delayed";
    c.fp8.bf16_first_layers = c.fp8.bf16_last_layers = 0;
    return c;
  };
  std::vector<float> clean;
  TrainResult want;
  {
    TrainConfig c = fp8("clean");
    Trainer t(c);
    t.on_state([&](TrainState& s) {
      if (s.step == 4) {
        const int64_t resume_at = s.first_sample_of(5);
        s.base_step = 4, s.base_samples = resume_at;
      }
      if (s.step == c.train.steps) clean = host_weights(s);
    });
    want = t.run();
  }
  for (bool skip_first : {true, false}) {  // the state kept, or the snapshot of step 4 restored
    TrainConfig c = fp8(skip_first ? "nan_kept" : "nan_restored");
    c.resilience.skip_first = skip_first;
    c.resilience.inject = "nan_loss step=5";
    TrainResult got;
    EXPECT_EQ(final_weights(c, &got), clean) << skip_first;
    EXPECT_EQ(got.fp8_scales, want.fp8_scales) << skip_first;
    EXPECT_EQ(got.losses, want.losses) << skip_first;
  }
}

// ---- Checkpoints.

// Asynchronous saves write the same bytes as synchronous ones, step for step, and the run ends on the same
// weights; each record says how long the step was blocked.
TEST_F(Resilience, AsynchronousCheckpointsAreByteIdenticalToSynchronousOnes) {
  TrainConfig sync = config("sync");
  sync.checkpoint.every = 1, sync.checkpoint.keep_last = 0, sync.checkpoint.async = false;
  TrainConfig async = config("async");
  async.checkpoint.every = 1, async.checkpoint.keep_last = 0;
  EXPECT_EQ(final_weights(sync), final_weights(async));
  for (int step = 1; step <= 8; ++step) {
    const fs::path a = sync.checkpoint_dir() / checkpoint_step_name(step),
                   b = async.checkpoint_dir() / checkpoint_step_name(step);
    ASSERT_TRUE(fs::exists(b / "manifest.json")) << b;
    EXPECT_EQ(read_file(a / "shard-00000-of-00001.safetensors"),
              read_file(b / "shard-00000-of-00001.safetensors"))
        << step;
  }
  const std::vector<nlohmann::json> saves = events(async, "checkpoint");
  ASSERT_EQ(saves.size(), 8u);
  EXPECT_TRUE(saves[0].contains("blocked_s")) << saves[0];
  EXPECT_FALSE(saves.back().contains("blocked_s"));  // the final save is synchronous
}

// A full disk during a periodic save (in the background or not) fails that save only: one line, a record,
// training goes on, the previous checkpoint stays the newest until the next save succeeds.
TEST_F(Resilience, FullDiskDuringAPeriodicSaveKeepsTrainingAndThePreviousCheckpoint) {
  for (bool async : {true, false}) {
    TrainConfig c = config(async ? "full_async" : "full_sync");
    c.checkpoint.every = 2;
    c.checkpoint.keep_last = 0;
    c.checkpoint.async = async;
    c.resilience.inject = "disk_full step=4";
    ::testing::internal::CaptureStdout();
    const std::vector<float> weights = final_weights(c);
    const std::string out = ::testing::internal::GetCapturedStdout();
    EXPECT_EQ(weights, final_weights(config(async ? "ref_async" : "ref_sync")));
    EXPECT_NE(out.find("checkpoint of step 4 failed: "), std::string::npos) << out;
    EXPECT_NE(out.find("No space left on device"), std::string::npos) << out;
    EXPECT_NE(out.find("training goes on (the newest checkpoint is still step 2)"), std::string::npos) << out;
    EXPECT_FALSE(fs::exists(c.checkpoint_dir() / "step-00000004"));
    EXPECT_TRUE(fs::exists(c.checkpoint_dir() / "step-00000006" / "manifest.json"));
    EXPECT_EQ(events(c, "checkpoint_failed").size(), 1u);
    for (const auto& entry : fs::directory_iterator(c.checkpoint_dir()))
      EXPECT_FALSE(entry.path().filename().string().starts_with(".")) << entry.path();  // no staging left
  }
}

// The newest checkpoint damaged after it was committed (a flipped byte: it still reads as complete; a
// truncated shard: it does not): resume = auto reports it, resumes from the one before, and ends on the
// straight run's final weights.
TEST_F(Resilience, ResumeAutoSkipsADamagedNewestCheckpoint) {
  const std::vector<float> straight = final_weights(config("straight"));
  for (const char* fault : {"corrupt_checkpoint", "truncate_checkpoint"}) {
    TrainConfig c = config(fault);
    c.checkpoint.every = 1;
    c.resilience.inject = std::string(fault) + " step=5";
    Trainer first(c);
    first.on_step([](int64_t step) {
      if (step == 5) Trainer::stop_flag() = true;
    });
    EXPECT_TRUE(first.run().interrupted);
    c.resilience.inject = "";
    c.checkpoint.resume = "auto";
    ::testing::internal::CaptureStdout();
    TrainResult r;
    const std::vector<float> resumed = final_weights(c, &r);
    const std::string out = ::testing::internal::GetCapturedStdout();
    EXPECT_EQ(resumed, straight) << fault;
    EXPECT_EQ(r.losses.size(), 4u) << out;  // steps 5..8
    EXPECT_NE(out.find("step-00000005"), std::string::npos) << out;
    EXPECT_NE(out.find("resumed from"), std::string::npos) << out;
    EXPECT_NE(out.find("at step 4"), std::string::npos) << out;
  }
}

}  // namespace
}  // namespace forge::resilience_test
