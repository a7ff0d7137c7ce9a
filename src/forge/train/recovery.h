// The run's recovery from anomalies (docs/resilience.md): the faults of drills, the spike judgement of every
// step, the in-memory snapshots, and the rollback to the last stable state. It owns what a run of retries
// remembers (how many rollbacks since the last stable state, the latest anomaly, the account of each) and
// leaves everything that is saved in TrainState (the window of recent losses, the learning-rate scale), so
// that a resume restores it.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "forge/train/checkpointing.h"
#include "forge/train/config.h"
#include "forge/train/faults.h"
#include "forge/train/metrics.h"
#include "forge/train/resilience.h"
#include "forge/train/run_log.h"
#include "forge/train/step.h"
#include "forge/train/train_state.h"

namespace forge::train {

class Recovery {
 public:
  Recovery(const TrainConfig& config, comm::Communicator& world, const RunLog& log, RunRecords& records,
           FaultPlan& faults, TrainState& state, Checkpointing& checkpoints);

  // The faults of drills that strike as step `step` (1-based) starts on this rank: SIGKILL, a hang.
  void strike_before_step(int64_t step);
  // A step's hooks: the drills' faults, the spike judgement, the save in flight let go of before the
  // update, and `on_gradients` (a caller's) after the gradient faults.
  StepHooks step_hooks(std::function<void(int64_t, ParameterStore&)> on_gradients = {});

  // The first stable state, before the first step: what a rollback before the first periodic snapshot
  // restores (when snapshots are on).
  void start();
  // Step state.step passed judgement: its loss and gradient norm join the window; every
  // resilience.snapshot_every steps a snapshot is taken, and past the latest anomaly that ends the run of
  // retries.
  void accept(double loss, double grad_norm);

  // An anomaly in step state.step + 1, agreed by every rank (collective): restores the newest stable state
  // (nothing for a first response with skip_first, else an in-memory snapshot, else the newest valid
  // checkpoint), skips the data window that led here, optionally lowers the learning rate, and returns the
  // step restored. With rollback off, the retries spent or nothing to restore, ends the run instead: an
  // Error with the account of every rollback of this run of retries.
  int64_t roll_back(const std::string& cause);

  // At the end of the run: the snapshots' cost, as a line and a record (nothing before a second snapshot).
  void report_snapshots(int64_t rollbacks) const;
  int64_t retries() const { return retries_; }

 private:
  [[noreturn]] void stop(int64_t step, const std::string& cause, const std::string& why);
  void take_snapshot();
  std::string restore_for_retry(int64_t step);

  const TrainConfig& c_;
  comm::Communicator& world_;
  const RunLog& log_;
  RunRecords& records_;
  FaultPlan& faults_;
  TrainState& state_;
  Checkpointing& checkpoints_;
  SpikeDetector detector_;
  SnapshotRing snapshots_;
  std::vector<double> snapshot_seconds_;  // each in-memory snapshot's time (the training thread waits)
  int64_t retries_ = 0;                   // rollbacks since the last stable state past an anomaly
  int64_t last_anomaly_step_ = 0;         // the step of the latest anomaly (0: none)
  std::vector<std::string> account_;      // one entry per rollback of the current run of retries
};

}  // namespace forge::train
