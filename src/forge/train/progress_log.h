// What a run says about its progress: the banner, a line and a metrics record per logged step (loss, rates,
// model FLOP/s and MFU against the job's measured or given peak, ETA, the experts' balance), the simulator's
// prediction at the start (log.hardware_profile) and how the run compared at the end, and the closing
// statistics of data- and context-parallel communication. It owns the run's clocks and throughput counters.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "forge/sim/estimate.h"
#include "forge/train/config.h"
#include "forge/train/metrics.h"
#include "forge/train/run_log.h"
#include "forge/train/setup.h"
#include "forge/train/step.h"
#include "forge/train/train_state.h"

namespace forge::train {

class ProgressLog {
 public:
  using Clock = std::chrono::steady_clock;
  // run_start: when the run began (before its setup), for the elapsed time.
  ProgressLog(const TrainConfig& config, comm::Communicator& world, const RunLog& log, RunRecords& records,
              const TrainSetup& setup, const TrainState& state, Clock::time_point run_start);

  // Collective (the job's peak is the sum of the ranks'): measures or takes the peak, then prints the model,
  // precision, batch and layout lines.
  void banner();
  // log.hardware_profile: the simulator's estimate of this run, printed and recorded.
  void predict();

  // The training loop starts at the state's step: the clocks and counters start now.
  void start();
  // Before each step: with a prediction, the allocator's peak restarts at the second step (the first
  // allocates what stays), so that the run's steady peak is compared.
  void before_step();
  // An applied step that took `seconds`: counted, and on logging steps (log.every, the first and the last)
  // a line and a record. Collective on logging steps (the peak memory is the ranks' largest).
  void step(const StepResult& r, double seconds);
  // A rollback to `restored_step`: the interval's counters start again, and steps before it count as
  // the run's first.
  void rolled_back(int64_t restored_step);

  int64_t first_step() const { return first_step_; }  // the state's step at start() (or a rollback's)
  double seconds_since_start() const;                 // since start()

  // At the end: the prediction against the steps' median time and the allocator's peak (collective), and
  // the data- and context-parallel communication's totals.
  void finish();

 private:
  const TrainConfig& c_;
  comm::Communicator& world_;
  const RunLog& log_;
  RunRecords& records_;
  const TrainSetup& setup_;
  const TrainState& state_;
  const Clock::time_point run_start_;
  double flops_per_token_ = 0, flops_per_image_ = 0, peak_gflops_ = 0;
  int64_t step_tokens_ = 0;
  Clock::time_point start_, interval_start_;
  int64_t interval_tokens_ = 0, interval_images_ = 0, first_step_ = 0;
  std::vector<double> step_seconds_;
  std::optional<sim::Estimate> prediction_;
  void compare_with_prediction();
};

}  // namespace forge::train
