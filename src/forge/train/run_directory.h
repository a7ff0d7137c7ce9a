// What a training run may do with its directories before it writes anything: hold them against other runs,
// decide whether it resumes and from which checkpoint, and trim what a resumed run would otherwise repeat.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>

#include "forge/train/config.h"

namespace forge::train {

// An exclusive lock on a directory (an flock on <dir>/.forge.lock, released when the holder exits, crashed
// or not): two runs writing one run directory or one checkpoint directory would overwrite each other's
// metrics and checkpoints. The file records who holds it, for the refusal's message.
class DirectoryLock {
 public:
  DirectoryLock() = default;
  // Creates `dir` if needed; throws "<dir> is in use by another forge run (pid P on host H, since T) ..."
  // when another process holds it. `key` names the setting that chose the directory (log.run_dir, ...).
  DirectoryLock(const std::filesystem::path& dir, std::string_view key);
  DirectoryLock(DirectoryLock&& other) noexcept : fd_(other.fd_) { other.fd_ = -1; }
  DirectoryLock& operator=(DirectoryLock&& other) noexcept;
  DirectoryLock(const DirectoryLock&) = delete;
  DirectoryLock& operator=(const DirectoryLock&) = delete;
  ~DirectoryLock();

 private:
  int fd_ = -1;
};

struct ResumeDecision {
  std::filesystem::path checkpoint;  // the checkpoint folder to resume from; empty: a fresh run
  std::string note;                  // said to the user when not empty (a fallback, a removal)
  bool from_own_directory = false;   // the checkpoint is the committed latest of checkpoint_dir()
};

// checkpoint.resume and checkpoint.overwrite applied to what checkpoint_dir() holds:
//   auto: its newest complete checkpoint, a fresh run when it holds no checkpoint data, and the
//         "incomplete" error when it holds data but no complete checkpoint;
//   "":   a fresh run; refused when it holds checkpoint data, unless overwrite (which deletes that data);
//   PATH: that checkpoint (a folder or a checkpoint directory); refused, unless overwrite, when
//         checkpoint_dir() holds checkpoints other than PATH's own latest (they would be mixed with or,
//         past PATH's step, replaced by this run's).
// Called on one rank; the caller shares the outcome.
ResumeDecision decide_resume(const TrainConfig& config);

// Keeps the records of <run_dir>/metrics.jsonl up to `step` (a resumed run logs the steps after it anew),
// replacing the file in one step.
void trim_metrics(const std::filesystem::path& run_dir, int64_t step);

}  // namespace forge::train
