// What the trainer does when a step goes wrong (docs/resilience.md): it judges every step (a NaN or Inf in
// the loss, the gradients or their norm; a loss or gradient-norm spike against the window of recent
// accepted steps; an exception in the step on a one-process run), and rolls back to the last stable state:
// the newest in-memory snapshot (kept every resilience.snapshot_every steps, in host memory), else the newest
// valid checkpoint on disk. Then it skips the data window that led to the anomaly, optionally lowers the
// learning rate for a while, and continues; after resilience.max_retries rollbacks in a row without a new
// stable snapshot in between, the run stops with an account of each.
//
// Every rank reaches the same verdict in the same step: the loss and gradient norm it is judged on are
// reduced over the world first, and the verdict itself is agreed (train_step).
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>

#include "forge/train/config.h"
#include "forge/train/train_state.h"

namespace forge::train {

// Spike detection against the window of accepted steps that TrainState carries (so that a rollback or a
// resume restores it with the rest).
class SpikeDetector {
 public:
  SpikeDetector(const TrainConfig::Resilience& r, int64_t warmup);
  // The cause when step `step` (1-based) with this loss and gradient norm is a spike, else "".
  std::string judge(const TrainState& state, int64_t step, double loss, double grad_norm) const;
  // Appends an accepted step's values to the state's window (dropping the oldest beyond its length).
  void accept(TrainState& state, double loss, double grad_norm) const;
  static constexpr size_t kMinimumWindow = 10;  // steps in the window before spikes are judged

 private:
  std::string judge_one(const char* what, double value, const std::vector<double>& window, double threshold,
                        double min_rise) const;
  bool ratio_ = true;
  double loss_threshold_ = 0, grad_norm_threshold_ = 0, loss_min_rise_ = 0;
  size_t window_ = 50;
  int64_t after_ = 0;
};

// The in-memory snapshots a rollback restores: the newest ones, taken only after steps that passed
// judgement. Host memory: on a GPU the state is staged to the host.
class SnapshotRing {
 public:
  explicit SnapshotRing(size_t capacity = 2) : capacity_(capacity) {}
  void take(const TrainState& state);  // reuses the oldest slot's buffers once full
  bool empty() const { return snapshots_.empty(); }
  const TrainState::Snapshot& newest() const { return snapshots_.back(); }
  // Drops the newest (a rollback that came back to the same anomaly goes one further back next time).
  void drop_newest() { snapshots_.pop_back(); }
  size_t size() const { return snapshots_.size(); }
  int64_t bytes() const;

 private:
  size_t capacity_;
  std::deque<TrainState::Snapshot> snapshots_;
};

// The data window a rollback skips: the samples of steps restored_step + 1 .. anomaly_step, so that step
// restored_step + 1 continues at the sample the step after the anomaly would have read. Returns the number of
// samples skipped; state's data position (base_step, base_samples) is moved accordingly.
int64_t skip_data_window(TrainState& state, int64_t restored_step, int64_t anomaly_step,
                         int64_t samples_at_anomaly);

}  // namespace forge::train
