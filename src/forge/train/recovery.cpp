#include "forge/train/recovery.h"

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <limits>
#include <nlohmann/json.hpp>
#include <thread>

#include "forge/core/error.h"
#include "forge/kernels/emulated_device.h"
#include "forge/kernels/ops.h"

namespace forge::train {
using Clock = std::chrono::steady_clock;

Recovery::Recovery(const TrainConfig& config, comm::Communicator& world, const RunLog& log,
                   RunRecords& records, FaultPlan& faults, TrainState& state, Checkpointing& checkpoints)
    : c_(config),
      world_(world),
      log_(log),
      records_(records),
      faults_(faults),
      state_(state),
      checkpoints_(checkpoints),
      detector_(config.resilience, config.train.warmup) {}

void Recovery::strike_before_step(int64_t step) {
  if (faults_.empty()) return;
  const int rank = world_.rank();
  if (const Fault* f = faults_.take(FaultKind::kill, step, rank)) {
    std::fprintf(stderr, "forge: fault injection: %s: SIGKILL\n", FaultPlan::describe(*f).c_str());
    std::fflush(stderr);
    std::raise(SIGKILL);
  }
  if (const Fault* f = faults_.take(FaultKind::hang, step, rank)) {
    std::fprintf(stderr, "forge: fault injection: %s: this rank stops responding\n",
                 FaultPlan::describe(*f).c_str());
    std::fflush(stderr);
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  }
}

StepHooks Recovery::step_hooks(std::function<void(int64_t, ParameterStore&)> on_gradients) {
  const int rank = world_.rank();
  StepHooks hooks;
  hooks.on_read = [this, rank](int64_t step, int micro_batch) {
    if (micro_batch == 0)
      if (const Fault* f = faults_.take(FaultKind::data_error, step, rank))
        fail("{}: injected error reading the step's data", FaultPlan::describe(*f));
  };
  hooks.on_micro_batch = [this, rank](int64_t step, int micro_batch) {
    if (micro_batch == 0)
      if (const Fault* f = faults_.take(FaultKind::throw_exception, step, rank))
        fail("{}: injected exception", FaultPlan::describe(*f));
  };
  hooks.on_loss = [this, rank](int64_t step, models::LossSum& loss) {
    if (faults_.take(FaultKind::nan_loss, step, rank)) loss.sum = std::numeric_limits<double>::quiet_NaN();
    if (faults_.take(FaultKind::inf_loss, step, rank)) loss.sum = std::numeric_limits<double>::infinity();
    if (const Fault* f = faults_.take(FaultKind::spike, step, rank)) loss.sum *= f->factor;
  };
  hooks.on_gradients = [this, rank, on_gradients](int64_t step, ParameterStore& params) {
    // Through tensors and ops: on a GPU the gradients are not host memory.
    if (faults_.take(FaultKind::nan_grad, step, rank)) {
      Tensor nan = Tensor::empty({1}, DType::f32);
      nan.f32()[0] = std::numeric_limits<float>::quiet_NaN();
      params.grads().view(params.grads().numel() / 2, {1}).copy_from(nan);
    }
    if (const Fault* f = faults_.take(FaultKind::grad_spike, step, rank))
      ops::scale_inplace(params.grads().f32(), static_cast<float>(f->factor), params.grads().numel(),
                         params.device());
    if (on_gradients) on_gradients(step, params);
  };
  hooks.before_update = [this] { checkpoints_.detach_pending(); };
  hooks.judge = [this](int64_t step, double loss, double grad_norm) {
    return detector_.judge(state_, step, loss, grad_norm);
  };
  return hooks;
}

void Recovery::take_snapshot() {
  // A dry run's state is zeros at any scale (kernels/emulated_device.h): a host copy of a model far larger
  // than this machine would only exhaust its memory.
  if (EmulatedDevice::check_only()) return;
  const auto start = Clock::now();
  snapshots_.take(state_);
  snapshot_seconds_.push_back(std::chrono::duration<double>(Clock::now() - start).count());
}

void Recovery::start() {
  if (c_.resilience.rollback && c_.resilience.snapshot_every > 0) take_snapshot();
}

void Recovery::accept(double loss, double grad_norm) {
  detector_.accept(state_, loss, grad_norm);
  const int64_t step = state_.step;
  // A stable state: the rollback target. Past the latest anomaly it also ends that run of retries.
  if (c_.resilience.rollback && c_.resilience.snapshot_every > 0 &&
      step % c_.resilience.snapshot_every == 0) {
    take_snapshot();
    if (step > last_anomaly_step_) retries_ = 0, account_.clear();
  }
}

void Recovery::stop(int64_t step, const std::string& cause, const std::string& why) {
  // A save in flight holds a state from before the anomaly: it commits before the run ends (every rank is
  // here: the verdict is agreed).
  checkpoints_.commit_pending();
  const std::string last = checkpoints_.committed_step() >= 0
                               ? fmt::format("the last checkpoint is step {} in {}",
                                             checkpoints_.committed_step(), checkpoints_.dir().string())
                               : std::string("no checkpoint of this run was saved");
  std::string account;
  for (const std::string& a : account_) account += "; " + a;
  fail("step {}: {}; the update was not applied and nothing was saved ({}){}{}", step, cause, last, why,
       account);
}

// The state a retry of step `step` starts from: the first response keeps the state (the step's update was
// never applied: it is the state after step k - 1) and skips the step's samples, so a single bad batch costs
// one step. If the anomaly comes back, the newest snapshot; then one further back each time; without
// snapshots the newest checkpoint that loads. Returns what was restored ("" when nothing could be).
std::string Recovery::restore_for_retry(int64_t step) {
  const bool in_place = c_.resilience.skip_first && retries_ == 0;
  const int64_t further_after = c_.resilience.skip_first ? 1 : 0;
  if (retries_ > further_after && step <= last_anomaly_step_ && snapshots_.size() > 1)
    snapshots_.drop_newest();
  if (in_place) {
    state_.discard_refused_step();
    return fmt::format("nothing (the state of step {}: the update was not applied)", state_.step);
  }
  if (!snapshots_.empty()) {
    state_.restore(snapshots_.newest());
    return fmt::format("the in-memory snapshot of step {}", state_.step);
  }
  const std::string dir = checkpoints_.load_newest();
  return dir.empty() ? "" : fmt::format("checkpoint {}", dir);
}

int64_t Recovery::roll_back(const std::string& cause) {
  const int64_t step = state_.step + 1;
  records_.write({{"event", "anomaly"}, {"step", step}, {"cause", cause}});
  if (!c_.resilience.rollback) stop(step, cause, "");
  if (retries_ >= c_.resilience.max_retries)
    stop(step, cause,
         fmt::format("; {} rollbacks in a row did not get past it (resilience.max_retries = {})", retries_,
                     c_.resilience.max_retries));
  checkpoints_.commit_pending();  // a state from before the anomaly: it commits as it was
  const int64_t samples_at_anomaly = state_.first_sample_of(state_.step);
  const std::string restored = restore_for_retry(step);
  if (restored.empty())
    stop(step, cause,
         c_.resilience.snapshot_every > 0
             ? "; there is no stable state to roll back to yet"
             : "; there is no stable state to roll back to (resilience.snapshot_every = 0 and no valid "
               "checkpoint)");
  const int64_t restored_step = state_.step;
  int64_t skipped = 0;
  if (c_.resilience.skip == SkipData::window)
    skipped = skip_data_window(state_, restored_step, step, samples_at_anomaly);
  if (c_.resilience.lr_factor < 1 && c_.resilience.lr_steps > 0) {
    state_.lr_scale = c_.resilience.lr_factor;
    state_.lr_scale_until = restored_step + 1 + c_.resilience.lr_steps;
  }
  ++retries_;
  last_anomaly_step_ = std::max(last_anomaly_step_, step);
  checkpoints_.forget_committed();  // the state now differs from every checkpoint: the next save is made
  const std::string lr =
      state_.lr_scale_until > restored_step + 1
          ? fmt::format(", learning rate x{:g} until step {}", state_.lr_scale, state_.lr_scale_until - 1)
          : std::string();
  account_.push_back(fmt::format("rollback {} at step {} to step {}", retries_, step, restored_step));
  log_.say(
      "rollback %lld of at most %lld at step %lld (%s): restored %s, skipped %lld samples (steps "
      "%lld-%lld)%s\n",
      static_cast<long long>(retries_), static_cast<long long>(c_.resilience.max_retries),
      static_cast<long long>(step), cause.c_str(), restored.c_str(), static_cast<long long>(skipped),
      static_cast<long long>(restored_step + 1), static_cast<long long>(step), lr.c_str());
  records_.write({{"event", "rollback"},
                  {"step", step},
                  {"cause", cause},
                  {"restored", restored},
                  {"restored_step", restored_step},
                  {"skipped_samples", skipped},
                  {"skipped_steps", c_.resilience.skip == SkipData::window ? step - restored_step : 0},
                  {"retry", retries_},
                  {"lr_scale", state_.lr_scale_until > restored_step + 1 ? state_.lr_scale : 1.0}});
  return restored_step;
}

void Recovery::report_snapshots(int64_t rollbacks) const {
  if (snapshot_seconds_.size() <= 1) return;
  // The median: the first snapshots also allocate (and fault in) their buffers.
  std::vector<double> sorted = snapshot_seconds_;
  std::sort(sorted.begin(), sorted.end());
  const double median = sorted[sorted.size() / 2];
  log_.say(
      "resilience: %zu in-memory snapshots of %.1f MiB each (host memory held: %.1f MiB), %.1f ms each "
      "(median; the first, which allocates, %.1f ms); %lld rollbacks\n",
      snapshot_seconds_.size(),
      static_cast<double>(snapshots_.bytes()) / static_cast<double>(snapshots_.size()) / 1048576.0,
      static_cast<double>(snapshots_.bytes()) / 1048576.0, 1e3 * median, 1e3 * snapshot_seconds_[0],
      static_cast<long long>(rollbacks));
  records_.write({{"event", "snapshots"},
                  {"step", state_.step},
                  {"count", snapshot_seconds_.size()},
                  {"seconds_median", median},
                  {"seconds_first", snapshot_seconds_[0]},
                  {"host_bytes", snapshots_.bytes()}});
}

}  // namespace forge::train
