// Asynchronous checkpoints: the training step blocks only while the state is copied to host memory; the
// shard is written, checksummed and fsynced by a background thread while training goes on, and the
// manifest (the commit point, checkpoint_dir.h) is written last, once every rank has reported its shard
// written. So a crash at any moment of a background save leaves the previous checkpoint valid, and the new
// one exists only when it is whole.
//
// The background thread does no communication (MPI and NCCL calls stay on the training thread); the ranks
// agree that every shard is written with an all-reduce the caller already makes between steps (any_pending
// below), and then call finish() together.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "forge/ckpt/checkpoint_dir.h"

namespace forge::ckpt {

class AsyncCheckpointSave {
 public:
  // Collective over `world`: copies every piece's data (and `options.files`) into buffers of its own, makes
  // the staging folder of step folder state.step under `root` (begin_checkpoint_step_save), and starts
  // writing this rank's shard in the background. The pieces' memory may change as soon as it returns.
  // `buffer` (may be null) holds the copy: a caller saving again and again passes the same one, whose memory
  // is then allocated (and faulted in) once rather than at every save; it must outlive the save.
  AsyncCheckpointSave(std::string root, comm::Communicator& world, std::span<const ShardPiece> pieces,
                      CheckpointState state, const CheckpointSaveOptions& options,
                      std::vector<float>* buffer = nullptr);
  ~AsyncCheckpointSave();  // joins the writer; a save never finished is left as a staging folder
  AsyncCheckpointSave(const AsyncCheckpointSave&) = delete;
  AsyncCheckpointSave& operator=(const AsyncCheckpointSave&) = delete;

  int64_t step() const { return state_.step; }
  // This rank's shard is on disk (or its write failed): finish() will not wait.
  bool written() const { return written_.load(std::memory_order_acquire); }
  // Collective: waits for this rank's shard, then commits the checkpoint like save_checkpoint_step (an error
  // on any rank, a full disk say, is thrown on every rank; the previous checkpoint stays the newest).
  // Returns the new checkpoint's folder.
  std::string finish();

  double copy_seconds() const { return copy_seconds_; }    // the step's blocking part
  double write_seconds() const { return write_seconds_; }  // the background write (valid once written)

 private:
  std::string root_;
  comm::Communicator& world_;
  CheckpointState state_;
  int64_t keep_last_ = 0;
  std::vector<NamedFile> files_;
  std::vector<ShardPiece> pieces_;  // pointing into the copy
  std::vector<float> own_buffer_;   // the copy, unless the caller lent a buffer
  std::vector<float>* buffer_ = nullptr;
  std::string staging_;
  ShardWrite result_;
  std::atomic<bool> written_{false};
  double copy_seconds_ = 0, write_seconds_ = 0;
  std::thread writer_;
  bool finished_ = false;
};

}  // namespace forge::ckpt
