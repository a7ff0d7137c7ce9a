// The training loop's class, internal to forge's train layer (not an API): one run of the loop, its setup,
// state and decisions. Its methods live in trainer.cpp (start, the step loop, logging, evaluation, the end),
// trainer_checkpoints.cpp (resume, saves in the foreground and the background) and trainer_resilience.cpp
// (fault injection, the step's judgement hooks, rollback).
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "forge/ckpt/async_save.h"
#include "forge/ckpt/checkpoint.h"
#include "forge/ckpt/sharded.h"
#include "forge/sim/estimate.h"
#include "forge/train/faults.h"
#include "forge/train/metrics.h"
#include "forge/train/pipelining.h"
#include "forge/train/resilience.h"
#include "forge/train/run_directory.h"
#include "forge/train/run_log.h"
#include "forge/train/setup.h"
#include "forge/train/step.h"
#include "forge/train/train_state.h"
#include "forge/train/trainer.h"

namespace forge::train::detail {
namespace fs = std::filesystem;
using ckpt::AsyncCheckpointSave;
using ckpt::CheckpointState;
using ckpt::NamedFile;

using Clock = std::chrono::steady_clock;
inline double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// One run of the loop: the setup, the state, and what the loop decides with them.
class TrainingRun {
 public:
  TrainingRun(const TrainConfig& c, comm::Communicator& world, const TrainerHooks& hooks)
      : c_(c), world_(world), hooks_(hooks), log_(world.rank() == 0), start_time_(Clock::now()) {}
  TrainResult run();

 private:
  void decide_start();
  void resume();
  void open_metrics();
  void print_banner();
  // A failed periodic save is reported and training goes on (the previous checkpoint stays the newest); a
  // final or Ctrl-C save's error ends the run. background: written by AsyncCheckpointSave.
  void save(const char* why, bool background = false);
  void commit_async_save();  // collective: waits for the save in flight and commits it
  void after_commit(int64_t step, const std::string& dir, const char* why, double seconds,
                    double blocked_seconds);
  CheckpointState load_state(const fs::path& dir);
  void build_step_hooks();
  void strike_before_step();
  void roll_back(const std::string& cause, TrainResult& result);
  void write_heartbeat();
  void take_snapshot() {
    const auto start = Clock::now();
    snapshots_.take(state_);
    snapshot_seconds_.push_back(seconds_since(start));
  }
  void write_metrics(const nlohmann::json& record) {
    if (metrics_) metrics_->write(record);
  }
  bool stop_before_step(TrainResult& result);
  bool run_step(TrainResult& result);
  void log_step(const StepResult& r, TrainResult& result);
  bool evaluate_now();
  void plan_length();
  TrainResult finish(TrainResult result);
  void sample(TrainResult& result);
  void caption(TrainResult& result);  // sample.captions (image-text data)
  models::Model& generation_model(std::unique_ptr<models::Model>& whole);
  void write_report();  // <run_dir>/report.html (log.report), on the first rank

  const TrainConfig& c_;
  comm::Communicator& world_;
  const TrainerHooks& hooks_;
  const RunLog log_;
  const Clock::time_point start_time_;
  std::unique_ptr<TrainSetup> setup_;
  TrainState state_;
  std::unique_ptr<Schedule> schedule_;  // NoPipelining, or Pipelining under pp > 1
  Pipelining* pipelining_ = nullptr;    // schedule_ when it pipelines
  fs::path run_dir_, checkpoint_dir_;
  DirectoryLock run_dir_lock_, checkpoint_dir_lock_;
  ResumeDecision decision_;
  // The step whose checkpoint is already committed in checkpoint_dir (-1: none), so that saving it again
  // (Ctrl-C right after a resume) is skipped.
  int64_t committed_step_ = -1;
  std::optional<MetricsWriter> metrics_;
  std::vector<NamedFile> checkpoint_files_;
  double flops_per_token_ = 0, flops_per_image_ = 0, peak_gflops_ = 0;
  int64_t step_tokens_ = 0, heldout_windows_ = 0;
  bool plan_steps_ = false;
  Clock::time_point train_start_, interval_start_;
  int64_t interval_tokens_ = 0, interval_images_ = 0, first_step_ = 0;
  double first_step_seconds_ = 0;
  // log.hardware_profile: the simulator's prediction, and what the run measured to compare with it.
  std::optional<sim::Estimate> prediction_;
  std::vector<double> step_seconds_;
  void predict();
  void compare_with_prediction();
  // Resilience (resilience.h, faults.h).
  FaultPlan faults_;
  std::optional<SpikeDetector> detector_;
  SnapshotRing snapshots_;
  std::vector<double> snapshot_seconds_;  // each in-memory snapshot's time (the training thread waits)
  StepHooks step_hooks_;
  int64_t retries_ = 0;                        // rollbacks since the last stable state past an anomaly
  int64_t last_anomaly_step_ = 0;              // the step of the latest anomaly (0: none)
  std::vector<std::string> rollback_account_;  // one entry per rollback of the current run of retries
  std::vector<std::string> resume_notes_;      // damaged checkpoints resume skipped, for metrics.jsonl
  // The periodic save being written in the background (at most one), and why it was taken; the host copy it
  // writes from, kept between saves (declared first: it outlives the save).
  std::vector<float> async_buffer_;
  std::unique_ptr<AsyncCheckpointSave> async_save_;
  std::string async_reason_;
  Clock::time_point async_started_;
};

}  // namespace forge::train::detail
