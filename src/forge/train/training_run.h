// The training loop's class, internal to forge's train layer (not an API): one run of the loop. It builds
// the run's parts and decides, step by step, when each acts: the setup (setup.h), the state
// (train_state.h), the step (step.h), checkpoints (checkpointing.h), recovery from anomalies (recovery.h),
// evaluation and sampling (evaluation.h), and the progress log (progress_log.h).
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>

#include "forge/train/checkpointing.h"
#include "forge/train/evaluation.h"
#include "forge/train/faults.h"
#include "forge/train/metrics.h"
#include "forge/train/pipelining.h"
#include "forge/train/progress_log.h"
#include "forge/train/recovery.h"
#include "forge/train/run_directory.h"
#include "forge/train/run_log.h"
#include "forge/train/setup.h"
#include "forge/train/step.h"
#include "forge/train/train_state.h"
#include "forge/train/trainer.h"

namespace forge::train::detail {

class TrainingRun {
 public:
  using Clock = std::chrono::steady_clock;
  TrainingRun(const TrainConfig& c, comm::Communicator& world, const TrainerHooks& hooks)
      : c_(c), world_(world), hooks_(hooks), log_(world.rank() == 0), start_time_(Clock::now()) {}
  TrainResult run();

 private:
  TrainResult train();
  void set_up();
  void make_schedule();
  void init_state();
  ResumeDecision decide_start();
  void open_records(const ResumeOutcome& resumed);
  void add_checkpoint_files();
  bool stop_before_step(TrainResult& result);
  bool run_step(TrainResult& result);
  void after_step(int64_t step);
  void plan_length();
  TrainResult finish(TrainResult result);
  void write_report();  // <run_dir>/report.html (log.report), on the first rank
  void write_heartbeat();

  const TrainConfig& c_;
  comm::Communicator& world_;
  const TrainerHooks& hooks_;
  const RunLog log_;
  const Clock::time_point start_time_;
  const std::filesystem::path run_dir_ = c_.log.run_dir;
  DirectoryLock run_dir_lock_, checkpoint_dir_lock_;
  FaultPlan faults_;
  RunRecords records_;
  std::unique_ptr<TrainSetup> setup_;
  TrainState state_;
  std::unique_ptr<Schedule> schedule_;  // NoPipelining, or Pipelining under pp > 1
  Pipelining* pipelining_ = nullptr;    // schedule_ when it pipelines
  std::unique_ptr<Checkpointing> checkpoints_;
  std::unique_ptr<Recovery> recovery_;
  std::unique_ptr<Evaluation> evaluation_;
  std::unique_ptr<ProgressLog> progress_;
  StepHooks step_hooks_;
  // Time-budget mode (train.steps = 0): the length is planned from the measured speed of the first steps.
  bool plan_steps_ = false;
  double first_step_seconds_ = 0;
};

}  // namespace forge::train::detail
