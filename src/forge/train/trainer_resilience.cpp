// The trainer's resilience (docs/resilience.md): the faults of drills that strike as a step starts, the
// step's hooks (injection and the spike judgement), and the rollback to the last stable state.
#include <algorithm>
#include <csignal>
#include <cstdio>
#include <fstream>
#include <limits>
#include <thread>

#include "forge/ckpt/checkpoint_dir.h"
#include "forge/comm/comm.h"
#include "forge/core/error.h"
#include "forge/core/fault_injection.h"
#include "forge/kernels/ops.h"
#include "forge/train/training_run.h"

namespace forge::train::detail {
using namespace forge::models;
using namespace forge::ckpt;

// The faults of drills that strike as a step starts (faults.h).
void TrainingRun::strike_before_step() {
  if (faults_.empty()) return;
  const int64_t step = state_.step + 1;
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

void TrainingRun::build_step_hooks() {
  const int rank = world_.rank();
  step_hooks_.on_read = [this, rank](int64_t step, int micro_batch) {
    if (micro_batch == 0)
      if (const Fault* f = faults_.take(FaultKind::data_error, step, rank))
        fail("{}: injected error reading the step's data", FaultPlan::describe(*f));
  };
  step_hooks_.on_micro_batch = [this, rank](int64_t step, int micro_batch) {
    if (micro_batch == 0)
      if (const Fault* f = faults_.take(FaultKind::throw_exception, step, rank))
        fail("{}: injected exception", FaultPlan::describe(*f));
  };
  step_hooks_.on_loss = [this, rank](int64_t step, LossSum& loss) {
    if (faults_.take(FaultKind::nan_loss, step, rank)) loss.sum = std::numeric_limits<double>::quiet_NaN();
    if (faults_.take(FaultKind::inf_loss, step, rank)) loss.sum = std::numeric_limits<double>::infinity();
    if (const Fault* f = faults_.take(FaultKind::spike, step, rank)) loss.sum *= f->factor;
  };
  step_hooks_.on_gradients = [this, rank](int64_t step, ParameterStore& params) {
    // Through tensors and ops: on a GPU the gradients are not host memory.
    if (faults_.take(FaultKind::nan_grad, step, rank)) {
      Tensor nan = Tensor::empty({1}, DType::f32);
      nan.f32()[0] = std::numeric_limits<float>::quiet_NaN();
      params.grads().view(params.grads().numel() / 2, {1}).copy_from(nan);
    }
    if (const Fault* f = faults_.take(FaultKind::grad_spike, step, rank))
      ops::scale_inplace(params.grads().f32(), static_cast<float>(f->factor), params.grads().numel(),
                         params.device());
    if (hooks_.on_gradients) hooks_.on_gradients(step, params);
  };
  step_hooks_.before_update = [this] {
    if (async_save_) async_save_->detach();
  };
  step_hooks_.judge = [this](int64_t step, double loss, double grad_norm) {
    return detector_->judge(state_, step, loss, grad_norm);
  };
}

// An anomaly in step state_.step + 1, agreed by every rank: restore the newest stable state (an in-memory
// snapshot, else the newest valid checkpoint), skip the data window that led here, optionally lower the
// learning rate, and continue; or, with rollback off or the retries spent, end the run with an account.
void TrainingRun::roll_back(const std::string& cause, TrainResult& result) {
  const int64_t step = state_.step + 1;
  write_metrics({{"event", "anomaly"}, {"step", step}, {"cause", cause}});
  auto stop = [&](const std::string& why) {
    // A save in flight holds a state from before the anomaly: it commits before the run ends (every rank
    // is here: the verdict is agreed).
    if (async_save_) commit_async_save();
    const std::string last = committed_step_ >= 0 ? fmt::format("the last checkpoint is step {} in {}",
                                                                committed_step_, checkpoint_dir_.string())
                                                  : std::string("no checkpoint of this run was saved");
    std::string account;
    for (const std::string& a : rollback_account_) account += "; " + a;
    fail("step {}: {}; the update was not applied and nothing was saved ({}){}{}", step, cause, last, why,
         account);
  };
  if (!c_.resilience.rollback) stop("");
  if (retries_ >= c_.resilience.max_retries)
    stop(fmt::format("; {} rollbacks in a row did not get past it (resilience.max_retries = {})", retries_,
                     c_.resilience.max_retries));
  if (async_save_) commit_async_save();  // a state from before the anomaly: it commits as it was
  const int64_t samples_at_anomaly = state_.first_sample_of(state_.step);
  // The first response keeps the state (the step's update was never applied: it is the state after step
  // k - 1) and skips the step's samples: a single bad batch costs one step. If the anomaly comes back, the
  // newest snapshot; then one further back each time.
  const bool in_place = c_.resilience.skip_first && retries_ == 0;
  const int64_t further_after = c_.resilience.skip_first ? 1 : 0;
  if (retries_ > further_after && step <= last_anomaly_step_ && snapshots_.size() > 1)
    snapshots_.drop_newest();
  std::string restored;
  if (in_place) {
    state_.discard_refused_step();
    restored = fmt::format("nothing (the state of step {}: the update was not applied)", state_.step);
  } else if (!snapshots_.empty()) {
    state_.restore(snapshots_.newest());
    restored = fmt::format("the in-memory snapshot of step {}", state_.step);
  } else {
    // The newest checkpoint on disk that loads (a damaged one is skipped).
    const std::vector<std::string> dirs = complete_checkpoints(checkpoint_dir_.string());
    for (const std::string& dir : dirs) {
      try {
        load_state(dir);
        restored = fmt::format("checkpoint {}", dir);
        break;
      } catch (const Error& e) {
        log_.say("checkpoint %s does not load (%s): skipped\n", dir.c_str(), e.what());
      }
    }
    if (restored.empty())
      stop(c_.resilience.snapshot_every > 0
               ? "; there is no stable state to roll back to yet"
               : "; there is no stable state to roll back to (resilience.snapshot_every = 0 and no valid "
                 "checkpoint)");
  }
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
  committed_step_ = -1;  // the state now differs from every checkpoint: the next save is made
  // The steps rolled back are not part of this run's losses.
  const int64_t kept = std::max<int64_t>(0, restored_step - first_step_);
  if (static_cast<int64_t>(result.losses.size()) > kept) {
    result.losses.resize(static_cast<size_t>(kept));
    result.grad_norms.resize(static_cast<size_t>(kept));
  }
  if (restored_step < first_step_) first_step_ = restored_step;
  ++result.rollbacks;
  const std::string lr =
      state_.lr_scale_until > restored_step + 1
          ? fmt::format(", learning rate x{:g} until step {}", state_.lr_scale, state_.lr_scale_until - 1)
          : std::string();
  const std::string what = fmt::format(
      "rollback {} of at most {} at step {} ({}): restored {}, skipped {} samples (steps {}-{}){}", retries_,
      c_.resilience.max_retries, step, cause, restored, skipped, restored_step + 1, step, lr);
  rollback_account_.push_back(
      fmt::format("rollback {} at step {} to step {}", retries_, step, restored_step));
  log_.say("%s\n", what.c_str());
  write_metrics({{"event", "rollback"},
                 {"step", step},
                 {"cause", cause},
                 {"restored", restored},
                 {"restored_step", restored_step},
                 {"skipped_samples", skipped},
                 {"skipped_steps", c_.resilience.skip == SkipData::window ? step - restored_step : 0},
                 {"retry", retries_},
                 {"lr_scale", state_.lr_scale_until > restored_step + 1 ? state_.lr_scale : 1.0}});
  interval_start_ = Clock::now();
  interval_tokens_ = 0, interval_images_ = 0;
}

// <run_dir>/heartbeat, rewritten after every step on the first rank: `forge launch --heartbeat` restarts a
// job whose heartbeat stops (a rank that hangs stalls every rank at its next collective).
void TrainingRun::write_heartbeat() {
  if (!log_.leader()) return;
  std::ofstream out(run_dir_ / "heartbeat", std::ios::trunc);
  out << state_.step << "\n";
}

}  // namespace forge::train::detail
