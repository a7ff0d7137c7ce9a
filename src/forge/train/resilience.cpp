#include "forge/train/resilience.h"

#include <algorithm>
#include <cmath>

#include "forge/core/error.h"

namespace forge::train {

SpikeDetector::SpikeDetector(const TrainConfig::Resilience& r, int64_t warmup)
    : ratio_(r.spike_metric == SpikeMetric::ratio),
      loss_threshold_(r.loss_spike),
      grad_norm_threshold_(r.grad_norm_spike),
      loss_min_rise_(r.loss_spike_min),
      window_(static_cast<size_t>(r.window)),
      after_(r.spike_after >= 0 ? r.spike_after : warmup) {}

std::string SpikeDetector::judge_one(const char* what, double value, const std::vector<double>& window,
                                     double threshold, double min_rise) const {
  if (threshold <= 0 || window.size() < kMinimumWindow) return "";
  if (ratio_) {
    std::vector<double> sorted = window;
    std::nth_element(sorted.begin(), sorted.begin() + sorted.size() / 2, sorted.end());
    const double median = sorted[sorted.size() / 2];
    if (median > 0 && value > threshold * median && value - median >= min_rise)
      return fmt::format(
          "{} spike: {:.4g} is {:.2f}x the median {:.4g} of the last {} steps (resilience.{}_spike "
          "= {:g})",
          what, value, value / median, median, window.size(),
          std::string_view(what) == "loss" ? "loss" : "grad_norm", threshold);
    return "";
  }
  double mean = 0, var = 0;
  for (double v : window) mean += v;
  mean /= static_cast<double>(window.size());
  for (double v : window) var += (v - mean) * (v - mean);
  const double std = std::sqrt(var / static_cast<double>(window.size() - 1));
  // A flat window (std 0) judges nothing: any change would be infinitely many deviations.
  if (std > 0 && (value - mean) / std > threshold && value - mean >= min_rise)
    return fmt::format(
        "{} spike: {:.4g} is {:.1f} standard deviations above the mean {:.4g} of the last {} "
        "steps (resilience.{}_spike = {:g})",
        what, value, (value - mean) / std, mean, window.size(),
        std::string_view(what) == "loss" ? "loss" : "grad_norm", threshold);
  return "";
}

std::string SpikeDetector::judge(const TrainState& state, int64_t step, double loss, double grad_norm) const {
  if (step <= after_) return "";
  std::string cause = judge_one("loss", loss, state.recent_losses, loss_threshold_, loss_min_rise_);
  if (cause.empty())
    cause = judge_one("gradient norm", grad_norm, state.recent_grad_norms, grad_norm_threshold_, 0);
  return cause;
}

void SpikeDetector::accept(TrainState& state, double loss, double grad_norm) const {
  auto push = [&](std::vector<double>& w, double v) {
    w.push_back(v);
    if (w.size() > window_) w.erase(w.begin(), w.begin() + static_cast<std::ptrdiff_t>(w.size() - window_));
  };
  push(state.recent_losses, loss);
  push(state.recent_grad_norms, grad_norm);
}

void SnapshotRing::take(const TrainState& state) {
  if (snapshots_.size() == capacity_) {
    TrainState::Snapshot reused = std::move(snapshots_.front());
    snapshots_.pop_front();
    state.snapshot_into(reused);
    snapshots_.push_back(std::move(reused));
    return;
  }
  snapshots_.emplace_back();
  state.snapshot_into(snapshots_.back());
}

int64_t SnapshotRing::bytes() const {
  int64_t total = 0;
  for (const TrainState::Snapshot& s : snapshots_)
    total += static_cast<int64_t>((s.params.size() + s.masters.size() + s.exp_avg.size() +
                                   s.exp_avg_sq.size() + s.fp8_history.size() + s.fp8_scales.size()) *
                                      sizeof(float) +
                                  s.params_bf16.size() * sizeof(uint16_t));
  return total;
}

int64_t skip_data_window(TrainState& state, int64_t restored_step, int64_t anomaly_step,
                         int64_t samples_at_anomaly) {
  FORGE_CHECK(anomaly_step > restored_step, "a rollback from step {} to step {} goes forward", anomaly_step,
              restored_step);
  const int64_t resume_at =
      samples_at_anomaly + state.samples_per_step;  // the sample after the anomalous step
  const int64_t skipped = resume_at - state.first_sample_of(restored_step);
  state.base_step = restored_step;
  state.base_samples = resume_at;
  return skipped;
}

}  // namespace forge::train
