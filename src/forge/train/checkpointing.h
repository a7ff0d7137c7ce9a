// The run's checkpoints: resuming (past a damaged newest checkpoint under resume = auto), loading a
// checkpoint into the state (a resume, a rollback from disk), and saving in the foreground or the background
// (ckpt/async_save.h), with the checkpoint faults of drills. It owns everything a run knows about its
// checkpoint directory: which step is committed there, the save in flight, and the files every checkpoint
// carries beside the tensors (tokenizer.json, preprocessor_config.json).
#pragma once

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "forge/ckpt/async_save.h"
#include "forge/ckpt/checkpoint.h"
#include "forge/ckpt/sharded.h"
#include "forge/train/config.h"
#include "forge/train/faults.h"
#include "forge/train/metrics.h"
#include "forge/train/run_directory.h"
#include "forge/train/run_log.h"
#include "forge/train/setup.h"
#include "forge/train/train_state.h"

namespace forge::train {

// Where a resume started, and what it passed over on the way (one note per damaged checkpoint skipped).
struct ResumeOutcome {
  std::filesystem::path from;
  std::vector<std::string> skipped;
};

class Checkpointing {
 public:
  // on_saved: called after each commit with the step and why it was saved (may be empty).
  Checkpointing(const TrainConfig& config, comm::Communicator& world, const RunLog& log, RunRecords& records,
                FaultPlan& faults, TrainSetup& setup, TrainState& state,
                std::function<void(int64_t, const std::string&)> on_saved = {});
  ~Checkpointing();
  Checkpointing(const Checkpointing&) = delete;
  Checkpointing& operator=(const Checkpointing&) = delete;

  const std::filesystem::path& dir() const { return dir_; }

  // Collective. Loads the decided checkpoint into the state; under resume = auto a checkpoint of the run's
  // own directory that does not load (a flipped byte, a truncated shard, a NaN written by a failing disk) is
  // reported and skipped for the next older complete one, never used, never deleted. A checkpoint of another
  // run (model, tokenizer, sequence length, weights only) is refused, not skipped.
  ResumeOutcome resume(const ResumeDecision& decision);
  // Collective. Loads checkpoint folder `dir` into the state and returns its manifest.
  ckpt::CheckpointState load(const std::filesystem::path& dir);
  // Collective. The newest checkpoint of the directory that loads, loaded (the damaged ones are reported
  // and skipped); "" when none does.
  std::string load_newest();

  // A file every later checkpoint carries (listed and checksummed in its manifest).
  void add_file(std::string name, std::string text);
  // Background saves copy into a host buffer; allocating (and faulting in) it up front keeps that out of
  // the step of the first save. `floats`: what a rank saves at most.
  void reserve_background_buffer(int64_t floats);

  // Collective. Saves the state's step, unless that step is already committed here. A failed periodic save
  // is reported and training goes on (the previous checkpoint stays the newest); any other save's error
  // ends the run. background: written by a thread while training goes on, committed by commit_pending().
  void save(const char* why, bool background = false);
  bool pending() const { return async_ != nullptr; }
  // Whether this rank has written its shard of the save in flight (true when none is).
  bool pending_written() const { return !async_ || async_->written(); }
  // Collective: waits for the save in flight and commits it.
  void commit_pending();
  // The state is about to change under a save in flight: it copies what it still needs first.
  void detach_pending() {
    if (async_) async_->detach();
  }

  // The step whose checkpoint is committed in dir() (-1: none this run), so that saving it again (Ctrl-C
  // right after a resume) is skipped.
  int64_t committed_step() const { return committed_step_; }
  // The state now differs from every checkpoint of that step (a rollback): the next save is made.
  void forget_committed() { committed_step_ = -1; }
  // "the newest checkpoint is still step N" / "no checkpoint of this run is saved yet", for messages.
  std::string newest_description() const;

 private:
  void after_commit(int64_t step, const std::string& dir, const std::string& why, double seconds,
                    double blocked_seconds);
  void report_failed_save(int64_t step, const std::string& why, const std::string& error);
  ckpt::CheckpointState manifest_to_save(const char* why) const;

  const TrainConfig& c_;
  comm::Communicator& world_;
  const RunLog& log_;
  RunRecords& records_;
  FaultPlan& faults_;
  TrainSetup& setup_;
  TrainState& state_;
  std::function<void(int64_t, const std::string&)> on_saved_;
  const std::filesystem::path dir_;
  int64_t committed_step_ = -1;
  std::vector<ckpt::NamedFile> files_;
  // The periodic save being written in the background (at most one), why it was taken and when; the host
  // copy it writes from, kept between saves (declared first: it outlives the save).
  std::vector<float> async_buffer_;
  std::unique_ptr<ckpt::AsyncCheckpointSave> async_;
  std::string async_reason_;
  std::chrono::steady_clock::time_point async_started_;
};

}  // namespace forge::train
