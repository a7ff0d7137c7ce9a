// Fault injection for drills and tests (docs/resilience.md): faults a run inflicts on itself at a chosen step
// and rank, so that every path of recovery is exercised the way a real fault would take it. Written in
// [resilience] inject or the FORGE_FAULT environment variable (both apply), as faults separated by ';':
//
//   <kind> step=<k> [rank=<r>] [times=<n>] [factor=<f>] [attempt=<a>|any]
//
//   nan_loss | inf_loss   the loss of step k on rank r is NaN / +Inf (before it is reduced)
//   nan_grad              a gradient of step k on rank r is NaN (after the reduction, as a bad copy would be)
//   spike                 the loss of step k on rank r is multiplied by factor (default 100)
//   grad_spike            the gradients of step k on rank r are multiplied by factor (default 100)
//   data_error            reading step k's data fails on rank r (an exception, agreed over the ranks)
//   throw                 an exception inside step k's compute on rank r (as its schedule takes the first
//                         micro-batch)
//   kill                  SIGKILL of rank r as step k starts
//   hang                  rank r stops responding as step k starts (it sleeps until killed)
//   disk_full             the save of step k fails on rank r with "No space left on device"
//   corrupt_checkpoint    after the checkpoint of step k is committed, one byte of rank r's shard flips
//   truncate_checkpoint   ... rank r's shard loses its second half
//
// rank: the world rank (default: every rank; the checkpoint faults default to rank 0). times: how often the
// fault fires, counting re-runs of step k after a rollback (default 1: a transient fault; 0 = every time: a
// persistent one). attempt: the `forge launch` attempt it fires in (FORGE_LAUNCH_ATTEMPT; default 0, the
// first run, so that a restarted job does not meet it again; any = every attempt).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace forge::train {

enum class FaultKind {
  nan_loss,
  inf_loss,
  nan_grad,
  spike,
  grad_spike,
  data_error,
  throw_exception,
  kill,
  hang,
  disk_full,
  corrupt_checkpoint,
  truncate_checkpoint
};

struct Fault {
  FaultKind kind = FaultKind::nan_loss;
  int64_t step = 0;
  int rank = -1;      // -1: every rank
  int64_t times = 1;  // 0: every time
  double factor = 100;
  int attempt = 0;  // -1: any
  int64_t fired = 0;
};

class FaultPlan {
 public:
  // Parses `text` (the grammar above); errors name `origin` and the fault ("resilience.inject: fault 2
  // 'nan_los step=3': unknown kind 'nan_los'; did you mean 'nan_loss'?").
  static FaultPlan parse(std::string_view text, std::string_view origin);
  // [resilience] inject and then FORGE_FAULT, for the launch attempt FORGE_LAUNCH_ATTEMPT names (default 0).
  static FaultPlan for_run(const std::string& inject, std::string_view inject_origin);

  bool empty() const { return faults_.empty(); }
  const std::vector<Fault>& faults() const { return faults_; }
  // The fault of `kind` due at `step` on `rank` in this attempt, marked as fired once more; null if none.
  const Fault* take(FaultKind kind, int64_t step, int rank);
  // "nan_loss at step 5 on rank 1" (one fault, for log lines).
  static std::string describe(const Fault& f);
  static const char* name(FaultKind kind);

 private:
  std::vector<Fault> faults_;
  int attempt_ = 0;
};

// A byte of `file` flipped (in the middle of its data) or its second half cut off: what the checkpoint
// faults do to a shard.
void corrupt_file(const std::string& file, bool truncate);

}  // namespace forge::train
